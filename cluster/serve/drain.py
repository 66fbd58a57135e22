"""Graceful drain: stop admitting, let in-flight requests finish within a grace period, then end
the rest with an explicit error, never a silent cut.

    pagoda serve gets SIGTERM/SIGINT ─> DrainSignal.start(timeout) ─┐   (a named actor)
                                                                     ▼
    Ingress / LLMServer replicas: a DrainWatcher thread reports the replica's in-flight count
    every second (every 0.25 s once draining) and learns the deadline: from then on new requests
    get 503 / UNAVAILABLE with Retry-After; at the deadline the LLMServer fails what still runs
    (ServerDrainingError).
                                                                     │
    the CLI waits until every replica reports nothing in flight (or the deadline), then stops
    Serve (each LLMServer moves its prefix cache down to the tiers) and the Ray cluster.

Serve stopping a replica on its own (scale-down, redeploy) is the same story told by Serve:
it routes nothing more to the replica and waits `graceful_shutdown_timeout_s` (the drain
timeout) for its requests; then LLMServer.shutdown fails what is left with ServerDrainingError.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger("pagoda.drain")

ACTOR_NAME, ACTOR_NAMESPACE = "pagoda-drain", "pagoda"
REPORT_INTERVAL_S = 0.25  # while draining: the CLI stops as soon as the last request ends
IDLE_REPORT_INTERVAL_S = 1.0  # otherwise: the drain is noticed within a second, at a quarter of the calls
# A replica silent this long is gone (Serve replaced or stopped it): the drain stops counting it.
GONE_AFTER_S = 5.0


class ServerDrainingError(RuntimeError):
    """The server is shutting down (503 / UNAVAILABLE with Retry-After): retry on another."""


class DrainSignal:
    """The cluster-wide drain state (a named Ray actor, started by `pagoda serve`)."""

    def __init__(self):
        self.deadline: float | None = None  # wall-clock time; None: not draining
        self.reports: dict[str, tuple[int, float]] = {}  # replica -> (in flight, when reported)
        self.reported_since_start: set[str] = set()

    def start(self, timeout_s: float) -> None:
        self.deadline = time.time() + timeout_s
        self.reported_since_start.clear()

    def report(self, replica: str, num_in_flight: int) -> float | None:
        self.reports[replica] = (num_in_flight, time.monotonic())
        if self.deadline is not None:
            self.reported_since_start.add(replica)
        return self.deadline

    def num_in_flight(self) -> tuple[int, int]:
        """(requests in flight, replicas that have not heard of the drain yet), over the
        replicas that reported lately."""
        now = time.monotonic()
        live = {r: count for r, (count, at) in self.reports.items() if now - at < GONE_AFTER_S}
        return sum(live.values()), len(set(live) - self.reported_since_start)


def replica_name(fallback: object) -> str:
    """This Serve replica's id, or a name of the process and object outside Serve."""
    import os

    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a Serve replica (tests build servers directly)
        return f"{os.getpid()}-{id(fallback)}"


def start_drain_signal():
    """The DrainSignal actor of this cluster (started when missing). The caller owns it: it
    lives as long as the returned handle."""
    import ray

    return ray.remote(DrainSignal).options(name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, num_cpus=0,
                                           get_if_exists=True).remote()


def drain(signal, timeout_s: float, log=logger.info) -> bool:
    """Start the drain (`signal`: the DrainSignal actor) and wait until nothing is in flight or
    the deadline (plus a moment for the replicas to end what was left) has passed. Returns
    whether everything finished in time."""
    import ray

    ray.get(signal.start.remote(timeout_s))
    deadline = time.monotonic() + timeout_s
    log(f"draining: new requests are refused, {timeout_s:.0f} s for the ones in flight")
    while time.monotonic() < deadline + IDLE_REPORT_INTERVAL_S + REPORT_INTERVAL_S + 1:
        num_in_flight, unaware = ray.get(signal.num_in_flight.remote())
        if num_in_flight == 0 and unaware == 0:
            return time.monotonic() <= deadline
        time.sleep(REPORT_INTERVAL_S)
    return False


class DrainWatcher:
    """A replica's side: a thread that reports `num_in_flight()` and learns the deadline. Where
    no DrainSignal exists (Serve run by other tools, KubeRay) it looks again now and then."""

    def __init__(self, replica: str, num_in_flight: Callable[[], int], on_deadline: Callable[[], None] | None = None):
        self.replica = replica
        self._num_in_flight = num_in_flight
        self._on_deadline = on_deadline
        self.deadline: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagoda-drain-watch", daemon=True)
        self._thread.start()

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def check_admission(self) -> None:
        if self.draining:
            raise ServerDrainingError("the server is shutting down; retry on another")

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        import ray

        if not ray.is_initialized():  # a server built outside a Ray cluster (tests): nothing to watch
            return
        signal, fired = None, False
        while not self._stopped.is_set():
            if signal is None:
                try:
                    signal = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
                except ValueError:  # no `pagoda serve` here: nothing to watch for now
                    self._stopped.wait(5.0)
                    continue
            try:
                self.deadline = ray.get(signal.report.remote(self.replica, self._num_in_flight()), timeout=5)
            except Exception:  # noqa: BLE001 - the actor went away (its driver stopped): look again
                signal = None
                continue
            if self.deadline is not None and not fired and time.time() >= self.deadline and self._on_deadline:
                fired = True
                self._on_deadline()
            self._stopped.wait(REPORT_INTERVAL_S if self.draining else IDLE_REPORT_INTERVAL_S)
