"""Executor: what the engine needs from whatever holds the weights and the KV cache tensors, and
the contract of one step: the engine hands it SequenceInputs, it returns a StepOutput.

Two implementations: `model.runner.ModelRunner` (one process, TP=1) and
`cluster.executor.tp_group.TPGroup` (a tensor-parallel group of Ray actors). The engine is handed
one (`cluster.executor.factory.build_engine` picks it from the config) and never asks which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import numpy as np
    import torch

    from model.config import ModelConfig
    from model.kv_transfer import KVImport, KVPart
    from model.sampler import SamplingRow, TokenLogprobs


@dataclass(slots=True)
class SequenceInput:
    new_token_ids: list[int]  # tokens whose KV this step computes
    num_computed_tokens: int  # tokens already in the cache before them
    block_ids: list[int]
    sampling: SamplingRow | None  # None: a prefill chunk that is not the prompt's last
    export_kv_from: int | None = None  # export the KV of positions [this, end of the step)
    import_kv: KVImport | None = None  # KV computed elsewhere, written in before the step
    restore_blocks: list[tuple[int, bytes]] | None = None  # (block id, page payload) from a lower tier
    # media embeddings that replace the embeddings of some new tokens: (offset among new_token_ids, rows)
    embeds: list[tuple[int, torch.Tensor]] | None = None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class StepOutput:
    sampled: list[SampledToken | None]  # per input sequence; None mid-prefill (or failed)
    kv_parts: list[list[KVPart]]  # per input sequence: what it exported (disaggregated prefill)
    failed: dict[int, str] = field(default_factory=dict)  # input index -> why it got no token


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
