"""Binary packing of token ids and logprobs.

Token ids are little-endian int32. Logprobs are float32 when that is lossless for every value
(engines compute them in float32, so it nearly always is) and float64 otherwise; a one-byte tag
says which, so what the engine returned is always what comes back out.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np

_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Sequence[int]) -> bytes:
    a = array("i", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_ids(blob: bytes | None) -> list[int]:
    if not blob:
        return []
    a = array("i")
    a.frombytes(blob)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def unpack_ids_array(blob: bytes | None) -> np.ndarray:
    """`unpack_ids` as a read-only little-endian int32 array over the blob."""
    return np.frombuffer(blob or b"", dtype="<i4")


def pack_logprobs(values: Sequence[float]) -> bytes:
    f32 = array("f", values)
    if list(f32) == list(values):
        tag, a = b"f", f32
    else:
        tag, a = b"d", array("d", values)
    if not _LITTLE:
        a.byteswap()
    return tag + a.tobytes()


def unpack_logprobs(blob: bytes | None) -> list[float]:
    if not blob:
        return []
    tag, body = blob[:1], blob[1:]
    if tag not in (b"f", b"d"):
        raise ValueError(f"unknown logprob packing tag {tag!r}")
    a: array[float] = array("f" if tag == b"f" else "d")
    a.frombytes(body)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def unpack_logprobs_array(blob: bytes | None) -> np.ndarray:
    """`unpack_logprobs` as a read-only array over the blob: float32 or float64, as stored."""
    if not blob:
        return np.empty(0, dtype="<f4")
    tag = blob[:1]
    if tag not in (b"f", b"d"):
        raise ValueError(f"unknown logprob packing tag {tag!r}")
    return np.frombuffer(blob, dtype="<f4" if tag == b"f" else "<f8", offset=1)
