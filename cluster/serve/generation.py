"""What the ingress hands a model server (LLMServer.generate): a request already tokenized and
checked, with its tenant and deadline, and the deadline a request gets from its size."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.media import MediaItem
from cluster.engine.sampling_params import SamplingParams


class RequestDeadline(BaseModel):
    """A request's server-side deadline when its client sets none: time in proportion to its size,
    so that a short request that hangs is stopped long before a long one would be. No deadline is
    ever longer than the server's request_timeout_s."""

    model_config = ConfigDict(extra="forbid")

    base_s: float = Field(120.0, gt=0, description="for queueing and the first step, whatever the size")
    per_prompt_token_s: float = Field(0.02, ge=0)
    per_output_token_s: float = Field(0.5, ge=0, description="per token of max_tokens, for each of n candidates")

    def for_size(self, prompt_tokens: int, output_tokens: int) -> float:
        return self.base_s + prompt_tokens * self.per_prompt_token_s + output_tokens * self.per_output_token_s


@dataclass(slots=True)
class GenerationRequest:
    """What the ingress hands to the LLMServer: already tokenized and validated."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None  # the client's; None: RequestDeadline's for its size
    # Images or audio clips in the order of their placeholders in the prompt: with embeddings when
    # an EncoderServer encoded them, else the processor's output, encoded by this server's engine.
    media: list[MediaItem] = field(default_factory=list)
    # Who asks (from the API key, on the server; None on an open server), and the client's own
    # cache_salt: both salt the KV block hashes, so KV is shared only within a tenant and a salt.
    tenant: str | None = None
    cache_salt: str | None = None
    weight: float = 1.0  # the tenant's share of an engine under contention, against other tenants

    @property
    def salt(self) -> str | None:
        if self.tenant is None and self.cache_salt is None:
            return None
        return f"{self.tenant or ''}\0{self.cache_salt or ''}"

    @property
    def prompt(self) -> str:
        """The prompt as one character per token, for Serve's PrefixCacheAffinityRouter (which
        matches string prefixes): a shared string prefix is exactly a shared token prefix."""
        return "".join(map(chr, self.prompt_token_ids))
