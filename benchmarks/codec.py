"""Seam codec benchmark: frame encode/decode time, copies, and encoding error on real hidden states.

    python -m benchmarks.codec [--quick] [--out PATH]

- Decode-size frames (one token, n_embd 576) in every encoding: encode and decode µs,
  beside the generated betterproto2 classes doing the same frame.
- A 1 MiB prefill payload: encode time against one plain copy of the payload, and the
  peak allocation during encode as a multiple of the payload (one copy = the frame).
- The error of each lossy encoding on SmolLM2 hidden states at the seam after layer 15
  of real text, and what it does to the tail's logits (max |Δ| and top-1 agreement).
"""

from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import _common

NAME = "codec"
TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made books cheaper "
    "and faster to produce. Within decades, presses had spread across Europe, and the number of printed works "
    "grew from thousands to millions. Scholars argue about how much this changed the way people read, wrote "
    "and thought, but few doubt that it mattered. What follows is a short account of the machines, the printers "
    "and the readers, told through the surviving books themselves."
)


def _time_us(fn: Callable[[], object], n: int) -> float:
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - started) / n * 1e6)
    return statistics.median(samples)


def _frame_timings(n: int) -> dict[str, Any]:
    import crc32c

    from protocol import Activations, Encoding, FrameDecoder, FrameEncoder, Header, Identity, NamedTensor, Phase, Span
    from protocol._generated.noderuntime.seam import v1 as pb

    ident = Identity("req-0001", os.urandom(16), 1, os.urandom(32), os.urandom(8), Span(0, 15))
    header = Header(ident, Phase.DECODE, 100, Span(100, 101), 100)
    array = np.random.default_rng(0).standard_normal((1, 576)).astype(np.float32)
    out: dict[str, Any] = {}
    encoder, decoder = FrameEncoder(), FrameDecoder()
    for encoding in Encoding:
        event = Activations(header, (NamedTensor("hidden_states", array, encoding),))
        (frame,) = encoder.encode(event)
        out[encoding.name] = {
            "frame_bytes": len(frame),
            "encode_us": _time_us(lambda ev=event: encoder.encode(ev), n),  # type: ignore[misc]
            "decode_us": _time_us(lambda fr=frame: decoder.receive(fr), n),  # type: ignore[misc]
        }
    (frame,) = encoder.encode(Activations(header, (NamedTensor("hidden_states", array),)))
    reference = pb.Frame.parse(frame)
    out["betterproto2_F32"] = {
        "frame_bytes": len(bytes(reference)),
        "encode_us": _time_us(lambda: bytes(reference), n // 4),
        "decode_us": _time_us(lambda: pb.Frame.parse(frame), n // 4),
    }
    # 1 MiB prefill payload
    rows = (1 << 20) // (576 * 4)
    big = np.random.default_rng(1).standard_normal((rows, 576)).astype(np.float32)
    event = Activations(Header(ident, Phase.PREFILL, 1, Span(0, rows), 0), (NamedTensor("hidden_states", big),))
    payload_bytes = big.nbytes
    encode_us = _time_us(lambda: encoder.encode(event), 20)
    copy_us = _time_us(lambda: big.tobytes(), 20)
    crc_us = _time_us(lambda: crc32c.crc32c(memoryview(big.data).cast("B")), 20)
    tracemalloc.start()
    tracemalloc.reset_peak()
    (frame,) = encoder.encode(event)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    decode_us = _time_us(lambda: decoder.receive(frame), 20)
    out["prefill_1MiB_F32"] = {
        "payload_bytes": payload_bytes,
        "frame_bytes": len(frame),
        "encode_us": encode_us,
        "one_copy_of_payload_us": copy_us,
        "crc32c_us": crc_us,
        "encode_peak_alloc_over_payload": peak / payload_bytes,
        "decode_us": decode_us,
        "decode_MB_s": payload_bytes / decode_us,
    }
    return out


def _seam_error(model: str) -> dict[str, Any]:
    from noderuntime.engine.llama import Recipe, Rows, ShardEngine, Vocab
    from noderuntime.models.artifacts import LayerRange
    from protocol import Encoding, encodings

    vocab = Vocab(model)
    tokens = np.array(vocab.tokenize(TEXT, add_special=False), np.int32)
    vocab.close()
    recipe = Recipe(n_threads=2, n_ctx_per_seq=512, n_seq_max=1, n_batch=512, n_ubatch=512)
    n = len(tokens)
    head = ShardEngine(model, recipe, LayerRange(0, 15))
    tail = ShardEngine(model, recipe, LayerRange(15, 30))
    seq, pos, out = np.zeros(n, np.int32), np.arange(n, dtype=np.int32), np.ones(n, bool)
    hidden = head.run(Rows(seq, pos, out, tokens=tokens)).hidden
    assert hidden is not None

    def tail_logits(h: np.ndarray) -> np.ndarray:
        tail.remove_sequence(0)
        logits = tail.run(Rows(seq, pos, out, hidden=h), want_logits=True).logits
        assert logits is not None
        return logits

    exact = tail_logits(hidden)
    result: dict[str, Any] = {
        "tokens": n,
        "hidden_abs_max": float(np.abs(hidden).max()),
        "hidden_abs_mean": float(np.abs(hidden).mean()),
    }
    for encoding in Encoding:
        decoded = encodings.decode(encodings.encode(hidden, encoding), hidden.size, encoding).reshape(hidden.shape)
        err = np.abs(decoded - hidden)
        row_max = np.abs(hidden).max(axis=1, keepdims=True)
        logits = tail_logits(decoded)
        result[encoding.name] = {
            "bytes_per_token": encodings.encoded_size(hidden.shape[1], encoding),
            "max_abs_error": float(err.max()),
            "rms_error": float(np.sqrt((err**2).mean())),
            "max_error_over_row_max": float((err / row_max).max()),
            "logits_max_abs_diff": float(np.abs(logits - exact).max()),
            "top1_agreement": float(np.mean(np.argmax(logits, axis=1) == np.argmax(exact, axis=1))),
        }
    head.close()
    tail.close()
    return result


def main(argv: list[str] | None = None) -> int:
    args = _common.parser(NAME, __doc__ or "").parse_args(argv)
    from noderuntime.engine.llama import Recipe
    from noderuntime.models import artifacts
    from noderuntime.models import catalogue as models

    model = models.pull(models.DEMO_MODEL, progress=False)
    timings = _frame_timings(500 if args.quick else 5000)
    error = _seam_error(str(model))
    figures = {"frames": timings, "seam_error_smollm2_layer15": error}
    recipe = Recipe(n_threads=2).describe(artifacts.inspect(model).quant)
    path = _common.out_path(NAME, args)
    _common.write(path, NAME, args, recipe, figures)
    rows = [
        [name, t["frame_bytes"], t["encode_us"], t["decode_us"]]
        for name, t in timings.items()
        if "encode_us" in t and name != "prefill_1MiB_F32"
    ]
    print(_common.table(["decode frame (1x576)", "bytes", "encode µs", "decode µs"], rows))
    p = timings["prefill_1MiB_F32"]
    print(
        f"\n1 MiB prefill: encode {p['encode_us']:.0f} µs (one plain copy {p['one_copy_of_payload_us']:.0f} µs, "
        f"crc32c {p['crc32c_us']:.0f} µs), peak allocation {p['encode_peak_alloc_over_payload']:.2f}x payload, "
        f"decode {p['decode_us']:.0f} µs"
    )
    rows = [
        [
            enc,
            e["bytes_per_token"],
            e["max_abs_error"],
            e["max_error_over_row_max"],
            e["logits_max_abs_diff"],
            e["top1_agreement"],
        ]
        for enc, e in error.items()
        if isinstance(e, dict)
    ]
    print("\n" + _common.table(["encoding", "B/token", "max |err|", "max err/row max", "max |Δlogits|", "top-1"], rows))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
