"""The request sequences llm_bench runs on every engine, as token ids so that every engine gets the same work.

The parent process tokenizes once, with the tokenizer (and chat template) of the first kvforge engine, and
hands each engine the same ids: peers on the same weights (transformers, llama.cpp, onnxruntime-genai) share
SmolLM2's vocabulary, and a worker checks that its own tokenizer agrees. Each request carries a *role* that
says which headline figure its timing feeds (see ROLES).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.inputs.request_file import load_request_file
from kvforge.runtime.inputs.tokenizer import ChatTokenizer
from kvforge.runtime.types import Message
from kvforge.tools.bench.text import (
    CHAT_SYSTEM,
    CHAT_TURNS,
    QUESTIONS,
    SPEC_KINDS,
    UNRELATED_OPENERS,
    fit_document,
    spec_messages,
    text_tokens,
)

# role → what its requests measure (the headline table's columns read them)
ROLES = {
    "cold": "the document and its first question, nothing of it cached",
    "warm_next": "a new question on the document right after the previous question (consecutive)",
    "warm": "a new question on the document after an unrelated prompt (non-consecutive)",
    "unrelated": "a prompt sharing no prefix with anything before it",
    "chat_first": "the first turn of a chat",
    "chat": "a later chat turn: the whole history again plus one user message",
    "file": "a request of --inputFile",
    "decode_context": "a prompt of one --contextTokens length, nothing cached: decode speed after that context",
    "spec_quote": "spec_decode: the document and a request to quote it word for word (prompt lookup can copy)",
    "spec_summary": "spec_decode: the document and a request to summarise it in its own wording",
    "spec_chat": "spec_decode: a chat message with nothing in the prompt to copy (what speculation costs)",
}
DOCUMENT_ROLES = ("cold", "warm_next", "warm")  # requests with ~promptTokens of context: decode is measured there
DECODE_CONTEXT = "decode_context"  # the workload and the role of its requests
SPEC_DECODE = "spec_decode"  # speculative decoding's workload; its roles are SPEC_ROLES
SPEC_ROLES = tuple(SPEC_KINDS)
BUILTIN = ("document", "interleaved", "chat", "unrelated", DECODE_CONTEXT, SPEC_DECODE)
DEFAULT_WORKLOADS = ("document", "interleaved")
DEFAULT_CONTEXT_TOKENS = (64, 512, 1536, 4096)
MIN_DOCUMENT_TOKENS = 16
# A scripted assistant reply per chat turn: the prompts must be the same ids for every engine, so the history
# cannot hold each engine's own answers.
CHAT_REPLY = "Good question. In short: the moon's gravity pulls the water, and the details follow from that."


@dataclass(frozen=True, slots=True)
class BenchRequest:
    label: str
    role: str
    prompt_ids: list[int]


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests run one after another, alone, on a fresh session (nothing cached from earlier workloads)."""

    name: str
    description: str
    requests: list[BenchRequest] = field(default_factory=list)

    @property
    def max_prompt_tokens(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)


@dataclass(frozen=True, slots=True)
class Texts:
    """The token ids the built-in workloads are made of, for one tokenizer and one --promptTokens."""

    document: list[int]
    questions: list[list[int]]
    unrelated: list[list[int]]

    @classmethod
    def make(cls, encode: Callable[[str], list[int]], prompt_tokens: int, unrelated_tokens: int) -> Texts:
        questions = [encode(q) for q in QUESTIONS]
        # The document is cut at a token so that document + the longest question is about prompt_tokens long.
        document_tokens = prompt_tokens - max(len(q) for q in questions)
        if document_tokens < MIN_DOCUMENT_TOKENS:
            raise KvforgeError(f"{prompt_tokens} tokens leave {document_tokens} for the document next to its longest "
                               f"question; give at least {prompt_tokens - document_tokens + MIN_DOCUMENT_TOKENS}",
                               "--promptTokens")
        document = text_tokens(encode, document_tokens)[:document_tokens]
        unrelated = []
        for i, opener in enumerate(UNRELATED_OPENERS):
            head = encode(f"{opener} ")
            body = text_tokens(encode, unrelated_tokens, start=i + 1)
            unrelated.append((head + body)[:max(unrelated_tokens, len(head) + 1)])
        return cls(document, questions, unrelated)

    def ask(self, index: int) -> list[int]:
        return self.document + self.questions[index % len(self.questions)]


def document(texts: Texts) -> Workload:
    requests = [BenchRequest("Q1", "cold", texts.ask(0))]
    requests += [BenchRequest(f"Q{i + 1}", "warm_next", texts.ask(i)) for i in range(1, len(texts.questions))]
    return Workload("document", "the document with its first question, then the other questions right after it",
                    requests)


def interleaved(texts: Texts) -> Workload:
    requests = [BenchRequest("Q1", "cold", texts.ask(0))]
    for i in range(1, len(texts.questions)):
        requests.append(BenchRequest(f"U{i}", "unrelated", texts.unrelated[i - 1]))
        requests.append(BenchRequest(f"Q{i + 1}", "warm", texts.ask(i)))
    return Workload("interleaved", "the document's questions with an unrelated prompt before each later one",
                    requests)


def unrelated(texts: Texts) -> Workload:
    requests = [BenchRequest(f"U{i + 1}", "unrelated", ids) for i, ids in enumerate(texts.unrelated[:4])]
    return Workload("unrelated", "four prompts that share no prefix", requests)


