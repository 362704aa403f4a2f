"""Model backends: the seam between a worker and whatever generates tokens.

The contract every backend keeps is in :mod:`workers.backends.base` (its
protocols and :class:`Usage` are handed on from here); this package's face
picks the implementation a model's config names.
"""

from __future__ import annotations

from tidegate.config import ModelConfig, WorkerConfig
from workers.backends.base import Backend, BackendStream, PushStream, Sink, Usage

__all__ = ["Backend", "BackendStream", "PushStream", "Sink", "Usage", "create_backend"]


def create_backend(model: ModelConfig, worker: WorkerConfig) -> Backend:
    """The backend implementation a model's config names."""
    if model.backend == "simulator":
        from workers.backends.simulator import SimulatorBackend

        return SimulatorBackend(model, worker)
    if model.backend == "openai":
        from workers.backends.openai import OpenAIBackend

        return OpenAIBackend(model, worker)
    raise ValueError(f"unknown backend kind {model.backend!r}")
