"""Pagoda's serving side: the engine core, executors, Serve deployments, ingress and the CLI.

Offline use:  from cluster import LLM, SamplingParams

Names load lazily so that `pagoda model fetch` and other light commands do not import torch.
"""

import importlib

_EXPORTS = {
    "LLM": "cluster.engine.llm",
    "EngineConfig": "cluster.engine.config",
    "InvalidRequestError": "cluster.engine.errors",
    "LLMEngine": "cluster.engine.engine",
    "SamplingParams": "cluster.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