def chat(tokenizer: ChatTokenizer) -> Workload:
    messages = [Message("system", CHAT_SYSTEM)]
    requests = []
    for i, turn in enumerate(CHAT_TURNS):
        messages.append(Message("user", turn))
        ids = tokenizer.encode(tokenizer.format(messages, add_generation_prompt=True))
        requests.append(BenchRequest(f"T{i + 1}", "chat_first" if i == 0 else "chat", ids))
        messages.append(Message("assistant", CHAT_REPLY))
    return Workload("chat", f"a {len(CHAT_TURNS)}-turn chat through the chat template, scripted replies", requests)


def decode_context(encode: Callable[[str], list[int]], context_tokens: Sequence[int]) -> Workload:
    """A prompt of exactly each context length; each starts from another section of the report, so no prompt
    shares a prefix with the one before it (nothing is reused: every point prefills all of its context)."""
    requests = [BenchRequest(f"C{n}", DECODE_CONTEXT, text_tokens(encode, n, start=i)[:n])
                for i, n in enumerate(context_tokens)]
    lengths = ", ".join(f"{n:,}" for n in context_tokens)
    return Workload(DECODE_CONTEXT, f"decode after {lengths} tokens of context, one prompt each", requests)


def spec_decode(tokenizer: ChatTokenizer, prompt_tokens: int) -> Workload:
    """Speculative decoding's prompts (text.spec_messages) through the chat template: 2 requests to quote the
    document, 1 to summarise it, 2 unrelated chat messages. The document is cut so that the longest document
    request is about prompt_tokens long."""

    def chat_ids(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.format([Message("user", text)], add_generation_prompt=True))

    # Tokens of a document request besides the document: the template and the longest question.
    overhead = max(len(chat_ids(text)) for kind, texts in spec_messages("").items() if kind != "spec_chat"
                   for text in texts)
    if prompt_tokens - overhead < MIN_DOCUMENT_TOKENS:
        raise KvforgeError(f"{prompt_tokens} tokens leave {prompt_tokens - overhead} for the {SPEC_DECODE} "
                           f"document next to its template and longest request; give at least "
                           f"{overhead + MIN_DOCUMENT_TOKENS}", "--promptTokens")
    text, length = fit_document(tokenizer.encode, prompt_tokens - overhead)
    if length > prompt_tokens - overhead:  # shorter than the report itself (tests' tiny models): cut it
        text = tokenizer.decode(text_tokens(tokenizer.encode, prompt_tokens - overhead)[:prompt_tokens - overhead])
    requests = [BenchRequest(f"{kind.removeprefix('spec_')}{i + 1}", kind, chat_ids(message))
                for kind, messages in spec_messages(text).items() for i, message in enumerate(messages)]
    return Workload(SPEC_DECODE, "speculative decoding: quotes and a summary of the document, unrelated chat "
                    "(chat template)", requests)


def from_request_file(path: Path, tokenizer: ChatTokenizer) -> Workload:
    """A request file of llm_inference, each request tokenized as llm_inference would (chat template or raw)."""
    parsed = load_request_file(path)
    requests = []
    for request in parsed.requests:
        if request.lora_name is not None:
            raise KvforgeError(f"requests[{request.index}].lora_name: llm_bench runs base models only "
                               "(peers have no adapters)", "inputFile")
        text = tokenizer.format(request.messages, apply_chat_template=request.apply_chat_template,
                                add_generation_prompt=request.add_generation_prompt,
                                enable_thinking=parsed.enable_thinking, where=f"requests[{request.index}].messages")
        ids = tokenizer.encode(text)
        if not ids:
            raise KvforgeError(f"requests[{request.index}]: the prompt is empty after tokenization", "inputFile")
        requests.append(BenchRequest(f"R{request.index}", "file", ids))
    if not requests:
        raise KvforgeError(f"{path} holds no requests", "inputFile")
    return Workload(f"file:{path.name}", f"the {len(requests)} requests of {path}, in file order", requests)


def build_workloads(names: Sequence[str], input_file: Path | None, tokenizer: ChatTokenizer, prompt_tokens: int,
                    unrelated_tokens: int, context_tokens: Sequence[int] = DEFAULT_CONTEXT_TOKENS) -> list[Workload]:
    texts = Texts.make(tokenizer.encode, prompt_tokens, unrelated_tokens)
    makers: dict[str, Callable[[], Workload]] = {
        "document": lambda: document(texts), "interleaved": lambda: interleaved(texts),
        "unrelated": lambda: unrelated(texts), "chat": lambda: chat(tokenizer),
        DECODE_CONTEXT: lambda: decode_context(tokenizer.encode, context_tokens),
        SPEC_DECODE: lambda: spec_decode(tokenizer, prompt_tokens)}
    workloads = [makers[name]() for name in names]
    if input_file is not None:
        workloads.append(from_request_file(input_file, tokenizer))
    return workloads


def warmup(tokenizer: ChatTokenizer, num_tokens: int) -> list[BenchRequest]:
    """Before measuring, each engine runs a prompt of num_tokens of other text and then the same prompt with another
    ending, so first-call costs (session start, arena growth, the cached-context path) stay out of the figures."""
    other = text_tokens(tokenizer.encode, num_tokens, start=5)[:num_tokens]
    tail = max(1, min(16, num_tokens // 4))
    return [BenchRequest("warmup-1", "warmup", other),
            BenchRequest("warmup-2", "warmup", other[:-tail] + other[:tail])]
