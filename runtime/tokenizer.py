"""Prompt text and token ids: the tokenizer.json of the engine dir plus its Jinja chat template.

Special tokens: the chat template's own markup (`<|im_start|>`, `<|im_end|>`...) becomes special tokens,
message content does not. Content holding special-token text is tokenized as plain text, so a user who
types `<|im_start|>system` cannot forge a turn. A request opts out with `parse_special_tokens` (request
file, Python API) or llm_inference --parseSpecialTokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import Tokenizer

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import read_json
from kvforge.contract.validation import one_line
from kvforge.runtime.chat_template import BoundedTemplate
from kvforge.runtime.types import MEDIA_SENTINEL, Message


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

    def _template_message(self, message: Message, stand_ins: dict[str, str] | None = None) -> dict:
        if not self.content_as_items:
            return {"role": message.role, "content": message.content}
        items: list[dict] = []
        for i, text in enumerate(message.content.split(MEDIA_SENTINEL)):
            if i:
                items.append({"type": message.media[i - 1].kind})
            for marker, stand_in in (stand_ins or {}).items():
                text = text.replace(marker, stand_in)
            if text:
                items.append({"type": "text", "text": text})
        return {"role": message.role, "content": items}

    def format(self, messages: Sequence[Message], *, apply_chat_template: bool = True,
               add_generation_prompt: bool = True, enable_thinking: bool = False, where: str = "messages") -> str:
        """The prompt text: the chat template applied to the messages, or their plain concatenation."""
        if not apply_chat_template or self.template is None:
            return "".join(m.content for m in messages)
        # A marker typed in text must not read as a media item: it stands in as a character no content holds
        # while the template's own markers turn back into sentinels (one per media item).
        stand_ins = self._marker_stand_ins(messages) if self.content_as_items and any(m.media for m in messages) \
            else {}
        text = self.template.render(where, messages=[self._template_message(m, stand_ins) for m in messages],
                                    add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "", enable_thinking=enable_thinking)
        for marker, stand_in in stand_ins.items():
            text = text.replace(marker, MEDIA_SENTINEL).replace(stand_in, marker)
        return text

    def _marker_stand_ins(self, messages: Sequence[Message]) -> dict[str, str]:
        """Media marker -> a private-use character found in no message content."""
        used = set("".join(m.content for m in messages))
        free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
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

    def encode_chat(self, text: str, contents: Sequence[str], where: str = "messages") -> list[int]:
        """Token ids of a formatted prompt whose message `contents` stay plain text.

        Only content holding special-token text takes this path (everything else tokenizes exactly as
        `encode`): each such content is found in the prompt in order and encoded with special-token
        parsing off, the markup around it with it on. A template that rewrites such content (so it
        cannot be found verbatim) is refused rather than guessed at.
        """
        return self.encode_chat_segments([text], contents, where)[0]

    def encode_chat_segments(self, segments: Sequence[str], contents: Sequence[str] | None,
                             where: str = "messages") -> list[list[int]]:
        """Token ids of each piece of a formatted media prompt (the text between its media items; BOS on the
        first), message `contents` kept plain text as in `encode_chat`; `contents` None parses special-token
        text everywhere (parse_special_tokens). A content never spans a media item, so each lies in one piece."""
        risky = [c for c in contents or () if c and any(s in c for s in self.special_texts)]
        pieces = []
        for segment in segments:
            ids: list[int] = []
            position = 0
            while risky and (start := segment.find(risky[0], position)) >= 0:
                ids += self.tokenizer.encode(segment[position:start], add_special_tokens=False).ids
                ids += self._literal_tokenizer().encode(risky[0], add_special_tokens=False).ids
                position = start + len(risky.pop(0))
            pieces.append(ids + self.tokenizer.encode(segment[position:], add_special_tokens=False).ids)
        if risky:
            raise KvforgeError("message content holds special-token text that the chat template changes, so it "
                               "cannot be kept as plain text; remove it, or set parse_special_tokens", where)
        pieces[0] = self._with_bos(pieces[0])
        return pieces

    def _literal_tokenizer(self) -> Tokenizer:
        if self._literal is None:
            literal = Tokenizer.from_str(self.tokenizer.to_str())
            literal.encode_special_tokens = True  # special-token text is split like any other text
            self._literal = literal
        return self._literal

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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return one_line(text.splitlines()[0] if text else type(exc).__name__)[:200]
