"""Turns a parsed request into an engine request: prompt text, token ids, adapter, checked against the engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.contract.errors import KvforgeError
from kvforge.contract.profile_schema import SKIP_EDGE_MERGE, SKIP_REFUSED
from kvforge.contract.validation import join_path, utf8_size
from kvforge.runtime.adapters import LoraRegistry
from kvforge.runtime.inputs.segments import segment_messages
from kvforge.runtime.inputs.tokenizer import ChatTokenizer, RenderedPrompt
from kvforge.runtime.media_spans import DocumentSpan
from kvforge.runtime.sequence import EngineRequest
from kvforge.runtime.types import MEDIA_SENTINEL, Message, Request, SamplingParams

if TYPE_CHECKING:
    from tokenizers import Tokenizer

if TYPE_CHECKING:
    from kvforge.runtime.inputs.multimodal.processor import MultimodalProcessor


class InputProcessor:
    __slots__ = ("tokenizer", "loras", "max_input_len", "reuse_enabled", "vocab_size", "multimodal",
                 "message_boundaries", "max_text_bytes", "segment_min_tokens")

    def __init__(self, tokenizer: ChatTokenizer, loras: LoraRegistry, max_input_len: int, reuse_enabled: bool,
                 vocab_size: int, *, multimodal: MultimodalProcessor | None = None,
                 message_boundaries: bool = False, segment_min_tokens: int = 0) -> None:
        """`multimodal`: the engine's encoder front (media requests); `message_boundaries`: recurrent engines that
        capture checkpoints where chat messages end want those positions on each request; `segment_min_tokens`:
        blocks of system and user text between blank lines at least this many tokens long are documents
        (--documentSegments paragraphs, segments.py; 0: off)."""
        self.tokenizer = tokenizer
        self.loras = loras
        self.max_input_len = max_input_len
        self.reuse_enabled = reuse_enabled
        self.vocab_size = vocab_size
        self.multimodal = multimodal
        self.message_boundaries = message_boundaries
        self.segment_min_tokens = segment_min_tokens
        # A tokenizer that can emit ids past the embedding would fail inside the engine call instead of here.
        tokenizer_size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        if tokenizer_size > vocab_size:
            raise KvforgeError(f"tokenizer.json has {tokenizer_size} tokens, more than the model's vocab_size "
                               f"{vocab_size}; the engine dir's files do not belong together", "engine_dir")
        # A text longer than this cannot fit maxInputLen however it tokenizes: refused before any tokenizing.
        longest = longest_token_bytes(tokenizer.tokenizer)
        self.max_text_bytes = None if longest is None else max_input_len * longest

    def check_step_values(self, sampling: SamplingParams, cache_salt: str | None, where: str = "") -> None:
        """Values a step uses must be found bad here, not in the step: the ids the sampler indexes with lie in the
        vocabulary, and the salt hashed into page keys is encodable (API callers skip the parsers' checks)."""
        if cache_salt is not None:
            utf8_size(cache_salt, join_path(where, "cache_salt"))
        outside = [token_id for token_id in sampling.logit_bias if token_id >= self.vocab_size]
        if outside:
            raise KvforgeError(f"token id {outside[0]} is outside the vocabulary (ids are in [0, {self.vocab_size}))",
                               join_path(where, "logit_bias"))

    def check_text_size(self, text: str, where: str) -> None:
        """Refuse text whose size alone proves it exceeds maxInputLen (each token covers at most the longest token's
        bytes), so a huge prompt costs a length check instead of its tokenization; lone surrogates are refused too.
        Characters never outnumber UTF-8 bytes, so a text with too many characters is refused without encoding."""
        too_long = self.max_text_bytes is not None and len(text) > self.max_text_bytes
        self.check_text_bytes(len(text) if too_long or text.isascii() else utf8_size(text, where), where)

    def check_text_bytes(self, num_bytes: int, where: str) -> None:
        if self.max_text_bytes is not None and num_bytes > self.max_text_bytes:
            raise KvforgeError(f"prompt has at least {num_bytes} bytes of text, more than the {self.max_text_bytes} "
                               f"that maxInputLen {self.max_input_len} tokens can hold; rebuild with a larger "
                               "--maxInputLen or shorten the prompt", where)

    def process_prompt(self, prompt: str | Sequence[int], sampling: SamplingParams, lora_name: str | None = None,
                       cache_salt: str | None = None) -> EngineRequest:
        """A raw prompt (completions): text tokenized without a chat template, or token ids checked against
        the vocabulary; errors name "prompt"."""
        self.check_step_values(sampling, cache_salt)
        if isinstance(prompt, str):
            self.check_text_size(prompt, "prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise KvforgeError(f"token ids must be in [0, {self.vocab_size})", "prompt")
        check_prompt_length(len(ids), self.max_input_len, "prompt")
        return EngineRequest(ids, sampling, self.loras.get(lora_name), cache_salt)

    def prompt_text(self, request: Request, enable_thinking: bool = False) -> str:
        """The formatted prompt as outputs show it (`formatted_complete_request`): each media item as the text the
        chat template writes for it (`<image>`, `<|audio_bos|><|AUDIO|><|audio_eos|>`), which is what
        transformers' apply_chat_template returns; the item's expansion to placeholder tokens is not shown (its
        size is in usage.prompt_tokens). Internally media items stand as U+FFFC (see `_rendered`)."""
        pieces = self._rendered(request, enable_thinking).split(MEDIA_SENTINEL)
        media = [ref for message in request.messages for ref in message.media]
        markers = [self.tokenizer.media_markers.get(ref.kind, f"<{ref.kind}>") for ref in media]
        return pieces[0] + "".join(marker + piece for marker, piece in zip(markers, pieces[1:], strict=False))

    def _rendered(self, request: Request, enable_thinking: bool = False) -> str:
        return self.tokenizer.format(request.messages, apply_chat_template=request.apply_chat_template,
                                     add_generation_prompt=request.add_generation_prompt,
                                     enable_thinking=enable_thinking, where=f"requests[{request.index}].messages")

    def process(self, request: Request, enable_thinking: bool = False, where: str | None = None,
                base_dir: Path | None = None) -> EngineRequest:
        """Tokenize and check a request against the engine limits before anything runs.

        The whole prompt must fit maxInputLen even when a cached prefix would shorten the computed part,
        so whether a request is accepted never depends on what the cache holds. Media items are decoded
        and encoded here (or found in the encoder cache); relative media paths resolve against `base_dir`.
        """
        where = f"requests[{request.index}]" if where is None else where
        self.check_step_values(request.sampling, request.cache_salt, where)
        # The rendered prompt holds every content, and each is tokenized on its own (encode_chat): their sum bounds
        # the tokens from below, so 64 huge messages are refused before the template runs.
        self.check_text_bytes(sum(utf8_size(m.content, join_path(where, "messages")) for m in request.messages),
                              join_path(where, "messages"))
        media = [ref for message in request.messages for ref in message.media]
        if self.segment_min_tokens and not media:  # media prompts give documents no spans yet
            raw = self.tokenizer.tokenizer
            request = replace(request, messages=segment_messages(
                request.messages, lambda text: len(raw.encode(text, add_special_tokens=False).ids),
                self.segment_min_tokens))
        if media and self.multimodal is None:
            raise KvforgeError(f'"{media[0].kind}" input needs a multimodal engine with an encoder '
                               "(--multimodalEngineDir); this engine runs text only", media[0].where)
        if media:
            assert self.multimodal is not None
            self.multimodal.check_kinds(media)
        text = self._rendered(request, enable_thinking)
        self.check_text_size(text, join_path(where, "messages"))
        spans, documents, skipped = (), (), ()
        if media:
            assert self.multimodal is not None
            # The plain-text rule of tokenizer.py holds for the text parts of media prompts too: the formatted
            # prompt carries where its content lies.
            plain = None if request.parse_special_tokens else text
            ids, spans = self.multimodal.tokenize(text, media, base_dir, self.max_input_len,
                                                  join_path(where, "messages"), plain, cache_salt=request.cache_salt)
            skipped = (SKIP_REFUSED,) * sum(len(m.documents) for m in request.messages)  # no spans in media prompts yet
        else:
            ids, documents, skipped = self._encode_with_documents(request, text, enable_thinking, where)
        check_prompt_length(len(ids), self.max_input_len, join_path(where, "messages"))
        engine_request = EngineRequest(ids, request.sampling, self.loras.get(request.lora_name), request.cache_salt,
                                       media=spans, documents=documents, documents_skipped=skipped)
        if self.message_boundaries and not media:
            engine_request.message_boundaries = self._message_boundaries(request, ids, enable_thinking, where)
        if request.save_system_prompt_kv_cache:
            if self.reuse_enabled:
                raise KvforgeError("the legacy system-prompt cache cannot be combined with --enableContextReuse "
                                   "(which already reuses system prompts)",
                                   join_path(where, "save_system_prompt_kv_cache"))
            system = self.tokenizer.format_system_prompt(request.messages, request.apply_chat_template)
            if system:
                engine_request.system_prompt_ids = self._encode(system, request, request.messages[:1], where)
                adapter = engine_request.adapter
                # The adapter's digest, not its name (the seed keys on the name): a reloaded adapter cannot hit.
                engine_request.system_prompt_key = (system, adapter.digest.hex() if adapter else "")
        return engine_request


    def _encode_with_documents(self, request: Request, text: RenderedPrompt, enable_thinking: bool,
                               where: str) -> tuple[list[int], tuple[DocumentSpan, ...], tuple[str, ...]]:
        """The prompt's token ids, its document items' token spans, and why each other document item has none
        (profile_schema.SKIP_REASONS).

        A document's span must hold exactly its own tokenization, so its key does not depend on what surrounds it.
        The whole prompt's tokens are kept when every document's own tokens lie in them, starting at a token that
        begins where the document does. Where a BPE
        token crosses a document's edge (whitespace ending a document merges with the next part's first token:
        "report. " + "Report 2" gives " Report"), the prompt is tokenized part by part instead (issue 53): the text
        before the first document, each document, the text between, the text after, each encoded on its own and
        the ids joined. Part-wise ids are used only when they decode back to the prompt text: a tokenizer that
        adds text to each piece it encodes (a Metaspace prefix) or rewrites it (a normalizer) keeps the whole
        prompt's ids, and a document whose edge a token crosses there gets no span (`edge_merge`). Content holding
        special-token text (tokenized piecewise) and a template that moved or rewrote a document give no spans
        (`refused`)."""
        ids = self._encode(text, request, request.messages, where)
        count = sum(len(m.documents) for m in request.messages)
        if not count:
            return ids, (), ()
        if not request.parse_special_tokens and text.content_spans != ():
            return ids, (), (SKIP_REFUSED,) * count  # ids are not one plain encoding of `text`
        chars = self.tokenizer.document_spans(request.messages, text, apply_chat_template=request.apply_chat_template,
                                              add_generation_prompt=request.add_generation_prompt,
                                              enable_thinking=enable_thinking, where=join_path(where, "messages"))
        if chars is None:
            return ids, (), (SKIP_REFUSED,) * count
        raw = self.tokenizer.tokenizer
        whole = raw.encode(text, add_special_tokens=False)
        shift = len(ids) - len(whole.ids)  # BOS
        # The token that begins at each character: a document's candidate start (offsets only locate it, the
        # comparison with the document's own tokens decides).
        first = {}
        for index, (start, _) in enumerate(whole.offsets):
            first.setdefault(start, index + shift)
        clean: list[DocumentSpan | None] = []
        for start, end in chars:
            document = raw.encode(text[start:end], add_special_tokens=False).ids
            at = first.get(start, -1)
            clean.append(DocumentSpan(at, len(document)) if at >= 0 and ids[at:at + len(document)] == document
                         and whole.ids == ids[shift:] else None)
        if None not in clean:
            return ids, tuple(span for span in clean if span is not None), ()
        # No content holds special-token text here (or the request parses it): each part is encoded as `encode`
        # reads the whole prompt, the markup's special tokens parsed.
        bounds = [0, *(position for span in chars for position in span), len(text)]
        pieces: list[int] = []
        offsets = [0]  # token index where each part begins, then the end
        for start, end in zip(bounds, bounds[1:], strict=False):
            pieces += raw.encode(text[start:end], add_special_tokens=False).ids if end > start else []
            offsets.append(len(pieces))
        if raw.decode(pieces, skip_special_tokens=False) == text:
            part_wise = self.tokenizer.encode_ids(pieces)
            shift = len(part_wise) - len(pieces)  # BOS
            return part_wise, tuple(DocumentSpan(offsets[i] + shift, offsets[i + 1] - offsets[i])
                                    for i in range(1, len(bounds) - 1, 2)), ()
        return (ids, tuple(span for span in clean if span is not None),
                (SKIP_EDGE_MERGE,) * clean.count(None))

    def _message_boundaries(self, request: Request, ids: list[int], enable_thinking: bool,
                            where: str) -> tuple[int, ...]:
        """Token counts at which each earlier message ends: the conversation up to it, templated without a
        generation prompt, kept only where its tokens are a prefix of the whole prompt's (a template that
        rewrites earlier turns, or a merge across the boundary, just yields no checkpoint there)."""
        if not request.apply_chat_template or self.tokenizer.template is None:
            return ()
        boundaries = []
        for end in range(1, len(request.messages)):
            messages = request.messages[:end]
            text = self.tokenizer.format(messages, add_generation_prompt=False, enable_thinking=enable_thinking,
                                         where=join_path(where, "messages"))
            prefix = self._encode(text, request, messages, where)
            if 0 < len(prefix) < len(ids) and ids[:len(prefix)] == prefix:
                boundaries.append(len(prefix))
        return tuple(boundaries)

    def _encode(self, text: str, request: Request, messages: Sequence[Message], where: str) -> list[int]:
        """Content is plain text unless the request opted into parsing special tokens (see tokenizer.py)."""
        if request.parse_special_tokens:
            return self.tokenizer.encode(text)
        return self.tokenizer.encode_chat(text, [m.content for m in messages], join_path(where, "messages"))


def longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of text one token can stand for, or None where no such bound holds (a normalizer may
    shrink text; WordPiece/WordLevel/Unigram map unknown words of any length to one token). Byte-level BPE writes
    each byte as one character, so a token's characters are its bytes; elsewhere a token's own UTF-8 size is at
    least the text it covers ("▁" for a space, "<0x41>" for a byte). Added and special tokens count too, whether or
    not a request may produce them. At least 4: a media item's placeholder (U+FFFC, 3 bytes) is one token or more."""
    config = json.loads(tokenizer.to_str())
    model = config.get("model") or {}
    if config.get("normalizer") is not None or model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and not model.get("byte_fallback"):
        return None  # an unknown character becomes one token: still a few bytes, but not worth trusting
    byte_level = "ByteLevel" in json.dumps(config.get("pre_tokenizer")) or "ByteLevel" in json.dumps(
        config.get("decoder"))
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    longest = max((len(token) if byte_level else len(token.encode("utf-8", "replace")) for token in vocab),
                  default=1)
    added = max((len(token.content.encode("utf-8")) for token in tokenizer.get_added_tokens_decoder().values()),
                default=1)
    return max(longest, added, 4)


def check_prompt_length(num_tokens: int, max_input_len: int, where: str) -> None:
    if num_tokens == 0:
        raise KvforgeError("the prompt is empty after tokenization", where)
    if num_tokens > max_input_len:
        raise KvforgeError(f"prompt has {num_tokens} tokens, more than the engine's maxInputLen {max_input_len}; "
                           "rebuild with a larger --maxInputLen or shorten the prompt", where)
