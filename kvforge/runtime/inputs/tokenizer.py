"""Prompt text and token ids: the tokenizer.json of the engine dir plus its Jinja chat template.

Special tokens: the chat template's own markup (`<|im_start|>`, `<|im_end|>`...) becomes special tokens,
message content does not. Content holding special-token text is tokenized as plain text, so a user who
types `<|im_start|>system` cannot forge a turn. Where content lies in the prompt is known by construction
(`ChatTokenizer.format` renders it once more between sentinel characters it owns), never by searching the
prompt for it, so content that repeats earlier markup cannot take over the markup's tokens. A request opts
out with `parse_special_tokens` (request file, Python API) or llm_inference --parseSpecialTokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import Tokenizer

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.validation import one_line
from kvforge.runtime.inputs.chat_template import BoundedTemplate
from kvforge.runtime.types import MEDIA_SENTINEL, Message

Spans = tuple[tuple[int, int], ...]  # (start, end) character offsets in a prompt
_PRIVATE_USE = range(0xE000, 0xF900)  # sentinels and stand-ins are drawn from here, never from what content holds


class RenderedPrompt(str):
    """A formatted prompt that knows where the message content holding special-token text lies in it.

    `content_spans`: those pieces of content, in order, as offsets in the text (never across a media sentinel);
    () when no content holds special-token text; None when the template rewrote such content in a way that
    could not be followed (it is then refused unless special tokens are parsed, see encode_chat_segments).
    """

    content_spans: Spans | None

    def __new__(cls, text: str, content_spans: Spans | None = None) -> RenderedPrompt:  # None: pickle's copy
        prompt = super().__new__(cls, text)
        prompt.content_spans = content_spans
        return prompt


class ChatTokenizer:
    def __init__(self, engine_dir: Path, media_markers: dict[str, str] | None = None) -> None:
        """`media_markers`: the text the template writes for an {"type": "image"} / {"type": "audio"} item, by kind
        (a multimodal engine's encoder names its own)."""
        try:
            self.tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
        except Exception as exc:
            raise KvforgeError(f"cannot load tokenizer.json: {_first_line(exc)}", "engine_dir") from None
        config = read_json(engine_dir / "tokenizer_config.json", "engine_dir")
        for key in ("bos_token", "eos_token", "chat_template"):
            if config.get(key) is not None and not isinstance(config[key], str):
                raise KvforgeError(f"tokenizer_config.json: {key} must be a string or null", "engine_dir")
        if not isinstance(config.get("add_bos_token", False), bool):
            raise KvforgeError("tokenizer_config.json: add_bos_token must be true or false", "engine_dir")
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        try:
            self.template = BoundedTemplate(template) if template else None
        except (TemplateError, RecursionError, MemoryError) as exc:
            raise KvforgeError(f"tokenizer_config.json: the chat template does not compile: {_first_line(exc)}",
                               "engine_dir") from None
        # Text of every special token, to know when content needs the plain-text path (see encode_chat).
        self.special_texts = tuple(token.content for token in self.tokenizer.get_added_tokens_decoder().values()
                                   if token.special and token.content)
        self._literal: Tokenizer | None = None  # a copy that never parses special tokens, made on first use
        self.media_markers: dict[str, str] = dict(media_markers or {})
        self.content_as_items = self._wants_content_items()

    def _wants_content_items(self) -> bool:
        """Whether the template reads message content as a list of {type, ...} items (as multimodal templates such
        as SmolVLM's do) rather than as a string: it is rendered with a probe string and must keep it."""
        if self.template is None:
            return False
        probe = "kvforge-content-probe"
        try:
            return probe not in self.template.render("chat_template", messages=[{"role": "user", "content": probe}],
                                                     add_generation_prompt=False, bos_token="", eos_token="")
        except KvforgeError:
            return True

    def _template_message(self, message: Message, stand_ins: dict[str, str],
                          sentinels: tuple[str, str] | None = None) -> dict:
        """The message as the template reads it; `sentinels` (open, close) wrap each piece of its text."""
        if not self.content_as_items:
            return {"role": message.role, "content": _wrap(message.content, sentinels)}
        items: list[dict] = []
        for i, text in enumerate(message.content.split(MEDIA_SENTINEL)):
            if i:
                items.append({"type": message.media[i - 1].kind})
            for marker, stand_in in stand_ins.items():
                text = text.replace(marker, stand_in)
            if text:
                items.append({"type": "text", "text": _wrap(text, sentinels)})
        return {"role": message.role, "content": items}

    def holds_special(self, text: str) -> bool:
        """Whether `text` holds the text of a special token (and so must be tokenized with care)."""
        return any(special in text for special in self.special_texts)

    def format(self, messages: Sequence[Message], *, apply_chat_template: bool = True,
               add_generation_prompt: bool = True, enable_thinking: bool = False,
               where: str = "messages") -> RenderedPrompt:
        """The prompt text: the chat template applied to the messages, or their plain concatenation; it carries
        the spans of content holding special-token text (see RenderedPrompt)."""
        if not apply_chat_template or self.template is None:
            text, spans, start = "", [], 0
            for message in messages:
                text += message.content
                spans.append((start, len(text)))
                start = len(text)
            return RenderedPrompt(text, self._special_spans(text, spans))
        used = set("".join(m.content for m in messages)) if any(m.media for m in messages) else set()
        # A marker typed in text must not read as a media item: it stands in as a character no content holds
        # while the template's own markers turn back into sentinels (one per media item).
        stand_ins = self._marker_stand_ins(used) if self.content_as_items and any(m.media for m in messages) else {}

        def render(sentinels: tuple[str, str] | None) -> str:
            text = self.template.render(where, messages=[self._template_message(m, stand_ins, sentinels)
                                                         for m in messages],
                                        add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                                        eos_token=self.eos_token or "", enable_thinking=enable_thinking)
            for marker, stand_in in stand_ins.items():
                text = text.replace(marker, MEDIA_SENTINEL).replace(stand_in, marker)
            return text

        text = render(None)
        if not any(self.holds_special(m.content) for m in messages):
            return RenderedPrompt(text, ())  # nothing to keep apart: the prompt tokenizes as one text
        # Render once more with every piece of content between two characters of our own that neither the
        # prompt nor any content holds: where they land is where the template put the content, however often
        # and wherever it repeats, and whatever markup text the content repeats.
        free = _free_characters(set("".join(m.content for m in messages)) | set(text) | set(stand_ins.values()))
        sentinels = (next(free, ""), next(free, ""))
        if not all(sentinels):
            return RenderedPrompt(text, None)
        try:
            marked = render(sentinels)
        except KvforgeError:  # the template failed on the marked content only: it reads content, not copies it
            return RenderedPrompt(text, None)
        spans = _sentinel_spans(marked, text, *sentinels)
        return RenderedPrompt(text, None if spans is None else self._special_spans(text, spans))

    def document_spans(self, messages: Sequence[Message], text: str, *, apply_chat_template: bool = True,
                       add_generation_prompt: bool = True, enable_thinking: bool = False,
                       where: str = "messages") -> Spans | None:
        """Where each document item of `messages` lies in `text` (their `format`), as character spans in order;
        None when the template moved, cut or rewrote a document so that it cannot be followed (the documents are
        still in the prompt as plain text, they just cannot be told apart for reuse)."""
        # Each document is marked with two characters of our own that no content nor the prompt holds, and the
        # prompt rendered again: where the marks land is where the template put the document.
        free = _free_characters(set("".join(m.content for m in messages)) | set(text))
        open_, close = next(free, ""), next(free, "")
        if not (open_ and close):
            return None
        marked_messages = []
        for message in messages:
            content, position = "", 0
            for start, end in message.documents:
                content += message.content[position:start] + open_ + message.content[start:end] + close
                position = end
            marked_messages.append(Message(message.role, content + message.content[position:], message.media))
        try:
            marked = self.format(marked_messages, apply_chat_template=apply_chat_template,
                                 add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                                 where=where)
        except KvforgeError:  # the template failed on the marked content only
            return None
        spans = _sentinel_spans(marked, text, open_, close)
        expected = sum(len(m.documents) for m in messages)
        # A template that repeats or drops content gives another count: no span can then be trusted.
        return tuple(spans) if spans is not None and len(spans) == expected else None

    def _special_spans(self, text: str, spans: Sequence[tuple[int, int]]) -> Spans:
        """The spans cut at media sentinels, keeping the pieces that hold special-token text (the rest tokenizes
        with the markup around it exactly as a prompt without such content does)."""
        pieces = []
        for start, end in spans:
            for match in re.finditer(f"[^{MEDIA_SENTINEL}]+", text[start:end]):
                if self.holds_special(match.group()):
                    pieces.append((start + match.start(), start + match.end()))
        return tuple(pieces)

    def _marker_stand_ins(self, used: set[str]) -> dict[str, str]:
        """Media marker -> a private-use character found in no message content."""
        free = _free_characters(used)
        return {marker: next(free) for marker in self.media_markers.values()}

    def format_system_prompt(self, messages: Sequence[Message], apply_chat_template: bool = True) -> str:
        """The template applied to the leading system message alone (the legacy cache's key)."""
        system = [m for m in messages[:1] if m.role == "system"]
        if not system or self.template is None or not apply_chat_template:
            return ""
        return self.format(system, add_generation_prompt=False)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, special-token text parsed as special tokens (template markup, raw prompts)."""
        return self._with_bos(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_chat(self, text: str, contents: Sequence[str] = (), where: str = "messages") -> list[int]:
        """Token ids of a formatted prompt (`format`'s result) whose message content stays plain text.

        Only content holding special-token text takes this path (everything else tokenizes exactly as
        `encode`): each such piece, at the span `format` recorded, is encoded with special-token parsing
        off, the markup around it with it on. A prompt that did not come from `format` carries no spans:
        it is refused when one of `contents` holds special-token text, rather than guessed at.
        """
        return self.encode_chat_segments([text], text if isinstance(text, RenderedPrompt) else contents, where)[0]

    def encode_chat_segments(self, segments: Sequence[str], prompt: RenderedPrompt | Sequence[str] | None,
                             where: str = "messages") -> list[list[int]]:
        """Token ids of each piece of a formatted media prompt (the text between its media items; BOS on the
        first): `segments` is `prompt.split(MEDIA_SENTINEL)`, and `prompt`'s content spans stay plain text as
        in `encode_chat`; `prompt` None parses special-token text everywhere (parse_special_tokens). Message
        contents instead of a RenderedPrompt are refused when one holds special-token text (no spans known)."""
        spans: Spans = ()
        if isinstance(prompt, RenderedPrompt):
            if prompt.content_spans is None or sum(map(len, segments)) + len(segments) - 1 != len(prompt):
                raise KvforgeError("message content holds special-token text that the chat template changes, so "
                                   "it cannot be kept as plain text; remove it, or set parse_special_tokens", where)
            spans = prompt.content_spans
        elif prompt is not None and any(self.holds_special(c) for c in prompt):
            raise KvforgeError("message content holds special-token text, and the prompt was not formatted here, "
                               "so content cannot be told from markup; set parse_special_tokens", where)
        pieces, offset = [], 0
        for segment in segments:
            ids: list[int] = []
            position = 0
            # A span never crosses a media sentinel, so each lies in one segment; spans are in prompt order.
            while spans and spans[0][1] <= offset + len(segment):
                start, end = spans[0][0] - offset, spans[0][1] - offset
                ids += self.tokenizer.encode(segment[position:start], add_special_tokens=False).ids
                ids += self._literal_tokenizer().encode(segment[start:end], add_special_tokens=False).ids
                position, spans = end, spans[1:]
            pieces.append(ids + self.tokenizer.encode(segment[position:], add_special_tokens=False).ids)
            offset += len(segment) + 1
        pieces[0] = self._with_bos(pieces[0])
        return pieces

    def _literal_tokenizer(self) -> Tokenizer:
        if self._literal is None:
            literal = Tokenizer.from_str(self.tokenizer.to_str())
            literal.encode_special_tokens = True  # special-token text is split like any other text
            self._literal = literal
        return self._literal

    def encode_ids(self, ids: list[int]) -> list[int]:
        """Ids encoded elsewhere (a prompt tokenized part by part) as `encode` would return them: BOS first."""
        return self._with_bos(ids)

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos_token and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _free_characters(used: set[str]) -> Iterator[str]:
    """Private-use characters not in `used`, in order."""
    return (chr(c) for c in _PRIVATE_USE if chr(c) not in used)


def _wrap(text: str, sentinels: tuple[str, str] | None) -> str:
    """`text` with `sentinels` around it, inside its leading and trailing whitespace: a template that trims content
    (`content | trim`, as ChatML, Qwen and Llama templates do) still keeps both sentinels and the trimmed text."""
    if sentinels is None:
        return text
    core = text.strip()
    if not core:
        return text  # whitespace holds no special-token text: nothing to mark
    lead = text[:len(text) - len(text.lstrip())]
    return f"{lead}{sentinels[0]}{core}{sentinels[1]}{text[len(lead) + len(core):]}"


def _sentinel_spans(marked: str, text: str, open_: str, close: str) -> list[tuple[int, int]] | None:
    """Spans in `text` of what lies between each sentinel pair of `marked` (`text` rendered with marked content);
    None unless the pairs alternate open, close and `marked` without them is `text` exactly (a template that
    cuts, reorders, escapes or measures content changes one or the other)."""
    spans: list[tuple[int, int]] = []
    kept: list[str] = []
    length, start = 0, None
    for piece in re.split(f"([{open_}{close}])", marked):
        if piece == open_ and start is None:
            start = length
        elif piece == close and start is not None:
            spans.append((start, length))
            start = None
        elif piece in (open_, close):
            return None
        else:
            kept.append(piece)
            length += len(piece)
    return spans if start is None and "".join(kept) == text else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return one_line(text.splitlines()[0] if text else type(exc).__name__)[:200]
