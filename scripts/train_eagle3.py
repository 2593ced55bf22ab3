"""Train an EAGLE3 draft for SmolLM2-135M-Instruct on the CPU from the model's own greedy generations.

Saves it in the public Hugging Face EAGLE3 format (SpecForge / vLLM `LlamaForCausalLMEagle3`): a directory with
config.json and model.safetensors (fc, midlayer.*, norm, lm_head over a reduced draft vocabulary, d2t, t2d; no
embed_tokens: the draft shares the target's embedding table), plus train_metrics.json and generations.json.

Phases (one run, all on `--threads` CPU threads):
 1. data: chat questions and questions/summaries on documents (experiments/data/quality_text.txt windows, synthetic
    prompts; not the technical report experiments/spec/spec_decode.py measures on), answered greedily by kvforge's own
    engine built from `--onnxDir` (the default int4 export, which is what a draft will be verified against);
 2. target features: a float32 torch LlamaForCausalLM on the GGUF weights (kvforge's loader) is run teacher-forced
    over prompt+answer: the outputs of decoder layers 1, 14, 26 (0-based; vLLM's capture ids 2, 15, 27) at every
    position, and the target's greedy next token at prompt positions (answer positions use the engine's tokens);
 3. training: EAGLE3 with training-time test (`--ttt` unrolled steps: step 0 reads fc(aux hidden states), later
    steps feed the draft's own output back, attending to step-0 keys causally plus their own earlier steps' keys at
    the same position, RoPE positions advanced by one per step, as SpecForge does); cross-entropy on the target's
    greedy tokens mapped to the draft vocabulary, step k weighted 0.8**k; AdamW, cosine learning rate over the time
    budget. Held-out lines: loss and top-1 per unrolled step;
 4. evaluation: top-1 per step and the offline acceptance estimate on held-out sequences: at each answer position,
    how many of k=4 chained greedy drafts equal the engine's own next tokens (stopping at the first miss); the
    acceptance length is that plus one (tokens committed per verify row).

EAGLE shift: the draft at position p takes embed(token p+1) and the target hidden state at p, predicts token p+2,
with RoPE position p (step k: p+k).

    python -m scripts.train_eagle3 --onnxDir out/onnx/smollm2 --outputDir out/eagle3/smollm2-draft \\
        --timeBudgetMinutes 50

`--timeBudgetMinutes` bounds the whole run (generation, features and training; training stops so that the final
evaluation and the save fit in it). torch and transformers are bench-time dependencies only.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AUX_LAYERS = [1, 14, 26]  # kvforge convention: outputs of these decoder layers (0-based)
VLLM_AUX_IDS = [i + 1 for i in AUX_LAYERS]  # vLLM/SpecForge: capture entering layer i = output of layer i-1
VOCAB_CANDIDATES = [1024, 2048, 4096, 8192, 16384]
STEP_DECAY = 0.8
ACCEPT_K = 4


# ------------------------------------------------------------------------------------------------ prompts

CHAT_TOPICS = [
    "black holes", "photosynthesis", "the French Revolution", "how vaccines work", "climate change",
    "the water cycle", "machine learning", "the Roman Empire", "volcanoes", "healthy sleep habits",
    "the stock market", "electric cars", "the human heart", "recycling", "the Internet", "honey bees",
    "the Moon landing", "saving money", "learning a new language", "the Great Wall of China", "rainbows",
    "earthquakes", "the immune system", "solar panels", "coffee", "chess", "the Olympic Games", "gravity",
    "DNA", "the Amazon rainforest", "time management", "public speaking", "cloud computing", "dinosaurs",
    "the printing press", "ocean tides", "meditation", "bread baking", "airplanes", "the piano",
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.", "Give me a brief overview of {t}.",
    "Why is {t} important?", "Write a short poem about {t}.", "Describe {t} to a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?", "Summarize the history of {t} in a few sentences.",
    "List five key terms related to {t} and define each briefly.", "Write a haiku about {t}.",
    "What is a common misconception about {t}?", "How would you teach a beginner about {t}?",
    "Write a short story that involves {t}.", "Give three tips related to {t}.",
]
SHORT_CHAT = [
    "What is the capital of Italy?", "How many days are in a leap year?", "What is 12 times 8?",
    "Translate into Spanish: Where is the train station?", "Suggest a name for a coffee shop.",
    "What is the boiling point of water in Fahrenheit?", "Write a one-line joke about computers.",
    "Who wrote Romeo and Juliet?", "Give me a synonym for happy.", "What is the largest planet in our solar system?",
    "Convert 5 kilometres to miles.", "What day comes after Friday?", "Name three kinds of fruit.",
    "Write an email asking my manager for a day off next Monday.", "How do I make a cup of tea?",
    "What should I pack for a weekend camping trip?", "Rewrite in a formal tone: hey, can u send me the file?",
    "Write a Python function that returns the sum of a list.", "What is the difference between weather and climate?",
    "Give me a motivational quote and explain it.",
]
DOC_TASKS = [
    "Summarise the text above in a few sentences.", "Summarize the passage above in about fifty words.",
    "Write a one-paragraph summary of the text above, reusing its own wording.",
    "Copy, word for word, the first paragraph of the text above.",
    "Quote exactly the sentence of the text above that mentions {w}.",
    "What does the text above say about {w}? Answer using its words.",
    "List the people and places named in the text above.", "Who are the main characters in the text above?",
    "What happens in the text above? Answer in three bullet points.",
    "Rewrite the last paragraph of the text above in simpler English.",
    "Answer from the text above: what is said about {w}?", "Give the text above a title and explain your choice.",
    "Continue the story above for a few sentences in the same style.",
    "Extract the key facts from the text above as a numbered list.",
]


def document_prompts(rng: random.Random, count: int, text: str) -> list[str]:
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    words = sorted({w.strip(".,;:!?\"'()").lower() for w in text.split() if len(w) > 6})
    prompts = []
    for _ in range(count):
        n = rng.randint(1, 5)
        start = rng.randrange(0, max(1, len(paragraphs) - n + 1))
        doc = "\n\n".join(paragraphs[start:start + n])
        task = rng.choice(DOC_TASKS).format(w=rng.choice(words))
        prompts.append(f"{doc}\n\n{task}" if rng.random() < 0.8 else f"{task}\n\n{doc}")
    return prompts


def chat_prompts(rng: random.Random, count: int) -> list[str]:
    quality = json.loads((ROOT / "experiments/data/quality_prompts.json").read_text())["prompts"]
    pool = [p["content"] for p in quality] + SHORT_CHAT
    out = []
    for _ in range(count):
        if rng.random() < 0.3:
            out.append(rng.choice(pool))
        else:
            out.append(rng.choice(CHAT_TEMPLATES).format(t=rng.choice(CHAT_TOPICS)))
    return out


def build_prompts(rng: random.Random, count: int) -> list[str]:
    text = (ROOT / "experiments/data/quality_text.txt").read_text()
    n_doc = round(count * 0.45)
    prompts = document_prompts(rng, n_doc, text) + chat_prompts(rng, count - n_doc)
    rng.shuffle(prompts)
    return prompts


# ---------------------------------------------------------------------------------------------- helpers

class Clock:
    def __init__(self, budget_minutes: float) -> None:
        self.start = time.perf_counter()
        self.budget = budget_minutes * 60.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        print(f"[{self.elapsed / 60:5.1f} min] {message}", flush=True)


@dataclass
class Sample:
    tokens: np.ndarray  # int64 [N]: prompt + answer
    prompt_len: int
    aux: Any = None  # torch float32 [N, 3*576]
    labels: Any = None  # torch int64 [N]: the target's greedy next token at each position (-1: none)


# -------------------------------------------------------------------------------------------- generation

def generate(args: argparse.Namespace, prompts: list[str], clock: Clock) -> list[dict[str, Any]]:
    from kvforge import LLM, SamplingParams
    from kvforge.builder.build import BuildOptions, build_engine

    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvforge-eagle3-") as tmp:  # the engine is not part of the checkpoint
        engine_dir = Path(tmp) / "engine"
        build_engine(args.onnxDir, engine_dir, BuildOptions(max_input_len=2048, max_batch_size=16, tokens_per_page=128,
                                                            max_kv_cache_capacity=2048 + args.maxTokens))
        llm = LLM(engine_dir, num_threads=args.threads)
        params = SamplingParams(temperature=0.0, max_generate_length=args.maxTokens)
        chunk = 16
        for i in range(0, len(prompts), chunk):
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts[i:i + chunk]], params)
            for out in outs:
                records.append({"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(out.token_ids)})
            tokens = sum(len(r["token_ids"]) for r in records)
            clock.log(f"generated {len(records)}/{len(prompts)} answers, {tokens} tokens")
        del llm
    return records


# ------------------------------------------------------------------------------------------------ target

def load_target() -> tuple[Any, dict[str, np.ndarray], Any]:
    from experiments._common import torch_llama
    from kvforge.tools.export.sources.gguf import find_smollm2_gguf, load_gguf

    loaded = load_gguf(find_smollm2_gguf())
    return torch_llama(loaded), loaded.weights, loaded.config


def target_features(model: Any, samples: list[Sample], clock: Clock, prompt_labels: bool,
                    tokens_per_batch: int = 2048) -> None:
    """Fill each sample's aux hidden states (outputs of AUX_LAYERS) and next-token labels: the engine's greedy tokens
    on the answer, the torch target's greedy prediction at prompt positions when `prompt_labels` (otherwise -1 there,
    and the layers after the last aux layer are not run)."""
    import torch

    layers = model.model.layers
    if not prompt_labels:
        model.model.layers = layers[:AUX_LAYERS[-1] + 1]

    captured: dict[int, Any] = {}
    hooks = []
    for layer in AUX_LAYERS:
        def hook(_module: Any, _inputs: Any, output: Any, layer: int = layer) -> None:
            captured[layer] = output[0] if isinstance(output, tuple) else output
        hooks.append(model.model.layers[layer].register_forward_hook(hook))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].tokens))
    done = 0
    last = time.perf_counter()
    with torch.inference_mode():
        for batch in _length_batches(order, [len(s.tokens) for s in samples], tokens_per_batch):
            n_max = max(len(samples[i].tokens) for i in batch)
            ids = torch.zeros(len(batch), n_max, dtype=torch.long)
            mask = torch.zeros(len(batch), n_max, dtype=torch.long)
            for row, i in enumerate(batch):
                n = len(samples[i].tokens)
                ids[row, :n] = torch.from_numpy(samples[i].tokens)
                mask[row, :n] = 1
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            aux = torch.cat([captured[layer] for layer in AUX_LAYERS], dim=-1)
            for row, i in enumerate(batch):
                s = samples[i]
                n = len(s.tokens)
                s.aux = aux[row, :n].clone()
                labels = torch.full((n,), -1, dtype=torch.long)
                p = s.prompt_len
                if p > 1 and prompt_labels:  # prompt positions: the target's own greedy prediction
                    labels[:p - 1] = model.lm_head(hidden[row, :p - 1]).argmax(-1)
                labels[p - 1:n - 1] = torch.from_numpy(s.tokens[p:n])  # answer: the engine's greedy tokens
                s.labels = labels
            done += len(batch)
            if time.perf_counter() - last > 30 or done == len(samples):
                last = time.perf_counter()
                clock.log(f"target features {done}/{len(samples)} sequences")
    for h in hooks:
        h.remove()
    model.model.layers = layers


def _length_batches(order: list[int], lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = max([lengths[j] for j in current] + [lengths[i]])
        if current and width * (len(current) + 1) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


# ------------------------------------------------------------------------------------------ draft vocab

def choose_vocab(train: list[Sample], held: list[Sample], vocab_size: int, requested: int,
                 clock: Clock) -> tuple[np.ndarray, dict[str, Any]]:
    """Draft vocabulary: target ids ranked by how often the target emits them in the training answers, then by how
    often they occur anywhere in the training sequences (prompt text is what answers copy), then by id; sorted
    ascending (so d2t >= 0). `requested` 0 chooses a size by held-out coverage."""
    answer = np.zeros(vocab_size, np.int64)
    anything = np.zeros(vocab_size, np.int64)
    for s in train:
        lab = s.labels.numpy()
        np.add.at(answer, lab[s.prompt_len - 1:][lab[s.prompt_len - 1:] >= 0], 1)
        np.add.at(anything, s.tokens, 1)
        np.add.at(anything, lab[lab >= 0], 1)
    ranking = np.lexsort((np.arange(vocab_size), -anything, -answer))
    held_answer = np.concatenate([s.labels.numpy()[s.prompt_len - 1:] for s in held])
    held_answer = held_answer[held_answer >= 0]
    coverage = {}
    for size in VOCAB_CANDIDATES + ([requested] if requested else []):
        chosen = np.zeros(vocab_size, bool)
        chosen[ranking[:size]] = True
        coverage[size] = float(chosen[held_answer].mean()) if len(held_answer) else 1.0
    seen = int((answer > 0).sum())
    clock.log(f"distinct answer tokens in training: {seen}; held-out answer coverage: "
              + ", ".join(f"{k}: {v:.4f}" for k, v in sorted(coverage.items())))
    if requested:
        size = requested
    else:  # smallest candidate within 0.5 points of the largest one's coverage
        best = coverage[VOCAB_CANDIDATES[-1]]
        size = next(k for k in VOCAB_CANDIDATES if coverage[k] >= best - 0.005)
    ids = np.sort(ranking[:size])
    return ids, {"draft_vocab_size": int(size), "held_out_answer_coverage": coverage[size],
                 "coverage_by_size": {str(k): v for k, v in sorted(coverage.items())},
                 "distinct_training_answer_tokens": seen}


# ------------------------------------------------------------------------------------------- the draft

def build_draft(torch: Any, target_weights: dict[str, np.ndarray], c: Any, draft_ids: np.ndarray) -> Any:
    nn = torch.nn
    F = torch.nn.functional

    H = c.hidden_size
    heads, kv_heads, head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    eps = c.rms_norm_eps

    class RMSNorm(nn.Module):
        def __init__(self, init: np.ndarray | None = None) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(H) if init is None else torch.tensor(init, dtype=torch.float32))

        def forward(self, x: Any) -> Any:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def linear(n_in: int, n_out: int, init: np.ndarray | None = None, std: float = 0.02) -> Any:
        layer = nn.Linear(n_in, n_out, bias=False)
        with torch.no_grad():
            if init is None:
                layer.weight.normal_(0.0, std)
            else:
                layer.weight.copy_(torch.tensor(init, dtype=torch.float32))
        return layer

    last = c.num_hidden_layers - 1
    tw = target_weights

    def w(name: str) -> np.ndarray:
        return np.asarray(tw[name], np.float32)

    class Draft(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            fc = np.random.default_rng(0).normal(0.0, 0.01, (H, 3 * H)).astype(np.float32)
            fc[:, 2 * H:] += np.eye(H, dtype=np.float32)  # start from the deepest aux layer's features
            self.fc = linear(3 * H, H, fc)
            self.hidden_norm = RMSNorm()
            self.input_layernorm = RMSNorm(w("model.layers.0.input_layernorm.weight"))
            # q/k/v read cat(embedding half, hidden half): start from the target's last layer on both halves
            q, k, v = (w(f"model.layers.{last}.self_attn.{n}_proj.weight") for n in "qkv")
            self.q_proj = linear(2 * H, heads * head_dim, np.concatenate([q, q], 1) * 0.5)
            self.k_proj = linear(2 * H, kv_heads * head_dim, np.concatenate([k, k], 1) * 0.5)
            self.v_proj = linear(2 * H, kv_heads * head_dim, np.concatenate([v, v], 1) * 0.5)
            self.o_proj = linear(heads * head_dim, H, w(f"model.layers.{last}.self_attn.o_proj.weight") * 0.5)
            self.post_attention_layernorm = RMSNorm(w(f"model.layers.{last}.post_attention_layernorm.weight"))
            self.gate_proj = linear(H, c.intermediate_size, w(f"model.layers.{last}.mlp.gate_proj.weight"))
            self.up_proj = linear(H, c.intermediate_size, w(f"model.layers.{last}.mlp.up_proj.weight"))
            self.down_proj = linear(c.intermediate_size, H, w(f"model.layers.{last}.mlp.down_proj.weight"))
            self.norm = RMSNorm(w("model.norm.weight"))
            head = tw.get("lm_head.weight", tw["model.embed_tokens.weight"])
            self.lm_head = linear(H, len(draft_ids), np.asarray(head, np.float32)[draft_ids])
            self.register_buffer("embed", torch.tensor(np.asarray(tw["model.embed_tokens.weight"], np.float32)),
                                 persistent=False)
            inv = 1.0 / (c.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
            self.register_buffer("inv_freq", inv, persistent=False)

        def rope(self, x: Any, positions: Any) -> Any:
            freqs = positions[..., None].double() * self.inv_freq  # [B, L, D/2]
            emb = torch.cat([freqs, freqs], -1)
            cos, sin = emb.cos().float()[:, None], emb.sin().float()[:, None]
            x1, x2 = x[..., :head_dim // 2], x[..., head_dim // 2:]
            return x * cos + torch.cat([-x2, x1], -1) * sin

        def layer(self, e: Any, h: Any, positions: Any, main_keys: Any, main_values: Any, main_mask: Any,
                  own: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
            """One midlayer pass for queries at `positions`: attend to `main_keys` (step-0 keys of every position,
            under `main_mask`; None = these queries' own keys, causally) plus the keys of the same position from
            earlier unrolled steps (`own`, appended to). Returns the new hidden state and this pass's K, V."""
            B, A = h.shape[:2]
            residual = h
            x = torch.cat([self.input_layernorm(e), self.hidden_norm(h)], -1)
            q = self.rope(self.q_proj(x).view(B, A, heads, head_dim).transpose(1, 2), positions)
            k = self.rope(self.k_proj(x).view(B, A, kv_heads, head_dim).transpose(1, 2), positions)
            v = self.v_proj(x).view(B, A, kv_heads, head_dim).transpose(1, 2)
            group = heads // kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scale = 1.0 / math.sqrt(head_dim)
            if main_keys is None:
                main_keys, main_values = k, v
            scores = (q @ main_keys.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~main_mask, float("-inf"))
            own = own + [(k, v)]
            diag = [(q * ki).sum(-1, keepdim=True) * scale for ki, _ in own[1:]] if main_keys is not k else []
            probs = torch.softmax(torch.cat([scores, *diag], -1), -1)
            L = main_keys.shape[2]
            attn = probs[..., :L] @ main_values
            for i, (_, vi) in enumerate(own[1:]):
                attn = attn + probs[..., L + i:L + i + 1] * vi
            attn = attn.transpose(1, 2).reshape(B, A, heads * head_dim)
            h = residual + self.o_proj(attn)
            m = self.post_attention_layernorm(h)
            h = h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
            return h, k, v

        def forward(self, tokens: Any, aux: Any, idx: Any, steps: int) -> list[Any]:
            """tokens [B, L+steps] (the draft's input tokens: token p+1 at draft position p), aux [B, L, 3H], idx
            [B, A] the draft positions scored. Returns the logits [B, A, Vd] of each unrolled step; step k at
            position p reads token p+1+k, RoPE position p+k, and predicts token p+2+k.

            Step 0 runs at every position (its keys are the context every later query reads: at inference the
            draft KV of verified positions comes from the target's hidden states); steps >= 1 only at idx."""
            B, L = aux.shape[:2]
            pos = torch.arange(L)[None].expand(B, L)
            causal = torch.ones(L, L, dtype=torch.bool).tril()
            e = F.embedding(tokens[:, :L], self.embed)
            h0, k0, v0 = self.layer(e, self.fc(aux), pos, None, None, causal, [])
            gather = idx[..., None].expand(-1, -1, h0.shape[-1])
            h = h0.gather(1, gather)
            outputs = [self.lm_head(self.norm(h))]
            mask = (torch.arange(L)[None, None, None, :] <= idx[:, None, :, None])  # [B, 1, A, L]
            own: list[tuple[Any, Any]] = [(None, None)]
            for k in range(1, steps):
                e = F.embedding(tokens.gather(1, idx + k), self.embed)
                h, kk, vv = self.layer(e, h, idx + k, k0, v0, mask, own)
                own.append((kk, vv))
                outputs.append(self.lm_head(self.norm(h)))
            return outputs

    return Draft()


# --------------------------------------------------------------------------------------------- batches

def make_batch(torch: Any, samples: list[Sample], steps: int, t2d_index: Any, prompt_weight: float) -> dict[str, Any]:
    """Draft positions p = 0..N-2 of each sequence; step k reads token p+1+k and is scored against the target's
    greedy token after position p+1+k (labels[p+1+k]) mapped to the draft vocabulary. Scored positions (idx): from
    the last prompt position on (every position when prompt_weight > 0)."""
    L = max(len(s.tokens) for s in samples) - 1
    B = len(samples)
    starts = [0 if prompt_weight > 0 else s.prompt_len - 2 for s in samples]
    A = max(len(s.tokens) - 1 - start for s, start in zip(samples, starts, strict=True))
    tokens = torch.zeros(B, L + steps, dtype=torch.long)
    aux = torch.zeros(B, L, samples[0].aux.shape[-1])
    labels = torch.full((B, L + steps), -1, dtype=torch.long)
    weight = torch.zeros(B, L + steps)
    answer = torch.zeros(B, L + steps, dtype=torch.bool)
    chain = torch.zeros(B, L + steps, dtype=torch.bool)
    idx = torch.zeros(B, A, dtype=torch.long)
    slot = torch.zeros(B, A, dtype=torch.bool)
    for b, (s, start) in enumerate(zip(samples, starts, strict=True)):
        n = len(s.tokens)
        tokens[b, :n - 1] = torch.from_numpy(s.tokens[1:])
        aux[b, :n - 1] = s.aux[:n - 1]
        lab = s.labels[1:n]  # index j here is sequence position j+1
        mapped = torch.where(lab >= 0, t2d_index[lab.clamp(min=0)], torch.full_like(lab, -1))
        labels[b, :n - 1] = mapped
        w = torch.full((n - 1,), prompt_weight)
        w[s.prompt_len - 2:] = 1.0  # predictions at positions >= prompt_len-1 are the answer's tokens
        answer[b, s.prompt_len - 2:n - 2] = True  # out-of-vocabulary labels stay in: they count as misses
        # real drafting starts at the first generated token (p = prompt_len-1) and needs ACCEPT_K labels after it
        chain[b, s.prompt_len - 1:n - 1 - ACCEPT_K] = True
        w[mapped < 0] = 0.0
        weight[b, :n - 1] = w
        count = n - 1 - start
        idx[b, :count] = torch.arange(start, n - 1)
        idx[b, count:] = n - 2
        slot[b, :count] = True
    return {"tokens": tokens, "aux": aux, "labels": labels, "weight": weight, "answer": answer, "chain": chain,
            "idx": idx, "slot": slot}


def step_slices(batch: dict[str, Any], k: int) -> tuple[Any, Any, Any]:
    """Labels, loss weights and the answer mask of unrolled step k at the scored positions [B, A]."""
    at = batch["idx"] + k
    slot = batch["slot"]
    return (batch["labels"].gather(1, at), batch["weight"].gather(1, at) * slot,
            batch["answer"].gather(1, at) & slot)


def loss_of(torch: Any, outputs: list[Any], batch: dict[str, Any]) -> tuple[Any, list[float]]:
    F = torch.nn.functional
    total = 0.0
    losses = []
    for k, logits in enumerate(outputs):
        labels, weight, _ = step_slices(batch, k)
        ce = F.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
        w = weight.flatten()
        step_loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        losses.append(float(step_loss.detach()))
        total = total + (STEP_DECAY ** k) * step_loss
    return total, losses


def evaluate(torch: Any, draft: Any, batches: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Held-out loss and top-1 per unrolled step (answer positions), and the k=ACCEPT_K chain acceptance."""
    eval_steps = max(steps, ACCEPT_K)
    correct = np.zeros(eval_steps)
    count = np.zeros(eval_steps)
    loss_sum = np.zeros(eval_steps)
    accepted: list[Any] = []
    with torch.no_grad():
        for batch in batches:
            outputs = draft(batch["tokens"], batch["aux"], batch["idx"], eval_steps)
            _, losses = loss_of(torch, outputs, batch)
            hits = []
            for k, logits in enumerate(outputs):
                labels, _, answer = step_slices(batch, k)
                hit = logits.argmax(-1) == labels  # labels -1 (out of the draft vocabulary) never match
                correct[k] += float((hit & answer).sum())
                count[k] += float(answer.sum())
                loss_sum[k] += losses[k]
                hits.append(hit)
            # greedy chain of ACCEPT_K drafts from each generated-token position: accepted up to the first miss
            valid = batch["chain"].gather(1, batch["idx"]) & batch["slot"]
            run = torch.ones_like(valid)
            length = torch.zeros(valid.shape, dtype=torch.long)
            for k in range(ACCEPT_K):
                run = run & hits[k]
                length += run.long()
            accepted.append(length[valid].numpy())
    acc = np.concatenate(accepted) if accepted else np.zeros(0)
    return {"top1_per_step": [float(c / max(n, 1)) for c, n in zip(correct, count, strict=True)],
            "loss_per_step": [float(x / max(len(batches), 1)) for x in loss_sum],
            "answer_positions": int(count[0]),
            "chain_positions": int(len(acc)),
            "mean_accepted_drafts_k4": float(acc.mean()) if len(acc) else 0.0,
            "acceptance_length_k4": float(acc.mean() + 1.0) if len(acc) else 1.0,
            "accepted_histogram_k4": [int((acc == i).sum()) for i in range(ACCEPT_K + 1)]}


def fmt(metrics: dict[str, Any]) -> str:
    top1 = " ".join(f"{x:.3f}" for x in metrics["top1_per_step"])
    loss = " ".join(f"{x:.2f}" for x in metrics["loss_per_step"])
    accept = metrics["acceptance_length_k4"]
    return f"held-out loss/step [{loss}] top-1/step [{top1}] acceptance length (k=4) {accept:.3f}"


# ------------------------------------------------------------------------------------------------- save

def save(torch: Any, draft: Any, c: Any, args: argparse.Namespace, draft_ids: np.ndarray, out: Path) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().float().contiguous() for k, v in draft.state_dict().items()}
    tensors = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"midlayer.{name}.weight"] = sd[f"{name}.weight"]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        tensors[f"midlayer.self_attn.{name}.weight"] = sd[f"{name}.weight"]
    for name in ("gate_proj", "up_proj", "down_proj"):
        tensors[f"midlayer.mlp.{name}.weight"] = sd[f"{name}.weight"]
    ids = torch.from_numpy(draft_ids.astype(np.int64))
    tensors["d2t"] = ids - torch.arange(len(ids), dtype=torch.int64)
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "draft_vocab_size": int(len(draft_ids)), "target_hidden_size": c.hidden_size,
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": VLLM_AUX_IDS},
        "kvforge_hidden_state_layers": AUX_LAYERS, "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_ids[0] if c.eos_token_ids else None,
        "target_model": c.name,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------- main

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--outputDir", type=Path, default=Path("out/eagle3/smollm2-draft"),
                        help="where the EAGLE3 checkpoint (config.json, model.safetensors) and metrics are written")
    parser.add_argument("--onnxDir", type=Path, default=Path("out/onnx/smollm2"),
                        help="llm_export output of SmolLM2 whose engine generates the training answers")
    parser.add_argument("--numPrompts", type=int, default=224, help="prompts answered to make the data")
    parser.add_argument("--maxTokens", type=int, default=160, help="max generated tokens per answer")
    parser.add_argument("--epochs", type=float, default=100.0,
                        help="stop after this many passes over the training data (the time budget usually stops first)")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    parser.add_argument("--ttt", type=int, default=4, help="unrolled training-time-test steps")
    parser.add_argument("--draftVocab", type=int, default=0,
                        help=f"draft vocabulary size; 0 = the smallest of {VOCAB_CANDIDATES} whose held-out coverage "
                             "is within 0.5 points of the largest's")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (cosine over the budget)")
    parser.add_argument("--tokensPerBatch", type=int, default=2048, help="padded tokens per training batch")
    parser.add_argument("--promptWeight", type=float, default=0.0,
                        help="loss weight of prompt positions (answer positions weigh 1); > 0 also scores every "
                             "prompt position against the torch target's greedy token (slower)")
    parser.add_argument("--heldOut", type=float, default=0.1, help="fraction of sequences held out")
    parser.add_argument("--evalEvery", type=float, default=4.0, help="minutes between held-out evaluations")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch and the engine)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (prompts, split, init, batch order)")
    parser.add_argument("--timeBudgetMinutes", type=float, default=50.0,
                        help="wall budget of the whole run; training stops so evaluation and save fit in it")
    parser.add_argument("--reuseGenerations", action="store_true",
                        help="read OUTPUTDIR/generations.json from an earlier run instead of generating")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    clock = Clock(args.timeBudgetMinutes)
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    args.outputDir.mkdir(parents=True, exist_ok=True)
    gen_path = args.outputDir / "generations.json"

    # 1. data
    if args.reuseGenerations and gen_path.is_file():
        records = json.loads(gen_path.read_text())["records"]
        clock.log(f"read {len(records)} generations from {gen_path}")
    else:
        if not (args.onnxDir / "model.onnx").is_file():
            raise SystemExit(f"no ONNX export in {args.onnxDir}; run: llm_export smollm2-135m-instruct "
                             f"--outputDir {args.onnxDir}")
        prompts = build_prompts(rng, args.numPrompts)
        records = generate(args, prompts, clock)
        gen_path.write_text(json.dumps({"onnx_dir": str(args.onnxDir), "max_tokens": args.maxTokens,
                                        "records": records}))
    samples = [Sample(np.array(r["prompt_token_ids"] + r["token_ids"], np.int64), len(r["prompt_token_ids"]))
               for r in records if len(r["token_ids"]) >= 2]
    gen_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    clock.log(f"{len(samples)} sequences, {sum(len(s.tokens) for s in samples)} tokens ({gen_tokens} generated)")

    # 2. target features
    target, target_weights, c = load_target()
    target_features(target, samples, clock, prompt_labels=args.promptWeight > 0)
    del target

    order = list(range(len(samples)))
    rng.shuffle(order)
    n_held = max(2, round(len(samples) * args.heldOut))
    held = [samples[i] for i in order[:n_held]]
    train = [samples[i] for i in order[n_held:]]
    draft_ids, vocab_info = choose_vocab(train, held, c.vocab_size, args.draftVocab, clock)
    t2d_index = torch.full((c.vocab_size,), -1, dtype=torch.long)
    t2d_index[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    coverage = vocab_info["held_out_answer_coverage"]
    clock.log(f"draft vocabulary {len(draft_ids)}, held-out answer coverage {coverage:.4f};"
              f" {len(train)} training / {len(held)} held-out sequences")

    def batches_of(split: list[Sample], steps: int, shuffle: bool) -> list[dict[str, Any]]:
        idx = sorted(range(len(split)), key=lambda i: len(split[i].tokens))
        groups = _length_batches(idx, [len(s.tokens) for s in split], args.tokensPerBatch)
        if shuffle:
            rng.shuffle(groups)
        return [make_batch(torch, [split[i] for i in g], steps, t2d_index, args.promptWeight) for g in groups]

    held_batches = batches_of(held, max(args.ttt, ACCEPT_K), False)
    train_batches = batches_of(train, args.ttt, True)

    # 3. training
    draft = build_draft(torch, target_weights, c, draft_ids)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0 = time.perf_counter()
    metrics0 = evaluate(torch, draft, held_batches, args.ttt)
    eval_seconds = time.perf_counter() - t0
    clock.log(f"before training: {fmt(metrics0)} ({eval_seconds:.0f} s per evaluation)")
    train_start = clock.elapsed
    reserve = 2 * eval_seconds + 30  # final evaluation and save
    train_seconds = max(1.0, clock.budget - train_start - reserve)
    history = [{"minutes": clock.elapsed / 60, "step": 0, **metrics0}]
    step = 0
    epoch = 0.0
    last_eval = time.perf_counter()
    last_log = time.perf_counter()
    window: list[list[float]] = []
    stop_reason = "epochs"
    warmup = 20
    while epoch < args.epochs:
        for i, batch in enumerate(train_batches):
            progress = (clock.elapsed - train_start) / train_seconds
            if progress >= 1.0:
                stop_reason = "time budget"
                break
            if args.steps and step >= args.steps:
                stop_reason = "steps"
                break
            lr = args.lr * min(1.0, (step + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
            for group in optimizer.param_groups:
                group["lr"] = lr
            outputs = draft(batch["tokens"], batch["aux"], batch["idx"], args.ttt)
            loss, losses = loss_of(torch, outputs, batch)
            with torch.no_grad():
                top1 = []
                for k, logits in enumerate(outputs):
                    labels, _, answer = step_slices(batch, k)
                    top1.append(float(((logits.argmax(-1) == labels) & answer).sum() / answer.sum().clamp(min=1)))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            window.append(losses + top1)
            if time.perf_counter() - last_log > 60:
                mean = np.mean(window, 0)
                window = []
                last_log = time.perf_counter()
                n = args.ttt
                clock.log(f"epoch {epoch + (i + 1) / len(train_batches):.2f} step {step} lr {lr:.2e} train loss/step ["
                          + " ".join(f"{x:.2f}" for x in mean[:n]) + "] top-1/step ["
                          + " ".join(f"{x:.3f}" for x in mean[n:]) + "]")
            if time.perf_counter() - last_eval > args.evalEvery * 60:
                m = evaluate(torch, draft, held_batches, args.ttt)
                last_eval = time.perf_counter()
                history.append({"minutes": clock.elapsed / 60, "step": step, **m})
                clock.log(f"step {step}: {fmt(m)}")
        else:
            epoch += 1
            rng.shuffle(train_batches)
            continue
        break
    clock.log(f"training stopped ({stop_reason}) after {step} steps, {epoch:.0f} full epochs")

    # 4. evaluation and save
    final = evaluate(torch, draft, held_batches, args.ttt)
    clock.log(f"final: {fmt(final)}")
    save(torch, draft, c, args, draft_ids, args.outputDir)
    metrics = {"final": final, "before_training": metrics0, "history": history, "vocab": vocab_info,
               "aux_layers_kvforge": AUX_LAYERS, "aux_layer_ids_vllm": VLLM_AUX_IDS,
               "data": {"sequences": len(samples), "train_sequences": len(train), "held_out_sequences": len(held),
                        "tokens": int(sum(len(s.tokens) for s in samples)), "generated_tokens": int(gen_tokens)},
               "training": {"steps": step, "stop_reason": stop_reason, "ttt": args.ttt, "lr": args.lr,
                            "threads": args.threads, "seed": args.seed, "minutes_total": clock.elapsed / 60,
                            "minutes_training": (clock.elapsed - train_start) / 60},
               "args": {k: str(v) for k, v in vars(args).items()}}
    (args.outputDir / "train_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    clock.log(f"saved the EAGLE3 draft to {args.outputDir.resolve()} (acceptance length k=4 "
              f"{final['acceptance_length_k4']:.3f}, top-1/step {[round(x, 3) for x in final['top1_per_step']]})")


if __name__ == "__main__":
    sys.exit(main())
