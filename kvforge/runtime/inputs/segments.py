"""Documents in prompts that do not mark them (issue 53 item 5): plain-text passages found between blank lines.

LangChain, LlamaIndex and most RAG code send retrieved passages as plain text joined by blank lines, never as
{"type": "document"} parts. With `--documentSegments paragraphs`, each block of system or user text between blank
lines that tokenizes to at least `--documentSegmentMinTokens` tokens becomes a document span of its message, exactly
as if the client had sent it as a document part: the same keys (a block's own tokens), the same part-wise
tokenization at its edges, the same repair policy and the same skip counters. Nothing here touches K/V.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.types import MEDIA_SENTINEL, Message

SEGMENTS_OFF, SEGMENTS_PARAGRAPHS = "off", "paragraphs"
SEGMENT_MODES = (SEGMENTS_OFF, SEGMENTS_PARAGRAPHS)
# Retrieved chunks are long (LangChain's default splitter cuts 1,000 characters, about 250 tokens; LlamaIndex's
# 1,024 tokens; experiments/reuse/document_reuse.py's reports are 237 SmolLM2 tokens), while what else a RAG
# prompt holds between blank lines is short: an instruction, a question, a heading (the workload's question is 15
# tokens, its system prompt 30). A block that is not a passage but is taken for one costs a standalone prefill and,
# without full repair, an approximate K/V: 64 keeps such blocks out and the chunks splitters make by default in.
DEFAULT_SEGMENT_MIN_TOKENS = 64
SEGMENTED_ROLES = ("system", "user")  # where retrieved text goes; an assistant turn holds no documents
# A blank line: a newline, optional spaces or tabs, another newline (then any more whitespace). A block's own leading
# and trailing whitespace is not part of its document, so "passage\n" and "passage " find the same stored form.
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n\s*")


def check_segment_options(mode: str, min_tokens: int, document_reuse: bool) -> None:
    """Refuse a mode or a minimum this module does not know, and segmentation without document reuse (it would
    find documents nothing reuses), naming the setting."""
    if mode not in SEGMENT_MODES:
        raise InvalidConfig(f"must be one of {', '.join(SEGMENT_MODES)}, got {mode!r}", "document_segments")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
        raise InvalidConfig(f"must be an integer >= 1, got {min_tokens!r}", "document_segment_min_tokens")
    if mode != SEGMENTS_OFF and not document_reuse:
        raise InvalidConfig(f"{mode!r} finds documents for document reuse: it needs document_reuse",
                            "document_segments")


def paragraph_spans(content: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the blocks of `content` between blank lines, each without its leading and
    trailing whitespace; blocks of whitespace alone are not blocks."""
    spans, position = [], 0
    for match in [*_BLANK_LINE.finditer(content), None]:
        end = len(content) if match is None else match.start()
        block = content[position:end]
        stripped = block.strip()
        if stripped:
            start = position + (len(block) - len(block.lstrip()))
            spans.append((start, start + len(stripped)))
        if match is not None:
            position = match.end()
    return spans


def segment_messages(messages: Sequence[Message], count_tokens: Callable[[str], int],
                     min_tokens: int) -> list[Message]:
    """`messages` with each system and user block of at least `min_tokens` tokens (`count_tokens` of its text
    alone, which is the document's own tokenization) added to its documents. Marked document parts stay as they
    are; a block that overlaps one, or holds a media item, is left as text. Messages without a new span are
    returned as they are."""
    out = []
    for message in messages:
        if message.role not in SEGMENTED_ROLES:
            out.append(message)
            continue
        found = [(start, end) for start, end in paragraph_spans(message.content)
                 if not any(start < d_end and d_start < end for d_start, d_end in message.documents)
                 and not _holds_media(message, start, end)
                 and count_tokens(message.content[start:end]) >= min_tokens]
        out.append(replace(message, documents=tuple(sorted((*message.documents, *found)))) if found else message)
    return out


def _holds_media(message: Message, start: int, end: int) -> bool:
    """A media item stands in content as MEDIA_SENTINEL."""
    return bool(message.media) and MEDIA_SENTINEL in message.content[start:end]
