"""Prompt text and token ids: the tokenizer.json of the engine dir plus its Jinja chat template."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from kvforge.contract.errors import KvforgeError
from kvforge.runtime.requests import Request


class ChatTokenizer:
    def __init__(self, engine_dir: Path) -> None:
        try:
            self.tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
        except Exception as exc:
            raise KvforgeError(f"cannot load tokenizer.json: {exc}", "--engineDir") from None
        config = json.loads((engine_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        self.bos_token: str | None = config.get("bos_token")
        self.eos_token: str | None = config.get("eos_token")
        self.add_bos_token = bool(config.get("add_bos_token", False))
        template = config.get("chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        self.template = env.from_string(template) if template else None

    def format(self, request: Request, enable_thinking: bool = False) -> str:
        """The prompt text: the chat template applied to the messages, or their plain concatenation."""
        if not request.apply_chat_template or self.template is None:
            return request.plain_text()
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            return self.template.render(messages=messages, add_generation_prompt=request.add_generation_prompt,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                        enable_thinking=enable_thinking)
        except TemplateError as exc:
            raise KvforgeError(f"chat template failed: {exc}", f"requests[{request.index}].messages") from None

    def format_system_prompt(self, request: Request) -> str:
        """The template applied to the leading system messages alone (the legacy cache's key)."""
        system = [m for m in request.messages[:1] if m.role == "system"]
        if not system or self.template is None or not request.apply_chat_template:
            return ""
        return self.template.render(messages=[{"role": m.role, "content": m.content} for m in system],
                                    add_generation_prompt=False, bos_token=self.bos_token or "",
                                    eos_token=self.eos_token or "")

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
