"""Who is calling: API keys map to tenants, and each tenant gets its own cache salt so tenants never share pages.

The salt is HMAC-SHA256(server secret, tenant id): clients cannot choose or guess another tenant's salt, and a
client's own `cache_salt` only subdivides its tenant's pages (it is appended, never used alone).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

from kvforge.contract.errors import KvforgeError
from kvforge.contract.files import loads_json, read_limited

SECRET_BYTES = 32
ANONYMOUS = ""  # the one tenant of a server without --apiKeys


@dataclass(frozen=True, slots=True)
class Tenants:
    """API keys (stored as SHA-256 digests) → tenant ids, and the secret that salts each tenant's pages."""

    secret: bytes
    key_digests: dict[bytes, str]  # empty: no authentication, every caller is the anonymous tenant

    @property
    def required(self) -> bool:
        return bool(self.key_digests)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an `Authorization: Bearer KEY` header; None when a key is required and this is not one."""
        if not self.required:
            return ANONYMOUS
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        # A lookup by digest: how long it takes says nothing about how close a guess came to a real key.
        return self.key_digests.get(_digest(key.strip()))

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        """The salt the engine keys pages with: the tenant's, plus the client's own salt when it gives one."""
        tenant_salt = hmac.new(self.secret, tenant.encode("utf-8"), hashlib.sha256).hexdigest()
        return tenant_salt if client_salt is None else f"{tenant_salt}:{client_salt}"


def load_tenants(api_keys_file: Path | None, salt_secret_file: Path | None) -> Tenants:
    """Read `--apiKeys` (a JSON object {"KEY": "TENANT"}) and `--saltSecret` (a file of secret bytes; default: a
    random key per process, which is enough while the cache lives in this process)."""
    secret = secrets.token_bytes(SECRET_BYTES) if salt_secret_file is None else _read_secret(salt_secret_file)
    if api_keys_file is None:
        return Tenants(secret, {})
    try:
        data = loads_json(read_limited(api_keys_file, 2**24, "api_keys"), "api_keys", str(api_keys_file))
    except OSError as exc:
        raise KvforgeError(f"cannot read {api_keys_file}: {exc.strerror or exc}", "api_keys") from None
    if not isinstance(data, dict) or not data:
        raise KvforgeError('must be a non-empty JSON object {"API_KEY": "TENANT", ...}', "api_keys")
    digests = {}
    for key, tenant in data.items():
        if not key.strip() or key != key.strip() or not isinstance(tenant, str) or not tenant:
            raise KvforgeError("every key must be a non-empty string without surrounding spaces and every tenant "
                               "a non-empty string", "api_keys")
        digests[_digest(key)] = tenant
    return Tenants(secret, digests)


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
