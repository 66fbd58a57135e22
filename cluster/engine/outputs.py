"""What the engine hands back each step: per-candidate deltas, and the assembled final results."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: the engine's bookkeeping imports nothing from model/ (no torch)
    from model.kv_transfer import KVPart
    from model.sampler import TokenLogprobs


@dataclass(slots=True)
class PrefillResult:
    """What a prefill engine hands a decode engine: the first token and the prompt's KV."""

    token_id: int
    logprobs: TokenLogprobs | None
    kv_parts: list[KVPart]
    generator_state: object | None  # a seeded request's generator after the first sample
    num_cached_tokens: int = 0  # of the prompt, found in the prefill engine's prefix cache

    @property
    def kv_bytes(self) -> int:
        return sum(p.nbytes for p in self.kv_parts)


@dataclass(slots=True)
class RequestDelta:
    """New output of one candidate since the last step. `finish_reason` is set on its last delta."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    prefilled: PrefillResult | None = None  # set on the last delta of a request that exported KV
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def can_absorb(self, later: RequestDelta) -> bool:
        return (later.request_id == self.request_id and later.index == self.index and not self.finished
                and self.prefilled is None and self.error is None and later.error is None)

    def absorb(self, later: RequestDelta) -> None:
        """Append a later delta of the same candidate (several steps' tokens in one message)."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        self.new_logprobs = self.new_logprobs + later.new_logprobs
        self.finish_reason, self.prefilled = later.finish_reason, later.prefilled


def coalesce(items: list) -> list:
    """Runs of consecutive deltas of one candidate merged into one delta each; anything else (an
    error) kept in its place. Every token stays, in order."""
    merged: list = []
    for item in items:
        previous = merged[-1] if merged else None
        if isinstance(item, RequestDelta) and isinstance(previous, RequestDelta) and previous.can_absorb(item):
            previous.absorb(item)
        else:
            merged.append(item)
    return merged


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: RequestDelta) -> None:
        self.text += delta.new_text
        self.token_ids += delta.new_token_ids
        self.logprobs += delta.new_logprobs
        self.finish_reason = delta.finish_reason


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
