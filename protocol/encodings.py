"""Tensor encodings on the wire. Every tensor is float32 in memory.

- ``F32``: exact, 4 bytes per element, little-endian.
- ``F16``: IEEE half, 2 bytes; values beyond +-65504 cannot be carried.
- ``BF16``: the top 16 bits of float32 with round-to-nearest-even, 2 bytes.
- ``Q8``: blocks of 32 elements (in row-major order), each a float16 scale followed
  by 32 int8 values; 34 bytes per block, the last block zero-padded. Error per element
  is at most half a step of its block: ``max|x| / 254`` (plus the scale's f16 rounding; in
  blocks whose largest value is below ~7.6e-6 the scale underflows float16 and the error
  is absolute, at most 127 * 2^-25).

Non-finite values cannot be carried by any lossy encoding and are refused on encode;
the decoder refuses non-finite results from every encoding (hidden states are finite).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocol.errors import LocalProtocolError, RemoteProtocolError, StatusCode
from protocol.events import Encoding

Q8_BLOCK = 32
_Q8_BLOCK_BYTES = 2 + Q8_BLOCK
_F16_MAX = 65504.0


def encoded_size(n_elements: int, encoding: Encoding) -> int:
    """Bytes an ``n_elements`` tensor takes in ``encoding``."""
    if encoding == Encoding.F32:
        return 4 * n_elements
    if encoding in (Encoding.F16, Encoding.BF16):
        return 2 * n_elements
    if encoding == Encoding.Q8:
        return -(-n_elements // Q8_BLOCK) * _Q8_BLOCK_BYTES
    raise LocalProtocolError(f"unknown encoding {encoding!r}")


def encode(array: np.ndarray, encoding: Encoding) -> bytes | memoryview:
    """The wire bytes of a float32 array (little-endian).

    For F32 this is a view of the array's own memory, not a copy: the frame that
    holds it is the one copy made.
    """
    flat = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    if encoding == Encoding.F32:
        little: Any = flat.astype("<f4", copy=False)
        return memoryview(little).cast("B")
    if not np.all(np.isfinite(flat)):
        raise LocalProtocolError(f"{encoding.name} cannot carry NaN or Inf", StatusCode.INVALID_ARGUMENT)
    if encoding == Encoding.F16:
        if flat.size and float(np.max(np.abs(flat))) > _F16_MAX:
            raise LocalProtocolError("F16 cannot carry values beyond +-65504", StatusCode.OUT_OF_RANGE)
        return flat.astype("<f2").tobytes()
    if encoding == Encoding.BF16:
        bits = flat.view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # round to nearest, ties to even
        return rounded.astype("<u2").tobytes()
    if encoding == Encoding.Q8:
        n = flat.size
        blocks = -(-n // Q8_BLOCK)
        padded = np.zeros(blocks * Q8_BLOCK, dtype=np.float32)
        padded[:n] = flat
        grid = padded.reshape(blocks, Q8_BLOCK)
        scale = (np.max(np.abs(grid), axis=1) / 127.0).astype(np.float16)
        safe = np.where(scale == 0, np.float16(1.0), scale).astype(np.float32)
        q = np.clip(np.rint(grid / safe[:, None]), -127, 127).astype(np.int8)
        out = np.empty((blocks, _Q8_BLOCK_BYTES), dtype=np.uint8)
        out[:, :2] = scale.astype("<f2").view(np.uint8).reshape(blocks, 2)
        out[:, 2:] = q.view(np.uint8)
        return out.tobytes()
    raise LocalProtocolError(f"unknown encoding {encoding!r}")


def decode(payload: bytes | memoryview, n_elements: int, encoding: Encoding, *, big_endian: bool = False) -> np.ndarray:
    """Float32 elements from wire bytes; the caller has checked ``len(payload)``."""
    if len(payload) != encoded_size(n_elements, encoding):
        raise RemoteProtocolError(
            f"{encoding.name} payload of {len(payload)} bytes for {n_elements} elements", StatusCode.INVALID_ARGUMENT
        )
    order = ">" if big_endian else "<"
    if encoding == Encoding.F32:
        out = np.frombuffer(payload, dtype=order + "f4")
    elif encoding == Encoding.F16:
        out = np.frombuffer(payload, dtype=order + "f2").astype(np.float32)
    elif encoding == Encoding.BF16:
        out = (np.frombuffer(payload, dtype=order + "u2").astype(np.uint32) << 16).view(np.float32)
    elif encoding == Encoding.Q8:
        raw = np.frombuffer(payload, dtype=np.uint8).reshape(-1, _Q8_BLOCK_BYTES)
        scale = raw[:, :2].copy().view(order + "f2").astype(np.float32)
        q = raw[:, 2:].view(np.int8).astype(np.float32)
        out = (q * scale).reshape(-1)[:n_elements]
    else:
        raise RemoteProtocolError(f"unknown encoding {encoding!r}", StatusCode.UNIMPLEMENTED)
    if out.dtype.byteorder == ">" or (out.dtype.byteorder == "=" and big_endian):
        out = out.astype(np.float32)
    if not np.all(np.isfinite(out)):
        raise RemoteProtocolError("tensor holds NaN or Inf", StatusCode.INVALID_ARGUMENT)
    return out
