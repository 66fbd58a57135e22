"""Executor: what the engine needs from whatever holds the weights and the KV cache tensors.

Two implementations: `model.runner.ModelRunner` (one process, TP=1) and
`cluster.executor.tp_group.TPGroup` (a tensor-parallel group of Ray actors). The engine is handed
one (`cluster.executor.factory.build_executor` picks it from the config) and never asks which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np

    from model.config import ModelConfig
    from model.runner import SequenceInput, StepOutput


class Executor(Protocol):
    config: ModelConfig  # the model's architecture, as loaded
    num_blocks: int  # KV blocks each rank holds (the same on every rank)
    max_model_len: int
    bytes_per_block: int  # device bytes one block of KV takes on the largest rank

    def execute(self, seqs: list[SequenceInput]) -> StepOutput:
        """One step: install restored/imported KV, run the model, sample."""

    def read_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """A copy of each block's KV with every KV head: a page payload, whatever the TP degree."""

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Page payloads (every KV head) into blocks; each rank keeps its own heads."""

    def describe(self) -> list[dict]:
        """One dict per rank: rank, pid, kv_heads, num_blocks (and node_id, collective for a group)."""

    def shutdown(self) -> None:
        """Release the workers (a group's other ranks would otherwise wait in a collective)."""
