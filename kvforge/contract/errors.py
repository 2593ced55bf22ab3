"""Domain errors: what a user got wrong, named by setting or JSON path, so CLIs print one line and exit non-zero.

Layers below the CLIs name settings by their domain name (`max_kv_pool_pages`, `engine_dir`); each CLI
maps those to its own flags (`--maxKVPoolPages`) with `with_flag_names`, so the core never knows a CLI.
"""

from __future__ import annotations

from collections.abc import Mapping


class KvforgeError(Exception):
    """A user-facing error: `field` names what was wrong (a setting, a JSON path or a file)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def with_flag_names(self, flags: Mapping[str, str]) -> KvforgeError:
        """The same error with its field renamed to the CLI flag that sets it (unchanged when unmapped)."""
        if self.field not in flags:
            return self
        renamed = type(self).__new__(type(self))
        KvforgeError.__init__(renamed, self.message, flags[self.field])
        return renamed


class InvalidConfig(KvforgeError):
    """An engine dir, export or option that cannot work as given."""


class PoolTooSmall(KvforgeError):
    """The KV pool cannot hold a request even when it runs alone in an empty pool."""
