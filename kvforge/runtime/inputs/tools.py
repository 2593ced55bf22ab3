"""OpenAI `tools` / `tool_choice` in the generic format, for llm_serve and kvforge.LLM: the tools described in a system
message, calls read back.

SmolLM2's ChatML template has no tool format, so every engine gets this one: the model calls a function by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. With `tool_choice` "required" or a named function the
answer is grammar-constrained to one call object (`{"name": ..., "arguments": ...}`, the arguments by the function's
JSON schema), so it always parses; with "auto" the calls the model writes inside the markers are read, and text
that does not parse stays content. With "none" the tools are described but no call is read.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from kvforge.contract.validation import check_string, fail, json_kind
from kvforge.runtime.sequence import FinishReason
from kvforge.runtime.types import Message

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
MAX_TOOLS = 64
NATURAL_ENDS = frozenset({FinishReason.EOS.value, FinishReason.STOP.value})  # an answer that ended by itself


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The request's tools (OpenAI function objects, as given) and what `tool_choice` asks."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters"?}
    choice: str  # "auto", "none", "required" or "function"
    forced_name: str | None = None  # choice "function": the one to call

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def response_format(self) -> dict[str, Any]:
        """The grammar for a forced call: one object naming a function and its arguments by that function's schema."""
        options = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                    "properties": {"name": {"const": f["name"]},
                                   "arguments": f.get("parameters") or {"type": "object"}}}
                   for f in self.functions if self.forced_name in (None, f["name"])]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}}

    def system_text(self) -> str:
        listed = json.dumps([{"type": "function", "function": f} for f in self.functions], separators=(",", ":"))
        return (f"You may call these functions: {listed}\nTo call one, answer with {CALL_OPEN}"
                f'{{"name": <function name>, "arguments": <arguments object>}}{CALL_CLOSE}.')


def parse_tools(body: dict[str, Any]) -> ToolSpec | None:
    """`tools` and `tool_choice` of a chat body (None without tools; tool_choice without tools is refused)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            fail("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        fail("tools", f"must be an array of at most {MAX_TOOLS} function tools, got {json_kind(tools)}")
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        fail("tools", "names a function twice")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolSpec(functions, choice or "auto")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = check_string(choice["function"].get("name"), "tool_choice.function.name")
        if name not in names:
            fail("tool_choice.function.name", f"names {name!r}, which is not among the tools")
        return ToolSpec(functions, "function", name)
    fail("tool_choice", 'must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}')


def forced_format(spec: ToolSpec | None, response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The response_format a chat decodes under: a forced call's own grammar, else the one given; both at once is
    refused. Nothing is compiled here (this runs on llm_serve's event loop): the engine's grammar worker compiles
    it and refuses a schema naming `tools`."""
    if spec is None or not spec.forced:
        return response_format
    if response_format is not None:
        fail("response_format", "cannot be given with a tool_choice that forces a call (the call is the format)")
    return spec.response_format()


def grammar_field(response_format: dict[str, Any] | None, forced_call: bool) -> str:
    """The request field a refused grammar names: `tools` for a forced call's, `grammar` for llm_serve's GBNF field,
    else `response_format`."""
    if forced_call:
        return "tools"
    return "grammar" if response_format is not None and response_format["type"] == "grammar" else "response_format"


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        fail(f"{where}.type", 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        fail(f"{where}.function", f"must be an object with a name, got {json_kind(function)}")
    name = check_string(function.get("name"), f"{where}.function.name")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        fail(f"{where}.function.name", "must be 1 to 64 letters, digits, underscores or dashes")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        fail(f"{where}.function.parameters", f"must be a JSON Schema object, got {json_kind(parameters)}")
    kept = {"name": name, "parameters": parameters or {"type": "object"}}
    if isinstance(function.get("description"), str):
        kept["description"] = function["description"]
    return kept


def with_tools(messages: list[Message], spec: ToolSpec) -> list[Message]:
    """The messages with the tools described at the end of the system message (one is added if there is none)."""
    if messages and messages[0].role == "system":
        first = messages[0]
        return [Message("system", f"{first.content}\n\n{spec.system_text()}", first.media), *messages[1:]]
    return [Message("system", spec.system_text()), *messages]


def tool_messages(raw: Any) -> Any:
    """Chat messages as the request parser reads them: an assistant's `tool_calls` become its content in the
    call format (the template sees what the model would have written); other messages are left as they are."""
    if not isinstance(raw, list):
        return raw
    out = []
    for i, message in enumerate(raw):
        if isinstance(message, dict) and message.get("role") == "assistant" and message.get("tool_calls"):
            where = f"messages[{i}]"
            calls, content = message["tool_calls"], message.get("content")
            if not isinstance(calls, list):
                fail(f"{where}.tool_calls", f"must be an array, got {json_kind(calls)}")
            if content is not None and not isinstance(content, str):
                fail(f"{where}.content", f"must be a string or null beside tool_calls, got {json_kind(content)}")
            text = "".join(_written_call(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls))
            message = {"role": "assistant", "content": (content or "") + text}
        out.append(message)
    return out


def _written_call(call: Any, where: str) -> str:
    """One tool call of an earlier answer as the model writes it."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        fail(f"{where}.function", f"must be an object with a name, got {json_kind(function)}")
    name = check_string(function.get("name"), f"{where}.function.name")
    return CALL_OPEN + json.dumps({"name": name, "arguments": _arguments(function)}) + CALL_CLOSE


def _arguments(function: dict[str, Any]) -> Any:
    raw = function.get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


def read_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of an answer: a forced answer is one call object; an auto answer's marked calls that
    parse and name a tool are calls, the rest stays content. No calls: the text is the content."""
    names = {f["name"] for f in spec.functions}
    if spec.choice == "none":
        return text, []
    found: list[dict[str, Any]] = []

    def take(raw: str) -> bool:
        try:
            call = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(call, dict) or call.get("name") not in names:
            return False
        found.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": json.dumps(call.get("arguments", {}), separators=(",", ":"))}})
        return True

    if spec.forced:
        rest = "" if take(text) else text
    else:  # a marked call that does not parse stays in the content, as written
        rest = _CALLS.sub(lambda match: "" if take(match.group(1)) else match.group(0), text).strip()
    return (rest or None, found) if found else (text, [])


def answer_calls(text: str, finish_reason: str | None, spec: ToolSpec) -> list[dict[str, Any]]:
    """The tool calls of a finished answer (kvforge.LLM): read only from one that ended by itself, since a call
    cut off by the length limit is not a call; none with tool_choice "none"."""
    if finish_reason not in NATURAL_ENDS:
        return []
    return read_calls(text, spec)[1]
