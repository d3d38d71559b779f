"""The shard engine: one layer range of a GGUF model, loaded through the patched llama.cpp.

A :class:`ShardEngine` loads one layer range of a GGUF model (see ``kernels_patch/``) and
runs batches of rows, each row being (sequence id, position, token id or hidden row, wants
output). A non-tail shard returns the pre-norm residual of every row; the tail returns
logits of the rows that asked for output, and can sample them with per-session llama.cpp
sampler chains (:mod:`noderuntime.engine.llama.sampling`).

Everything here is synchronous and unlocked: its calls never overlap because one owner
makes them, the node's batcher, which runs batches and probes on the engine's one thread
(:mod:`noderuntime.engine.thread`) and removes KV between them on the event loop's.
``llama_decode`` releases the GIL.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from noderuntime.engine.base import EngineError, MemoryReport, Rows, StepResult, draws_to_keep, token_logprob
from noderuntime.engine.llama.binding import ggml_cpu, lib, llama_cpp
from noderuntime.engine.llama.devices import find_device, pinned_threadpool
from noderuntime.engine.llama.recipe import KV_TYPES, Recipe
from noderuntime.engine.llama.sampling import SamplerChain
from noderuntime.models import artifacts
from noderuntime.models.artifacts import ArtifactError, ArtifactInfo, LayerRange
from protocol import Sampling, TokenLogprob

__all__ = ["ShardEngine"]


class _BatchBuffers:
    """A llama_batch over arrays this engine owns, so filling it is numpy writes."""

    def __init__(self, capacity: int, n_embd: int, takes_hidden: bool) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.hidden = np.zeros((capacity, n_embd), dtype=np.float32) if takes_hidden else None
        self.positions = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq_ids.ctypes.data
        seq_ptr_t = ctypes.POINTER(llama_cpp.llama_seq_id)
        self._seq_ptrs = (seq_ptr_t * capacity)(*(ctypes.cast(base + 4 * i, seq_ptr_t) for i in range(capacity)))
        self.batch = llama_cpp.llama_batch()
        self.batch.token = self.tokens.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        self.batch.embd = (
            self.hidden.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if self.hidden is not None else None
        )
        if self.hidden is not None:
            self.batch.token = None
        self.batch.pos = self.positions.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = self._seq_ptrs
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


class ShardEngine:
    """One loaded layer range of a model and its context (KV for ``n_seq_max`` sequences)."""

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        recipe: Recipe,
        layers: LayerRange | None = None,
        *,
        expected_fingerprint: str | None = None,
        output_hidden: bool = False,
        dry_run: bool = False,
        cores: Sequence[int] | None = None,
    ) -> None:
        """Load ``layers`` of the model (all of them when ``None``).

        ``model_path`` may be the whole model or a shard file cut by ``noderuntime shard
        split``; a shard file must hold exactly ``layers``. ``expected_fingerprint`` makes
        the load fail unless the file is (a slice of) that artifact. ``output_hidden`` on a
        tail shard also returns the normed final hidden state of every row (for parity
        checks; it makes every row an output). ``dry_run`` reads only the file's index and
        lets llama.cpp size every buffer without allocating one: :meth:`memory` is then its
        estimate, and nothing can run (see :func:`noderuntime.engine.memplan.needs`).

        ``cores`` pins the CPU team's threads one to a core, in order (see :func:`pinned_cores`);
        where it runs, not what it computes: the recipe and every result are the same.
        """
        self._model: Any = None
        self._ctx: Any = None
        self._threadpool: Any = None
        self._cores = tuple(cores) if cores is not None else None
        self.recipe = recipe
        try:
            # a dry run sizes buffers from the index alone: hashing every byte first (all of a
            # header copy's hole, 17 GB for a 30B model joining from a URL) would buy it nothing
            info = artifacts.inspect(model_path, verify=not dry_run or expected_fingerprint is not None)
        except ArtifactError as exc:
            raise EngineError(str(exc)) from None
        if expected_fingerprint is not None:
            try:
                artifacts.verify_parent(info, expected_fingerprint)
            except ArtifactError as exc:
                raise EngineError(str(exc)) from None
        if layers is None:
            layers = info.layer_range
        try:
            layers.check_within(info.n_layer)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        if info.is_shard_file and layers != info.layer_range:
            raise EngineError(f"{info.path} holds layers {info.layer_range}, not the requested {layers}")
        is_range = layers != LayerRange(0, info.n_layer)
        if is_range and info.architecture not in artifacts.SUPPORTED_ARCHITECTURES:
            raise EngineError(f"layer ranges are not supported for architecture {info.architecture!r}")
        self.info: ArtifactInfo = info
        self.layers = layers
        self.is_head = layers.start == 0
        self.is_tail = layers.end == info.n_layer
        self.n_embd = info.n_embd
        self.output_hidden = output_hidden and self.is_tail
        self.dry_run = dry_run
        self._load(is_range and not info.is_shard_file, dry_run)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self._model)))
        self._buffers = _BatchBuffers(recipe.n_batch, self.n_embd, takes_hidden=not self.is_head)
        # set add/discard are atomic: a chain dropped unclosed closes in __del__, on the collector's thread
        self._live_samplers: set[int] = set()

    def _gpu_layers(self) -> int:
        """llama.cpp's ``n_gpu_layers`` for this range: it offloads layers ``il >= n_layer + 1 - n``."""
        if self.recipe.device == "cpu":
            return 0
        local = self.recipe.gpu_layers
        if local is None or local >= len(self.layers):
            return self.info.n_layer + 1  # every layer and the output layer (the tail's lm_head)
        return self.info.n_layer + 1 - self.layers.end + local

    def _load(self, override_range: bool, dry_run: bool) -> None:
        mparams = llama_cpp.llama_model_default_params()
        # an explicit, NULL-terminated device list: none on the CPU (a GPU build then keeps
        # every op on the CPU too), the one named device otherwise
        devices = (ctypes.c_void_p * 2)()
        if self.recipe.device != "cpu":
            devices[0] = find_device(self.recipe.device)
        self._devices = devices  # read during load only; kept alive until then
        mparams.devices = ctypes.addressof(devices)
        mparams.n_gpu_layers = self._gpu_layers()
        mparams.no_alloc = dry_run
        mparams.use_extra_bufts = self.recipe.repack
        # a dry run with a mapping aborts in llama.cpp; it reads no tensor data anyway
        mapped = self.recipe.use_mmap and not dry_run
        mparams.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if mapped else llama_cpp.LLAMA_LOAD_MODE_NONE
        overrides = None
        if override_range:
            overrides = (llama_cpp.llama_model_kv_override * 3)()
            for slot, (key, value) in enumerate(
                ((artifacts.SHARD_START_KEY, self.layers.start), (artifacts.SHARD_END_KEY, self.layers.end))
            ):
                overrides[slot].key = key.encode()
                overrides[slot].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
                overrides[slot].value.val_i64 = value
            overrides[2].key = b""
            mparams.kv_overrides = overrides
        self._overrides = overrides  # llama.cpp reads them during load only; keep them alive until then
        model = llama_cpp.llama_model_load_from_file(str(self.info.path).encode(), mparams)
        if not model:
            raise EngineError(f"llama.cpp could not load layers {self.layers} of {self.info.path} (see the log)")
        self._model = model
        start, end = ctypes.c_int32(), ctypes.c_int32()
        lib.llama_model_shard_range(model, ctypes.byref(start), ctypes.byref(end))
        if (start.value, end.value) != (self.layers.start, self.layers.end):
            self.close()
            raise EngineError(f"llama.cpp loaded layers {start.value}:{end.value}, expected {self.layers}")

        r = self.recipe
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = r.n_ctx_per_seq * r.n_seq_max
        cparams.n_batch = r.n_batch
        cparams.n_ubatch = r.n_ubatch
        cparams.n_seq_max = r.n_seq_max
        cparams.n_threads = r.n_threads
        cparams.n_threads_batch = r.n_threads
        cparams.kv_unified = r.kv_unified  # False: one KV stream per sequence, sessions never see each other
        cparams.type_k = cparams.type_v = KV_TYPES[r.kv_type]
        cparams.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if r.flash_attn == "on"
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.embeddings = self.output_hidden or not self.is_tail
        cparams.offload_kqv = True  # a GPU layer's KV lives on its GPU (no effect on the CPU)
        cparams.no_perf = True
        # a sliding-window model's local layers keep every position's KV, as its global layers
        # do (llama.cpp's default, said here so that no change of default moves it). A cache
        # sized to the window reuses the cells of positions that slid out of it, and a decode
        # window's rollback frees cells in another order than single steps fill them: Gemma 3
        # with a window that crossed the cache's end, two of its rows not kept, gave other
        # logits than single steps from there on (145 of 145 positions), where the full-size
        # cache gives the same bits (tests/test_speculative.py)
        cparams.swa_full = True
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise EngineError(f"llama.cpp could not create a context for {self.info.path} with {r}")
        self._ctx = ctx
        self._memory = llama_cpp.llama_get_memory(ctx)
        if self._cores is not None and not dry_run:
            try:
                self._threadpool = pinned_threadpool(r.n_threads, self._cores)
            except EngineError:
                self.close()
                raise
            lib.llama_attach_threadpool(ctx, self._threadpool, self._threadpool)

    @property
    def exact_windows(self) -> bool:
        """Whether a decode window's rows have the bits of single steps (speculation stays exact).

        On the CPU without repack and with a KV stream per sequence, a row's result does not
        depend on its batch-mates or on how positions are cut into steps (patches 0005, 0008,
        0009; tests/test_batch_invariance.py). On a GPU that is not certified.
        """
        recipe = self.recipe
        return recipe.device == "cpu" and not recipe.repack and not recipe.kv_unified

    @property
    def context(self) -> Any:
        """The llama.cpp context (for sampler chains)."""
        return self._ctx

    def run(
        self,
        rows: Rows,
        *,
        samplers: Mapping[int, SamplerChain] | None = None,
        want_logits: bool = False,
        scores: Mapping[int, tuple[int, int]] | None = None,
    ) -> StepResult:
        """Run one batch. ``samplers`` maps row index -> chain for output rows to sample.

        ``scores`` maps output rows to (token, top): that token's log-probability at the row
        is wanted, with the ``top`` most likely (a prompt's, for OpenAI's ``echo``).
        """
        if self._ctx is None:
            raise EngineError("engine is closed")
        if self.dry_run:
            raise EngineError("a dry-run engine sizes memory only; it cannot run")
        n = len(rows)
        buf = self._buffers
        if not 0 < n <= buf.capacity:
            raise EngineError(f"batch of {n} rows; this engine takes 1 to {buf.capacity}")
        if self.is_head:
            if rows.tokens is None:
                raise EngineError("the head shard takes token ids")
            buf.tokens[:n] = rows.tokens
        else:
            if rows.hidden is None or rows.hidden.shape != (n, self.n_embd):
                raise EngineError(f"shard {self.layers} takes hidden rows of shape ({n}, {self.n_embd})")
            assert buf.hidden is not None
            buf.hidden[:n] = rows.hidden
        if np.any(rows.seq_ids < 0) or np.any(rows.seq_ids >= self.recipe.n_seq_max):
            raise EngineError(f"sequence ids must lie in [0, {self.recipe.n_seq_max})")
        buf.seq_ids[:n] = rows.seq_ids
        buf.positions[:n] = rows.positions
        outputs = np.ones(n, dtype=bool) if (self.output_hidden or not self.is_tail) else rows.outputs
        buf.logits[:n] = outputs
        buf.batch.n_tokens = n
        started = time.perf_counter()
        if self._threadpool is None:
            status = llama_cpp.llama_decode(self._ctx, buf.batch)
        else:
            # ggml pins the calling thread to the team's first core: give it back its own
            own = os.sched_getaffinity(0)
            try:
                status = llama_cpp.llama_decode(self._ctx, buf.batch)
            finally:
                os.sched_setaffinity(0, own)
        if status != 0:
            raise EngineError(f"llama_decode failed with status {status}" + (" (no KV slot)" if status == 1 else ""))
        hidden = None
        if self.output_hidden or not self.is_tail:
            ptr = llama_cpp.llama_get_embeddings(self._ctx)
            hidden = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy()
        logits = None
        sampled: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        if self.is_tail:
            out_rows = np.flatnonzero(rows.outputs)
            if want_logits and len(out_rows):
                logits = np.empty((len(out_rows), self.n_vocab), dtype=np.float32)
                for k, out_row in enumerate(out_rows.tolist()):
                    ptr = llama_cpp.llama_get_logits_ith(self._ctx, out_row)
                    logits[k] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            ended: set[int] = set()  # chains whose draw left their drafts: their later rows draw nothing
            for row, chain in (samplers or {}).items():
                if not rows.outputs[row]:
                    raise EngineError(f"row {row} has a sampler but asked for no output")
                if id(chain) in ended:
                    continue
                sampled[row] = chain.sample(self._ctx, row, int(rows.positions[row]))
                if not draws_to_keep(rows, row, sampled[row]):
                    ended.add(id(chain))
                if chain.params.logprobs:
                    logprobs[row] = token_logprob(self._logits_row(row), sampled[row], chain.params.top_logprobs)
            for row, (token, top) in (scores or {}).items():
                if not rows.outputs[row]:
                    raise EngineError(f"row {row} is scored but asked for no output")
                logprobs[row] = token_logprob(self._logits_row(row), token, top)
        return StepResult(
            hidden=hidden, logits=logits, sampled=sampled, seconds=time.perf_counter() - started, logprobs=logprobs
        )

    def _logits_row(self, row: int) -> np.ndarray:
        # a view of llama.cpp's buffer, valid until the next decode: read at once
        ptr = llama_cpp.llama_get_logits_ith(self._ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def new_sampler(self, params: Sampling, history: Sequence[int] = (), generated: Sequence[int] = ()) -> SamplerChain:
        """A sampler chain for this model's vocabulary (see :meth:`Engine.new_sampler`)."""
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        return SamplerChain(params, vocab, self.n_vocab, history, generated=generated, live=self._live_samplers)

    @property
    def live_samplers(self) -> int:
        """Sampler chains made by :meth:`new_sampler` and not yet closed (grammar states included)."""
        return len(self._live_samplers)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop all KV of ``seq_id``; idempotent."""
        if self._ctx is not None:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def truncate_sequence(self, seq_id: int, keep: int) -> None:
        """Drop the KV of ``seq_id`` from position ``keep`` on (a decode window's rows not kept)."""
        if self._ctx is None:
            raise EngineError("the engine is closed")
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, keep, -1)

    def save_sequence(self, seq_id: int) -> bytes:
        """The KV ``seq_id`` holds, as llama.cpp writes a sequence's state (its cells, this shard's layers).

        What a prefix cache keeps of a finished session: :meth:`restore_sequence` puts it back.
        """
        if self._ctx is None:
            raise EngineError("the engine is closed")
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx, seq_id))
        buffer = (ctypes.c_uint8 * size)()
        written = int(llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, seq_id))
        if written != size:
            raise EngineError(f"llama.cpp wrote {written} of the {size} bytes of sequence {seq_id}'s state")
        return bytes(buffer)

    def restore_sequence(self, seq_id: int, state: bytes, keep: int) -> None:
        """Put a saved sequence's KV into ``seq_id`` (which must hold none), keeping its first ``keep`` positions."""
        if self._ctx is None:
            raise EngineError("the engine is closed")
        if self.positions(seq_id) is not None:
            raise EngineError(f"sequence {seq_id} is not empty")
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if int(llama_cpp.llama_state_seq_set_data(self._ctx, buffer, len(state), seq_id)) == 0:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            raise EngineError(f"llama.cpp could not restore a saved state into sequence {seq_id}")
        span = self.positions(seq_id)
        if span is None or span[0] != 0 or span[1] < keep - 1:
            llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
            raise EngineError(f"the saved state holds positions {span}, not the first {keep}")
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, keep, -1)

    def copy_sequence(self, source: int, target: int, keep: int) -> None:
        """Give the empty ``target`` the first ``keep`` positions of ``source``'s KV, in place.

        The other way to reuse a prefix (the node keeps :meth:`save_sequence`'s bytes instead,
        ``benchmarks.prefix`` compares them). With one KV stream per sequence, as here, llama.cpp
        copies only whole streams (a partial range aborts the process), at the next batch: the
        copy is ``n_ctx_per_seq`` cells of every layer, whatever ``keep`` is.
        """
        if self._ctx is None:
            raise EngineError("the engine is closed")
        if self.positions(target) is not None:
            raise EngineError(f"sequence {target} is not empty")
        llama_cpp.llama_memory_seq_cp(self._memory, source, target, -1, -1)
        llama_cpp.llama_memory_seq_rm(self._memory, target, keep, -1)

    def positions(self, seq_id: int) -> tuple[int, int] | None:
        """(first, last) position held in KV for ``seq_id``, or ``None`` when empty."""
        if self._ctx is None:
            return None
        last = int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq_id))
        if last < 0:
            return None
        return int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq_id)), last

    def kv_cells_used(self) -> int:
        """KV cells held by all sequences together (0 once every session released)."""
        total = 0
        for seq in range(self.recipe.n_seq_max):
            span = self.positions(seq)
            if span is not None:
                total += span[1] - span[0] + 1
        return total

    def memory(self) -> MemoryReport:
        """Weights, KV and compute buffer bytes, by llama.cpp's memory breakdown."""
        if self._ctx is None:
            return MemoryReport(0, 0, 0, 0, 0, 0)
        sums = []
        for function in (lib.llama_context_memory_totals, lib.llama_context_memory_host):
            model, context, compute = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
            function(self._ctx, ctypes.byref(model), ctypes.byref(context), ctypes.byref(compute))
            sums += [model.value, context.value, compute.value]
        return MemoryReport(*sums)

    def recipe_description(self) -> dict[str, Any]:
        """The recipe plus the quant of the loaded artifact."""
        return self.recipe.describe(self.info.quant)

    def close(self) -> None:
        """Free context and model; safe to call twice."""
        if self._ctx is not None:
            llama_cpp.llama_free(self._ctx)
            self._ctx = None
        if self._threadpool is not None:  # after the context that uses it
            ggml_cpu.ggml_threadpool_free(self._threadpool)
            self._threadpool = None
        if self._model is not None:
            llama_cpp.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> ShardEngine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
