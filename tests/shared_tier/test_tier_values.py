"""Shared-tier values: a round trip keeps every byte; each way a value can be wrong is a rejection, not a read."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runtime.shared_tier.values import ValueKind, ValueRejected, decode, encode

ROOT, OTHER_ROOT = b"r" * 16, b"o" * 16
KEY = b"k" * 16
TOKENS = np.arange(16, dtype=np.int32)


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((2, 3, 16, 8)).astype(np.float16), rng.integers(0, 255, (5,), dtype=np.uint8)]


def _value() -> bytes:
    return encode(ValueKind.PAGE, ROOT, KEY, TOKENS, _arrays())


def test_round_trip_keeps_tokens_and_arrays() -> None:
    decoded = decode(_value(), root=ROOT, key=KEY, kind=ValueKind.PAGE, like=_arrays(), tokens=TOKENS)
    assert np.array_equal(decoded.tokens, TOKENS)
    for got, want in zip(decoded.arrays, _arrays(), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_a_value_without_arrays_round_trips() -> None:
    decoded = decode(encode(ValueKind.LENGTH, ROOT, KEY, [37], []), root=ROOT, key=KEY, kind=ValueKind.LENGTH)
    assert decoded.tokens.tolist() == [37] and decoded.arrays == []


@pytest.mark.parametrize("position", [0, 10, 40, 200, -20, -1])
def test_any_flipped_byte_is_corrupt(position: int) -> None:
    value = bytearray(_value())
    value[position] ^= 0x40
    with pytest.raises(ValueRejected) as info:
        decode(bytes(value), root=ROOT, key=KEY, kind=ValueKind.PAGE, like=_arrays(), tokens=TOKENS)
    assert info.value.reason == "corrupt"


@pytest.mark.parametrize("cut", [1, 17, 400])
def test_a_truncated_value_is_corrupt(cut: int) -> None:
    with pytest.raises(ValueRejected) as info:
        decode(_value()[:-cut], root=ROOT, key=KEY, kind=ValueKind.PAGE)
    assert info.value.reason == "corrupt"


@pytest.mark.parametrize("change", ["root", "key", "kind", "tokens", "shape", "dtype"])
def test_a_well_formed_value_of_something_else_is_foreign(change: str) -> None:
    like, tokens = _arrays(), TOKENS
    root, key, kind = ROOT, KEY, ValueKind.PAGE
    if change == "root":
        root = OTHER_ROOT
    elif change == "key":
        key = b"x" * 16
    elif change == "kind":
        kind = ValueKind.CHECKPOINT
    elif change == "tokens":
        tokens = TOKENS + 1
    elif change == "shape":
        like = [like[0][:, :, :8], like[1]]
    else:
        like = [like[0].astype(np.float32), like[1]]
    with pytest.raises(ValueRejected) as info:
        decode(_value(), root=root, key=key, kind=kind, like=like, tokens=tokens)
    assert info.value.reason == "foreign"
