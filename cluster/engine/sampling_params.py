"""SamplingParams: what a caller may ask of one generation, checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.engine.errors import InvalidRequestError
from cluster.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: until the model's context is full
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    seed: int | None = None  # candidate i of n draws from seed + i
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # how many top alternatives per token (0: only the sampled one's)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None  # JSON (under a schema) only

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        _check(
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature", f"must be a finite number >= 0, got {self.temperature!r}",
        )
        _check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            "top_p", f"must be in (0, 1], got {self.top_p!r}",
        )
        _check(
            isinstance(self.top_k, int) and self.top_k >= -1,
            "top_k", f"must be -1, 0 (no limit) or a positive integer, got {self.top_k!r}",
        )
        if self.top_k == -1:
            self.top_k = 0
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed", f"must be a non-negative integer, got {self.seed!r}",
        )
        _check(
            all(isinstance(s, str) and s and is_valid_unicode(s) for s in self.stop),
            "stop", "must be non-empty strings of valid Unicode",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "must be non-negative integers",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )


def is_valid_unicode(text: str) -> bool:
    """False for text that no UTF-8 can carry (a lone surrogate such as the JSON escape \\ud800)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)
