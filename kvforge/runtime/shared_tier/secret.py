"""The tier secret: whoever can write the store must not be able to change answers, and optionally not read prompts.

With a secret every value ends with a keyed BLAKE2b (values.py) instead of a plain checksum, so a value forged or
altered by someone without the secret is rejected (a miss). With encryption on as well, each value is sealed with
AES-GCM (`cryptography`) under a key derived from the same secret, so the store holds no token ids or K/V in clear.
The secret itself is kept only here, never in a repr, a message or the profile.

Rotation (docs/shared-tier.md): a tier has one secret it writes with and may have older or newer ones it also reads
with (`--sharedCacheReadSecret`). A value that opens under any of them is used and left as it is: only a value no
secret opens is replaced, so two groups of processes mid-rotation never overwrite each other's values.
"""

from __future__ import annotations

import hashlib
import os

from kvforge.contract.errors import InvalidConfig
from kvforge.runtime.shared_tier.values import ValueRejected

SECRET_ENV = "KVFORGE_SHARED_CACHE_SECRET"
READ_SECRETS_ENV = "KVFORGE_SHARED_CACHE_READ_SECRETS"  # comma-separated; the flag takes one that holds a comma
MIN_SECRET_BYTES = 16  # as --saltSecret: a short secret can be guessed offline from any value in the store
SEALED_MAGIC = b"KVFE"
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = len(SEALED_MAGIC) + NONCE_BYTES + TAG_BYTES


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key per use, so the MAC key and the cipher key are never the same bytes."""
    return hashlib.blake2b(secret, digest_size=32, person=purpose).digest()


class TierSecret:
    """The keys one tier derives from its secret: `mac_key` always, an AES-GCM cipher when `encrypt`."""

    __slots__ = ("mac_key", "_cipher", "readers")

    def __init__(self, secret: str, *, encrypt: bool, read_secrets: tuple[str, ...] = ()) -> None:
        raw = secret.encode("utf-8")
        self.mac_key = _derive(raw, b"kvforge-tier-mac")
        self._cipher = None
        if encrypt:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._cipher = AESGCM(_derive(raw, b"kvforge-tier-enc"))
        # What a read tries, in order: this secret, then each other one it reads with (rotation), none twice.
        others = tuple(dict.fromkeys(s for s in read_secrets if s != secret))
        self.readers: tuple[TierSecret, ...] = (self, *(TierSecret(s, encrypt=encrypt) for s in others))

    def __repr__(self) -> str:
        return f"TierSecret(encrypt={self.encrypts})"

    @property
    def encrypts(self) -> bool:
        return self._cipher is not None

    @property
    def overhead(self) -> int:
        """Bytes sealing adds to a value."""
        return SEAL_OVERHEAD if self._cipher is not None else 0

    def seal(self, store_key: bytes, value: bytes) -> bytes:
        """`value` encrypted and bound to `store_key` (a sealed value moved under another key does not open)."""
        if self._cipher is None:
            return value
        nonce = os.urandom(NONCE_BYTES)  # random per value: 2^-32 collision odds only after ~2^32 writes of one key
        return SEALED_MAGIC + nonce + self._cipher.encrypt(nonce, value, store_key)

    def open(self, store_key: bytes, value: bytes) -> bytes:
        """The plaintext of a sealed value; ValueRejected if it is not one, or fails authentication."""
        if self._cipher is None:
            return value
        from cryptography.exceptions import InvalidTag

        if len(value) < SEAL_OVERHEAD or value[:len(SEALED_MAGIC)] != SEALED_MAGIC:
            raise ValueRejected("corrupt", "not an encrypted tier value")
        nonce = value[len(SEALED_MAGIC):len(SEALED_MAGIC) + NONCE_BYTES]
        try:
            return self._cipher.decrypt(nonce, value[len(SEALED_MAGIC) + NONCE_BYTES:], store_key)
        except InvalidTag:
            raise ValueRejected("corrupt", "does not decrypt with this tier secret") from None


def tier_secret(flag_value: str | None, *, encrypt: bool, read_secrets: tuple[str, ...] = ()) -> TierSecret | None:
    """The tier's secret from `--sharedCacheSecret`, else KVFORGE_SHARED_CACHE_SECRET, with the secrets it also reads
    with (`--sharedCacheReadSecret`, else KVFORGE_SHARED_CACHE_READ_SECRETS); None when no secret is set."""
    check_secret(flag_value, encrypt=encrypt, read_secrets=read_secrets)
    secret = flag_value if flag_value is not None else os.environ.get(SECRET_ENV)
    return TierSecret(secret, encrypt=encrypt, read_secrets=_read_secrets(read_secrets)) if secret else None


def _read_secrets(flag_values: tuple[str, ...]) -> tuple[str, ...]:
    if flag_values:
        return tuple(flag_values)
    return tuple(s for s in os.environ.get(READ_SECRETS_ENV, "").split(",") if s)


def _check_length(secret: str, field: str, source: str) -> None:
    size = len(secret.encode("utf-8"))
    if size < MIN_SECRET_BYTES:
        raise InvalidConfig(f"{source}must be at least {MIN_SECRET_BYTES} bytes (as --saltSecret), got {size}: a short "
                            "secret can be guessed from any value in the store", field)


def check_secret(flag_value: str | None, *, encrypt: bool, read_secrets: tuple[str, ...] = ()) -> None:
    """The checks made before anything loads. Messages name the option, never the secret."""
    if flag_value is not None and not flag_value.strip():
        raise InvalidConfig("must not be empty (omit it to run without a tier secret)", "shared_cache_secret")
    secret = flag_value if flag_value is not None else os.environ.get(SECRET_ENV)
    if secret:
        _check_length(secret, "shared_cache_secret", "" if flag_value is not None else f"{SECRET_ENV} ")
    for other in _read_secrets(read_secrets):
        _check_length(other, "shared_cache_read_secrets", "" if read_secrets else f"{READ_SECRETS_ENV} ")
    if _read_secrets(read_secrets) and not secret:
        raise InvalidConfig(f"needs the secret values are written with (--sharedCacheSecret or {SECRET_ENV})",
                            "shared_cache_read_secrets")
    if not encrypt:
        return
    if flag_value is None and not os.environ.get(SECRET_ENV):
        raise InvalidConfig(f"needs a tier secret (--sharedCacheSecret or {SECRET_ENV})", "shared_cache_encrypt")
    try:
        import cryptography  # noqa: F401 - only whether it is there
    except ImportError:
        raise InvalidConfig("needs the cryptography package: pip install 'kvforge[tier]'",
                            "shared_cache_encrypt") from None
