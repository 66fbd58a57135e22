"""The circuit breaker on its own, on a clock of the test's: it opens on failures or slow calls
over its window, refuses while open, probes when half-open, closes after a good probe."""

import pytest

from cluster.serve.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker, CircuitBreakerConfig, CircuitOpenError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def breaker(**options) -> tuple[CircuitBreaker, Clock]:
    clock = Clock()
    config = CircuitBreakerConfig(window_s=10, min_requests=4, failure_rate=0.5, open_s=5, **options)
    return CircuitBreaker("the model server", config, clock), clock


def call(b: CircuitBreaker, failed: bool, latency_s: float = 0.1) -> None:
    b.record(b.before_call(), failed, latency_s)


def test_it_opens_on_failures_probes_and_closes_after_recovery():
    b, clock = breaker()
    for failed in (False, True, False):  # 1 of 3 failed; and under min_requests anyway
        call(b, failed)
    assert b.state == CLOSED
    call(b, True)  # 2 of 4: half failed
    assert b.state == OPEN
    clock.now += 4
    with pytest.raises(CircuitOpenError, match="circuit breaker open") as refused:
        b.before_call()
    assert refused.value.retry_after_s == pytest.approx(1)
    clock.now += 1.5
    probe = b.before_call()
    assert probe and b.state == HALF_OPEN
    with pytest.raises(CircuitOpenError, match="half-open"):  # one probe at a time
        b.before_call()
    b.record(probe, failed=True)  # still failing: open again, for another open_s
    assert b.state == OPEN
    clock.now += 5.5
    b.record(b.before_call(), failed=False)
    assert b.state == CLOSED and b.describe() == {"state": "closed", "calls_in_window": 0}
    call(b, True)  # the window started again: one failure does not reopen it
    assert b.state == CLOSED


def test_failures_older_than_the_window_do_not_count():
    b, clock = breaker()
    call(b, True)
    call(b, True)
    clock.now += 11
    for _ in range(3):
        call(b, False)
    call(b, True)
    assert b.state == CLOSED  # 1 of the 4 in the window


def test_slow_calls_open_it_when_a_threshold_is_set():
    b, _ = breaker(slow_call_s=2.0, slow_call_rate=0.75)
    for latency in (3.0, 3.0, 0.5):
        call(b, False, latency)
    assert b.state == CLOSED
    call(b, False, 2.5)
    assert b.state == OPEN


def test_a_forgotten_probe_frees_its_place_and_disabled_never_opens():
    b, clock = breaker()
    for _ in range(4):
        call(b, True)
    clock.now += 6
    b.forget(b.before_call())  # the client left: says nothing of the backend
    assert b.before_call() and b.state == HALF_OPEN
    off, _ = breaker(enabled=False)
    for _ in range(10):
        call(off, True)
    assert off.state == CLOSED


def test_errors_with_a_retry_time_survive_pickling():
    """They cross Ray to Serve's proxy pickled: one that did not unpickle reached the client as
    INTERNAL instead of UNAVAILABLE."""
    import pickle

    from cluster.serve.errors import QuotaExceededError

    for error in (CircuitOpenError("open", 3.0), QuotaExceededError("spent", 42.0)):
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.retry_after_s) == (type(error), str(error), error.retry_after_s)
