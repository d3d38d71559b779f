"""The demo: the demo model split over shard processes, generating text."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from noderuntime.chat import ChatTemplate
from noderuntime.engine import Recipe, Vocab
from noderuntime.parity import ranges_from_cuts
from noderuntime.procchain import ProcessChain


def run_chain_demo(model: Path, cuts: Sequence[int], *, prompt: str, max_tokens: int) -> int:
    """Chat-complete ``prompt`` greedily through one process per shard; print text and timings."""
    vocab = Vocab(model)
    ranges = ranges_from_cuts(cuts)
    text = prompt
    if vocab.chat_template:
        template = ChatTemplate(vocab.chat_template, bos_token=vocab.piece(vocab.bos, special=True).decode())
        text = template.render([{"role": "user", "content": prompt}])
    tokens = np.array(vocab.tokenize(text, add_special=vocab.add_bos), dtype=np.int32)
    recipe = Recipe(n_threads=2, n_ctx_per_seq=1024, n_seq_max=1)
    print(f"model {model.name}: {len(ranges)} shard processes {', '.join(str(r) for r in ranges)}")
    print(f"prompt: {prompt}\n")
    started = time.perf_counter()
    with ProcessChain(model, ranges, recipe) as chain:
        load_s = time.perf_counter() - started
        n = len(tokens)
        outputs = np.zeros(n, dtype=bool)
        outputs[-1] = True
        t0 = time.perf_counter()
        result = chain.step(np.zeros(n, np.int32), np.arange(n, dtype=np.int32), outputs, tokens)
        ttft = time.perf_counter() - t0
        prefill_seconds = list(chain.seconds)
        generated: list[int] = []
        pending = b""
        assert result.logits is not None
        token = int(np.argmax(result.logits[-1]))
        t_decode = time.perf_counter()
        while not vocab.is_eog(token) and len(generated) < max_tokens:
            generated.append(token)
            pending += vocab.piece(token)
            try:
                sys.stdout.write(pending.decode("utf-8"))
                pending = b""
            except UnicodeDecodeError:
                pass  # a multi-byte character split across tokens: wait for the rest
            sys.stdout.flush()
            if len(generated) == max_tokens:
                break
            result = chain.step(
                np.zeros(1, np.int32), np.array([n], np.int32), np.ones(1, bool), np.array([token], np.int32)
            )
            n += 1
            assert result.logits is not None
            token = int(np.argmax(result.logits[0]))
        decode_s = time.perf_counter() - t_decode
        seconds = list(chain.seconds)
    print("\n")
    steps = max(1, len(generated) - 1)
    print(
        f"{len(tokens)} prompt tokens, {len(generated)} generated; load {load_s:.1f} s, "
        f"time to first token {ttft * 1e3:.0f} ms, decode {steps / decode_s if decode_s else 0:.1f} tok/s"
    )
    print(f"{'shard':>8} {'layers':>8} {'prefill ms':>11} {'decode ms/token':>16}")
    for i, layers in enumerate(ranges):
        decode_ms = (seconds[i] - prefill_seconds[i]) / steps * 1e3
        print(f"{i:>8} {layers!s:>8} {prefill_seconds[i] * 1e3:>11.1f} {decode_ms:>16.2f}")
    vocab.close()
    return 0
