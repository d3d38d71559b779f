"""The llama.cpp engine: shards of a GGUF model run through the patched llama.cpp.

Its public names, from the modules that hold them:

- ``binding``: the ONLY module that imports ``llama_cpp``; loads it, refuses a stock build
  (:class:`PatchMissingError`), binds what the bindings leave out, routes its log, and
  says what was loaded (:func:`build_info`). Every other module takes the library from it.
- ``devices``: the devices the build sees and the cores a CPU team keeps to
  (:func:`describe_device`, :func:`device_memory`, :func:`kernel_class`, :func:`pinned_cores`).
- ``recipe``: how a shard runs (:class:`Recipe`) and its fingerprint.
- ``shard``: :class:`ShardEngine`, one loaded layer range that runs batches of rows.
- ``sampling``: :class:`SamplerChain`, a session's sampler chain on the tail.
- ``grammar``: GBNF checks and the grammar of a JSON schema.
- ``vocab``: :class:`Vocab`, the tokenizer loaded vocab-only.
- ``quantizer``: :func:`quantize`, llama.cpp's own quantizer.

Importing this package loads llama.cpp (and fails with :class:`PatchMissingError` where
it is missing or stock); the plain data and the engine interface live in
:mod:`noderuntime.engine.base`, which needs no llama.cpp.
"""

from noderuntime.engine.base import EngineError, GrammarError, MemoryReport, Rows, StepResult
from noderuntime.engine.llama.binding import PatchMissingError, build_info, llama_cpp
from noderuntime.engine.llama.devices import describe_device, device_memory, device_report, kernel_class, pinned_cores
from noderuntime.engine.llama.grammar import check_grammar, integer_range_gbnf, json_schema_grammar
from noderuntime.engine.llama.quantizer import QUANT_TYPES, quantize
from noderuntime.engine.llama.recipe import FlashAttn, KvType, Recipe, default_flash_attn, flash_attn_choice
from noderuntime.engine.llama.sampling import SamplerChain
from noderuntime.engine.llama.shard import ShardEngine
from noderuntime.engine.llama.vocab import Vocab

__all__ = [
    "QUANT_TYPES",
    "EngineError",
    "FlashAttn",
    "GrammarError",
    "KvType",
    "MemoryReport",
    "PatchMissingError",
    "Recipe",
    "Rows",
    "SamplerChain",
    "ShardEngine",
    "StepResult",
    "Vocab",
    "build_info",
    "check_grammar",
    "default_flash_attn",
    "describe_device",
    "device_memory",
    "device_report",
    "flash_attn_choice",
    "integer_range_gbnf",
    "json_schema_grammar",
    "kernel_class",
    "llama_cpp",
    "pinned_cores",
    "quantize",
]
