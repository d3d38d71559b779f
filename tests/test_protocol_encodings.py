"""Tensor encodings: exact f32, bounded error for f16, bf16 and q8."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol import Encoding, LocalProtocolError, encodings

finite = hnp.arrays(np.float32, st.integers(1, 300), elements=st.floats(-6e4, 6e4, width=32))


@settings(max_examples=200, deadline=None)
@given(finite)
def test_f32_is_exact(array: np.ndarray) -> None:
    out = encodings.decode(encodings.encode(array, Encoding.F32), array.size, Encoding.F32)
    assert np.array_equal(out, array)


@settings(max_examples=200, deadline=None)
@given(finite)
def test_f16_error_is_within_half_an_ulp(array: np.ndarray) -> None:
    out = encodings.decode(encodings.encode(array, Encoding.F16), array.size, Encoding.F16)
    # relative 2^-11 for normal halves; absolute 2^-25 below the normal range
    assert np.all(np.abs(out - array) <= np.maximum(np.abs(array) * 2.0**-11, 2.0**-25))


@settings(max_examples=200, deadline=None)
@given(finite)
def test_bf16_error_is_within_half_an_ulp(array: np.ndarray) -> None:
    out = encodings.decode(encodings.encode(array, Encoding.BF16), array.size, Encoding.BF16)
    assert np.all(np.abs(out - array) <= np.abs(array) * 2.0**-8 + 1e-38)


@settings(max_examples=200, deadline=None)
@given(finite)
def test_q8_error_is_within_half_a_step_of_its_block(array: np.ndarray) -> None:
    out = encodings.decode(encodings.encode(array, Encoding.Q8), array.size, Encoding.Q8)
    padded = np.zeros(-(-array.size // 32) * 32, np.float32)
    padded[: array.size] = array
    block_max = np.repeat(np.abs(padded.reshape(-1, 32)).max(axis=1), 32)[: array.size]
    # half a step (max/254), plus the float16 rounding of the scale (2^-11 relative, times up to 127 steps),
    # plus, for blocks so small their scale underflows float16, 127 subnormal half-steps
    assert np.all(np.abs(out - array) <= block_max / 254 + block_max * 2.0**-11 + 127 * 2.0**-25)


def test_sizes() -> None:
    assert encodings.encoded_size(576, Encoding.F32) == 2304
    assert encodings.encoded_size(576, Encoding.F16) == 1152
    assert encodings.encoded_size(576, Encoding.BF16) == 1152
    assert encodings.encoded_size(576, Encoding.Q8) == 18 * 34
    assert encodings.encoded_size(33, Encoding.Q8) == 2 * 34


def test_f16_refuses_values_it_cannot_carry() -> None:
    with pytest.raises(LocalProtocolError, match="65504"):
        encodings.encode(np.array([1e6], np.float32), Encoding.F16)
    for encoding in (Encoding.F16, Encoding.BF16, Encoding.Q8):
        with pytest.raises(LocalProtocolError, match="NaN or Inf"):
            encodings.encode(np.array([np.nan], np.float32), encoding)


def test_big_endian_payloads_are_read() -> None:
    array = np.arange(8, dtype=np.float32) - 3.5
    out = encodings.decode(array.astype(">f4").tobytes(), 8, Encoding.F32, big_endian=True)
    assert np.array_equal(out, array) and out.dtype == np.float32
