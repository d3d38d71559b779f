"""noderuntime: distributed inference of GGUF models too large for one machine.

The small public API, each name importable from here (loaded on first use, so that
``import noderuntime`` loads no engine):

- ``ShardEngine``, ``Recipe``, ``Vocab``: a layer range of a model through the patched
  llama.cpp (:mod:`noderuntime.engine.llama`);
- ``Node``, ``NodeConfig``: a shard node serving route sessions (:mod:`noderuntime.node.core`);
- ``GenerationRequest``, ``open_route_generation``: the client end of a route
  (:mod:`noderuntime.seams.client`);
- ``Gateway``: the OpenAI-compatible gateway (:mod:`noderuntime.gateway.app`);
- ``start_local_system``, ``LocalSystem``: the whole system on this machine
  (:mod:`noderuntime.services.localsystem`);
- ``pull_model``: a known model, fetched and verified (:mod:`noderuntime.models.catalogue`).

Everything else is internal to its package; the layers are described in
``docs/architecture.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "ShardEngine": ("noderuntime.engine.llama", "ShardEngine"),
    "Recipe": ("noderuntime.engine.llama", "Recipe"),
    "Vocab": ("noderuntime.engine.llama", "Vocab"),
    "Node": ("noderuntime.node.core", "Node"),
    "NodeConfig": ("noderuntime.node.core", "NodeConfig"),
    "GenerationRequest": ("noderuntime.seams.client", "GenerationRequest"),
    "open_route_generation": ("noderuntime.seams.client", "open_route_generation"),
    "Gateway": ("noderuntime.gateway.app", "Gateway"),
    "LocalSystem": ("noderuntime.services.localsystem", "LocalSystem"),
    "start_local_system": ("noderuntime.services.localsystem", "start"),
    "pull_model": ("noderuntime.models.catalogue", "pull"),
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'noderuntime' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value
