"""Engines: the llama.cpp engine (the ``llama`` package, whose ``binding`` alone imports ``llama_cpp``), the
Transformers one (``torch_backend``), the thread every engine call runs on, memory plans,
and the engine interface with the plain data it exchanges with its batcher (``base``)."""
