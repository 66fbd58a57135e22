"""What the engine hands back each step: per-candidate deltas, and the assembled final results."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.sampler import TokenLogprobs


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
