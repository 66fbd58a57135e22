"""A circuit breaker per backend deployment, in each ingress replica: while a backend fails (or
answers too slowly), requests are refused at once with 503 / UNAVAILABLE and Retry-After instead
of each waiting to fail, and the backend gets room to recover.

    closed ──(over window_s: >= min_requests ended, and failures >= failure_rate of them,
              or slow calls >= slow_call_rate of them)──> open
    open ──(open_s later)──> half-open: `probes` requests go through, the rest are refused
    half-open ──(a probe succeeds)──> closed (the window starts again)
              ──(a probe fails)────> open

What counts as a failure is the backend's fault only (a lost worker, a failed step, a deadline
passed, an unreachable replica), never the client's (bad input, a quota, a cancel).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


class CircuitBreakerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    window_s: float = Field(30.0, gt=0, description="the calls the state is decided on: those that ended this recently")
    min_requests: int = Field(5, ge=1, description="no opening on fewer calls in the window")
    failure_rate: float = Field(0.5, gt=0, le=1)
    slow_call_s: float | None = Field(None, gt=0, description="a call slower than this to its first token is slow; none: "
                                      "latency never opens the breaker")
    slow_call_rate: float = Field(0.8, gt=0, le=1)
    open_s: float = Field(5.0, gt=0, description="how long it stays open before probing")
    probes: int = Field(1, ge=1, description="calls let through at once while half-open")


class CircuitOpenError(RuntimeError):
    """The backend is failing; the call was not made (503 / UNAVAILABLE, with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses Ray (to Serve's proxy) pickled
        return type(self), (str(self), self.retry_after_s)


class CircuitBreaker:
    def __init__(self, backend: str, config: CircuitBreakerConfig, clock: Callable[[], float] = time.monotonic):
        self.backend = backend
        self.config = config
        self.clock = clock
        self.state = CLOSED
        self.opened_at = 0.0
        self.num_probing = 0
        self.calls: collections.deque = collections.deque()  # (ended at, failed, slow)

    def before_call(self) -> bool:
        """Raises CircuitOpenError when the call must not be made; returns whether it is a probe
        (its outcome decides the half-open state)."""
        if not self.config.enabled:
            return False
        if self.state == OPEN:
            wait = self.opened_at + self.config.open_s - self.clock()
            if wait > 0:
                raise CircuitOpenError(f"{self.backend} is failing (circuit breaker open); retry in {wait:.0f} s", wait)
            self.state, self.num_probing = HALF_OPEN, 0
        if self.state == HALF_OPEN:
            if self.num_probing >= self.config.probes:
                raise CircuitOpenError(f"{self.backend} is recovering (circuit breaker half-open); retry shortly", 1)
            self.num_probing += 1
            return True
        return False

    def record(self, probe: bool, failed: bool, latency_s: float | None = None) -> None:
        """The outcome of a call made after before_call(); latency_s: to its first token."""
        if not self.config.enabled:
            return
        now = self.clock()
        slow = self.config.slow_call_s is not None and latency_s is not None and latency_s > self.config.slow_call_s
        if probe and self.state == HALF_OPEN:
            self.num_probing -= 1
            if failed or slow:
                self._open(now)
            else:
                self.state = CLOSED
                self.calls.clear()
            return
        if self.state != CLOSED:
            return  # a call from before the breaker opened
        self.calls.append((now, failed, slow))
        while self.calls and self.calls[0][0] < now - self.config.window_s:
            self.calls.popleft()
        if len(self.calls) < self.config.min_requests:
            return
        failures = sum(f for _, f, _ in self.calls) / len(self.calls)
        slows = sum(s for _, _, s in self.calls) / len(self.calls)
        if failures >= self.config.failure_rate or slows >= self.config.slow_call_rate:
            self._open(now)

    def forget(self, probe: bool) -> None:
        """A call whose outcome says nothing of the backend (the client left, bad input)."""
        if probe and self.state == HALF_OPEN:
            self.num_probing -= 1

    def _open(self, now: float) -> None:
        self.state, self.opened_at = OPEN, now
        self.calls.clear()

    def describe(self) -> dict:
        return {"state": self.state, "calls_in_window": len(self.calls)}
