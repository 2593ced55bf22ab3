"""Prompt text and token ids: the tokenizer.json of the engine dir plus its Jinja chat template."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.types import MEDIA_SENTINEL, Message


class ChatTokenizer:
    def __init__(self, engine_dir: Path) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
        except Exception as exc:
            raise KvforgeError(f"cannot load tokenizer.json: {exc}", "engine_dir") from None
        config = json.loads((engine_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.template = env.from_string(template) if template else None
        # Text the template writes for an {"type": "image"} / {"type": "audio"} item (set by the engine).
        self.media_markers: dict[str, str] = {}
        self.content_as_items = self._wants_content_items()

    def _wants_content_items(self) -> bool:
        """Whether the template reads message content as a list of {type, ...} items (as multimodal templates such
        as SmolVLM's do) rather than as a string: it is rendered with a probe string and must keep it."""
        if self.template is None:
            return False
        probe = "kvforge-content-probe"
        try:
            return probe not in self.template.render(messages=[{"role": "user", "content": probe}],
                                                     add_generation_prompt=False, bos_token="", eos_token="")
        except TemplateError:
            return True

    def _template_message(self, message: Message) -> dict:
        if not self.content_as_items:
            return {"role": message.role, "content": message.content}
        items: list[dict] = []
        for i, text in enumerate(message.content.split(MEDIA_SENTINEL)):
            if i:
                items.append({"type": message.media[i - 1].kind})
            if text:
                items.append({"type": "text", "text": text})
        return {"role": message.role, "content": items}

    def format(self, messages: Sequence[Message], *, apply_chat_template: bool = True,
               add_generation_prompt: bool = True, enable_thinking: bool = False, where: str = "messages") -> str:
        """The prompt text: the chat template applied to the messages, or their plain concatenation."""
        if not apply_chat_template or self.template is None:
            return "".join(m.content for m in messages)
        try:
            text = self.template.render(messages=[self._template_message(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                        enable_thinking=enable_thinking)
        except TemplateError as exc:
            raise KvforgeError(f"chat template failed: {exc}", where) from None
        if self.content_as_items and any(m.media for m in messages):
            for marker in self.media_markers.values():
                text = text.replace(marker, MEDIA_SENTINEL)  # back to one sentinel per media item
        return text

    def format_system_prompt(self, messages: Sequence[Message], apply_chat_template: bool = True) -> str:
        """The template applied to the leading system message alone (the legacy cache's key)."""
        system = [m for m in messages[:1] if m.role == "system"]
        if not system or self.template is None or not apply_chat_template:
            return ""
        return self.format(system, add_generation_prompt=False)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
