"""Documents as retrievers produce them (issue 53 item 3): reuse of documents that end with a space, and whether
part-wise tokenization moves cold answers.

The workload is experiments/document_reuse.py's (reports shown 3 at a time, shuffled, behind a timestamped system
prompt), with each report ending with a space and the reports adjacent (as chunkers leave them: "... quarter. " then
"Report 2: ..."), where a whole-prompt tokenization merges the space into the next report's first token. It reports:

- cold against cold: the same requests with the prompt tokenized part by part (what the input processor does now)
  and as one text (before issue 53): answers right and requests whose first 16 generated tokens are the same;
- `--documentRepair none` on the spaced workload and on the original one (no trailing spaces, a newline between
  reports): cached tokens / prompt tokens, and the profile's documents block (skips by reason).

    python -m experiments.reuse.document_edges --engineDir out/engines/smollm2 --threads 2 \
        --json out/document_edges.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments.reuse._common import reports, workload
from kvforge import LLM, SamplingParams
from kvforge.runtime.engine.engine import EngineRequest
from kvforge.runtime.inputs.checks import parse_messages
from kvforge.runtime.types import Request

Messages = list[dict[str, Any]]


def spaced(messages: Messages) -> Messages:
    """Each document ends with a space and the newline text parts between them are gone."""
    system, user = messages
    parts = [p for p in user["content"] if not (p["type"] == "text" and p["text"] == "\n")]
    return [system, {"role": "user", "content": [{**p, "text": p["text"] + " "} if p["type"] == "document" else p
                                                 for p in parts]}]


def run(llm: LLM, requests: list[tuple[Messages, str]], sampling: SamplingParams,
        whole: bool = False) -> list[dict[str, Any]]:
    """Each request in turn; `whole`: its prompt tokenized as one text instead of part by part."""
    out = []
    for messages, answer in requests:
        if whole:
            engine = llm.engine
            request = Request(0, parse_messages(messages, "messages"), sampling)
            request_id = engine.add_request(EngineRequest(engine.inputs.tokenizer.encode(
                engine.inputs.prompt_text(request)), sampling))
            output = None
            while engine.has_unfinished():
                output = next((o for o in engine.step() if o.request_id == request_id and o.finished), output)
            assert output is not None
        else:
            [output] = llm.chat(messages, sampling)
        out.append({"tokens": output.token_ids, "right": answer in output.text.lower(),
                    "prompt": len(output.prompt_token_ids), "cached": output.cached_tokens})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engineDir", type=Path, required=True, help="make demo builds out/engines/smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--filler", type=int, default=6, help="as in document_reuse.py (6: about 270 tokens)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    sampling = SamplingParams(temperature=0, max_generate_length=16)
    base = workload(reports(8, args.filler), args.requests, 3, 0)
    edged = [(spaced(messages), answer) for messages, answer in base]
    cold = LLM(str(args.engineDir), num_threads=args.threads)
    part_wise, whole = run(cold, edged, sampling), run(cold, edged, sampling, whole=True)
    cold.close()
    summary: dict[str, Any] = {
        "requests": args.requests, "loadavg": Path("/proc/loadavg").read_text().strip(),
        "cold_right_part_wise": sum(r["right"] for r in part_wise), "cold_right_whole": sum(r["right"] for r in whole),
        "cold_same_16_tokens": sum(a["tokens"] == b["tokens"] for a, b in zip(part_wise, whole, strict=True)),
        "prompt_tokens_part_wise": sum(r["prompt"] for r in part_wise),
        "prompt_tokens_whole": sum(r["prompt"] for r in whole),
    }
    for name, requests in (("none_trailing_space", edged), ("none_original", base)):
        llm = LLM(str(args.engineDir), num_threads=args.threads, document_reuse=True, document_repair="none")
        results = run(llm, requests, sampling)
        cached, prompt = sum(r["cached"] for r in results), sum(r["prompt"] for r in results)
        summary[name] = {"cached": cached, "prompt": prompt, "share": round(cached / prompt, 3),
                         "documents": llm.context_cache_metrics()["documents"]}
        llm.close()
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
