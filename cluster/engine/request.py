"""Request: the one object that owns a generation's state. Everything else reads it.

Tokens are one list, prompt then output; `num_computed_tokens` says how many of them have their KV
in the cache. Scheduling only lets num_computed_tokens catch up with len(token_ids): a prompt is
prefilled in chunks that way, a decode is a chunk of one, and a preempted request simply starts
again from 0 (its full blocks are usually still in the prefix cache).

KV that moves (restored pages, swap copies, disaggregation imports and exports) is not here: the
engine's KV connector holds it, keyed by request id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.media import MediaItem, MediaSegment
from cluster.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"  # this request failed in the engine; the others went on


@dataclass(eq=False)
class Request:
    request_id: str  # unique inside the engine: "<parent>" or "<parent>#<index>" when n > 1
    parent_id: str  # the id the caller knows
    index: int  # which of the n candidates
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    salt: str | None = None
    # who asks (None: an open server) and the tenant's weight: shares of the engine under contention
    tenant: str | None = None
    weight: float = 1.0
    grammar: object | None = None  # structured output: its xgrammar GrammarMatcher, fed every token
    media: list[MediaItem] = field(default_factory=list)  # encoded: their embeddings fill the placeholders
    media_segments: list[MediaSegment] = field(default_factory=list)  # which positions take which rows
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # prompt tokens whose KV came from the prefix cache (device memory or a lower tier) when the
    # request was first admitted, or from the prefill engine's count (disaggregated)
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output(self, token_id: int) -> str:
        """Add a sampled token; returns the text it completes (may be empty) and sets finish_reason
        when this token ends the generation."""
        self.token_ids.append(token_id)
        params = self.params
        self.detokenizer.add(token_id)
        if self.grammar is not None:
            self.grammar.accept_token(token_id)
        if self.detokenizer.stopped or (self.grammar is not None and self.grammar.is_terminated()):
            self.finish_reason = FinishReason.STOP
        elif token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            self.finish_reason = FinishReason.STOP
        elif (params.max_tokens is not None and self.num_output_tokens >= params.max_tokens) \
                or self.num_tokens >= self.max_model_len:
            self.finish_reason = FinishReason.LENGTH
        return self.detokenizer.take_new_text(final=self.finish_reason is not None)
