"""Who is calling: API keys map to tenants, and each tenant gets its own cache salt so tenants never share pages.

The salt is HMAC-SHA256(server secret, tenant id): clients cannot choose or guess another tenant's salt, and a
client's own `cache_salt` only subdivides its tenant's pages (it is appended, never used alone). A key may also be
marked operator: only such keys read /metrics, whose counters are every tenant's traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json, read_limited

SECRET_BYTES = 32
ANONYMOUS = ""  # the one tenant of a server without --apiKeys


@dataclass(frozen=True, slots=True)
class Tenants:
    """API keys (stored as SHA-256 digests) → tenant ids, and the secret that salts each tenant's pages."""

    secret: bytes
    key_digests: dict[bytes, str]  # empty: no authentication, every caller is the anonymous tenant
    operator_digests: frozenset[bytes] = field(default_factory=frozenset)  # keys that may read /metrics

    @property
    def required(self) -> bool:
        return bool(self.key_digests)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None when a key is required and this is not one."""
        if not self.required:
            return ANONYMOUS
        digest = _bearer_digest(authorization)
        # A lookup by digest: how long it takes says nothing about how close a guess came to a real key.
        return None if digest is None else self.key_digests.get(digest)

    def is_operator(self, authorization: str | None) -> bool:
        """Whether the header carries an operator key; every caller is one when no key is required."""
        if not self.required:
            return True
        digest = _bearer_digest(authorization)
        return digest is not None and digest in self.operator_digests

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        """The salt the engine keys pages with: the tenant's, plus the client's own salt when it gives one."""
        tenant_salt = hmac.new(self.secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()
        return tenant_salt if client_salt is None else f"{tenant_salt}:{client_salt}"


def load_tenants(api_keys_file: Path | None, salt_secret_file: Path | None) -> Tenants:
    """Read `--apiKeys` (a JSON object {"KEY": "TENANT"}, or {"KEY": {"tenant": "TENANT", "operator": true}} for a
    key that may read /metrics) and `--saltSecret` (a file of secret bytes; default: a random key per process, which
    is enough while the cache lives in this process)."""
    secret = secrets.token_bytes(SECRET_BYTES) if salt_secret_file is None else _read_secret(salt_secret_file)
    if api_keys_file is None:
        return Tenants(secret, {})
    try:
        data = loads_json(read_limited(api_keys_file, 2**24, "api_keys"), "api_keys", str(api_keys_file))
    except OSError as exc:
        raise KvforgeError(f"cannot read {api_keys_file}: {exc.strerror or exc}", "api_keys") from None
    if not isinstance(data, dict) or not data:
        raise KvforgeError('must be a non-empty JSON object {"API_KEY": "TENANT", ...}', "api_keys")
    digests, operators = {}, set()
    for key, entry in data.items():
        tenant, operator = _entry(entry)
        if not key.strip() or key != key.strip() or not isinstance(tenant, str) or not tenant:
            raise KvforgeError("every key must be a non-empty string without surrounding spaces and every tenant "
                               "a non-empty string", "api_keys")
        digests[_digest(key)] = tenant
        if operator:
            operators.add(_digest(key))
    return Tenants(secret, digests, frozenset(operators))


def _entry(entry: Any) -> tuple[Any, bool]:
    """(tenant, operator) of one key's value: "TENANT", or {"tenant": "TENANT", "operator": true|false}."""
    if not isinstance(entry, dict):
        return entry, False
    unknown = sorted(set(entry) - {"tenant", "operator"})
    if unknown:
        raise KvforgeError(f"unknown field {unknown[0]!r} in a key's entry (expected tenant, operator)", "api_keys")
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise KvforgeError(f"operator must be true or false, got {operator!r}", "api_keys")
    return entry.get("tenant"), operator


def _bearer_digest(authorization: str | None) -> bytes | None:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return _digest(key.strip())


def _read_secret(path: Path) -> bytes:
    try:
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise KvforgeError(f"cannot read {path}: {exc.strerror or exc}", "salt_secret") from None
    if len(secret) < 16:
        raise KvforgeError("the secret must hold at least 16 bytes (e.g. `head -c 32 /dev/urandom | base64`)",
                           "salt_secret")
    return secret


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
