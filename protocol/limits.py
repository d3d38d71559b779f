"""Bounds on what a peer may make us hold."""

from __future__ import annotations

import attrs

# Bytes a chunk frame spends on everything but its payload, generously.
CHUNK_OVERHEAD = 1024


@attrs.frozen
class Limits:
    """Bounds on what a peer may make us hold. Defaults suit hidden states of 8k-wide models."""

    max_frame_bytes: int = 4 << 20
    max_tensor_bytes: int = 64 << 20  # decoded float32 bytes of one tensor
    max_chunks: int = 1024
    max_tensors: int = 8
    max_tensor_dims: int = 4
    max_tokens: int = 1 << 17  # prompt length, or tokens in one frame
    max_hops: int = 64
    max_records: int = 64
    max_string_bytes: int = 4096
    max_grammar_bytes: int = 256 << 10  # a JSON schema's grammar runs to tens of KiB
    max_window: int = 64  # drafted tokens in one decode window (speculative decoding)
    max_ahead: int = 8  # windows that may follow one in flight (Tokens.ahead)

    def __attrs_post_init__(self) -> None:
        if self.max_frame_bytes <= CHUNK_OVERHEAD * 2:
            raise ValueError(f"max_frame_bytes must exceed {CHUNK_OVERHEAD * 2}")
