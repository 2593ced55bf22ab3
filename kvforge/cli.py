"""The `kvforge` console script: the version and a one-screen map of the commands, for a newcomer's first look."""

from __future__ import annotations

import sys
import textwrap

from kvforge.cli_common import version_line

# (command, what it is for); the order is a newcomer's path: export, build, run, then check, measure, serve.
COMMANDS = [
    ("llm_export", "Export a Hugging Face / GGUF model (or a synthetic one) to an ONNX dir; LoRA and EAGLE3 too."),
    ("llm_build", "Build an ONNX dir into an engine dir with fixed limits (input length, KV capacity, batch)."),
    ("llm_inference", "Run a JSON request file through an engine; write the answers (and a profile)."),
    ("llm_test", "Run test_cases/*.json with the checks they declare (JUnit XML, JSON report)."),
    ("llm_profile", "Summarize a profile JSON, or compare two."),
    ("llm_bench", "Measure kvforge against peers (transformers, llama.cpp, onnxruntime-genai)."),
    ("llm_serve", "Serve an engine over an OpenAI-compatible HTTP API with a chat page at /."),
]


def summary() -> str:
    width = max(len(name) for name, _ in COMMANDS)
    lines = [version_line("kvforge"), "", "Commands (each takes --help and --version):"]
    indent = " " * (width + 4)  # 80 columns, as a pipe or a default terminal shows it
    lines += [textwrap.fill(text, 80, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent)
              for name, text in COMMANDS]
    lines += ["", "Python API: from kvforge import LLM, SamplingParams"]
    return "\n".join(lines)


def main() -> None:
    args = sys.argv[1:]
    if args == ["--version"]:
        print(version_line("kvforge"))
    elif not args or args[0] in ("--help", "-h"):
        print(summary())
    else:
        print(f"error: unknown argument {args[0]!r}; kvforge takes --version or --help (see the llm_* commands)",
              file=sys.stderr)
        raise SystemExit(2)
