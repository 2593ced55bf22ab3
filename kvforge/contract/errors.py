"""One error type for everything a user can get wrong, so CLIs print one line and exit non-zero."""

from __future__ import annotations


class KvforgeError(Exception):
    """A user-facing error: `field` names what was wrong (a JSON path, a flag or a file)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)
