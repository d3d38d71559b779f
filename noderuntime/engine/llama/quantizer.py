"""llama.cpp's own quantizer: a GGUF model's float weights written at a smaller type."""

from __future__ import annotations

import ctypes
import os

from noderuntime.engine.base import EngineError
from noderuntime.engine.llama.binding import llama_cpp

__all__ = ["QUANT_TYPES", "quantize"]

# what `quantize` makes, by llama.cpp's file-type names
QUANT_TYPES = {
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
}


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], kind: str, *, threads: int = 2) -> None:
    """Write ``dst``, the GGUF model ``src`` quantized to ``kind`` by llama.cpp's own quantizer.

    ``src`` should hold float weights (F32 or F16); llama.cpp picks the per-tensor types
    of the mixed kinds (Q4_K_M keeps some tensors at Q6_K, and falls back where a row
    length is not a multiple of 256).
    """
    try:
        ftype = QUANT_TYPES[kind]
    except KeyError:
        raise EngineError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANT_TYPES)}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = threads
    params.ftype = ftype
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if status != 0:
        raise EngineError(f"llama.cpp could not quantize {src} to {kind} (status {status}; see the log)")
