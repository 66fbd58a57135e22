"""Graceful drain: stop admitting, let in-flight requests finish within a grace period, then end
the rest with an explicit error, never a silent cut.

    pagoda serve gets SIGTERM/SIGINT ─> the drain's deadline, written to the GCS's key-value store
                                                                     │   (namespace "pagoda-drain")
    Ingress / LLMServer replicas: a DrainWatcher thread reads the deadline and writes the replica's
    in-flight count every second (every 0.25 s once draining): from then on new requests get 503 /
    UNAVAILABLE with Retry-After; at the deadline the LLMServer fails what still runs
    (ServerDrainingError).
                                                                     ▼
    the CLI waits until every replica reports nothing in flight (or the deadline), then stops
    Serve (each LLMServer moves its prefix cache down to the tiers) and the Ray cluster.

The state lives in the GCS rather than in an actor of its own: every Ray worker process wakes
~150 times a second even when idle, and on a node the engine shares with the cluster each wakeup
slows its step (docs/benchmarks-log.md, the idle cluster's cost).

Serve stopping a replica on its own (scale-down, redeploy) is the same story told by Serve:
it routes nothing more to the replica and waits `graceful_shutdown_timeout_s` (the drain
timeout) for its requests; then LLMServer.shutdown fails what is left with ServerDrainingError.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

logger = logging.getLogger("pagoda.drain")

KV_NAMESPACE = "pagoda-drain"
DEADLINE_KEY = "deadline"  # wall-clock time; absent: not draining
REPORT_PREFIX = "report/"  # + the replica's name: its Report
REPORT_INTERVAL_S = 0.25  # while draining: the CLI stops as soon as the last request ends
IDLE_REPORT_INTERVAL_S = 1.0  # otherwise: the drain is noticed within a second
# A replica silent this long is gone (Serve replaced or stopped it): the drain stops counting it.
GONE_AFTER_S = 5.0


class ServerDrainingError(RuntimeError):
    """The server is shutting down (503 / UNAVAILABLE with Retry-After): retry on another."""


@dataclass(frozen=True)
class Report:
    """What a replica last said: its requests in flight, when (wall clock), and whether it knew
    of the drain then (from then on it admits nothing, so its count only falls)."""

    in_flight: int
    at: float
    knew_deadline: bool


def live_reports(reports: Iterable[Report], now: float) -> list[Report]:
    """The reports of replicas that reported lately (the others are gone)."""
    return [report for report in reports if now - report.at < GONE_AFTER_S]


def count_in_flight(reports: Iterable[Report], now: float) -> tuple[int, int]:
    """(requests in flight, replicas that have not heard of the drain yet), over the replicas
    that reported lately."""
    live = live_reports(reports, now)
    return sum(report.in_flight for report in live), sum(not report.knew_deadline for report in live)


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def read_deadline() -> float | None:
    value = _kv()._internal_kv_get(DEADLINE_KEY, namespace=KV_NAMESPACE)
    return None if value is None else float(value)


def write_report(replica: str, report: Report) -> None:
    _kv()._internal_kv_put(REPORT_PREFIX + replica, json.dumps(asdict(report)), namespace=KV_NAMESPACE)


def read_reports() -> list[Report]:
    kv, reports = _kv(), []
    for key in kv._internal_kv_list(REPORT_PREFIX, namespace=KV_NAMESPACE):
        value = kv._internal_kv_get(key, namespace=KV_NAMESPACE)
        if value is not None:  # the replica stopped between the two calls
            reports.append(Report(**json.loads(value)))
    return reports


def reset() -> None:
    """Forget a drain of an earlier server on this cluster (its deadline would refuse everything)."""
    kv = _kv()
    for key in [DEADLINE_KEY.encode(), *kv._internal_kv_list(REPORT_PREFIX, namespace=KV_NAMESPACE)]:
        kv._internal_kv_del(key, namespace=KV_NAMESPACE)


def replica_name(fallback: object) -> str:
    """This Serve replica's id, or a name of the process and object outside Serve."""
    import os

    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a Serve replica (tests build servers directly)
        return f"{os.getpid()}-{id(fallback)}"


def drain(timeout_s: float, log=logger.info) -> bool:
    """Start the drain and wait until nothing is in flight or the deadline (plus a moment for
    the replicas to end what was left) has passed. Returns whether everything finished in time."""
    _kv()._internal_kv_put(DEADLINE_KEY, str(time.time() + timeout_s), namespace=KV_NAMESPACE)
    deadline = time.monotonic() + timeout_s
    log(f"draining: new requests are refused, {timeout_s:.0f} s for the ones in flight")
    while time.monotonic() < deadline + IDLE_REPORT_INTERVAL_S + REPORT_INTERVAL_S + 1:
        num_in_flight, unaware = count_in_flight(read_reports(), time.time())
        if num_in_flight == 0 and unaware == 0:
            return time.monotonic() <= deadline
        time.sleep(REPORT_INTERVAL_S)
    return False


class DrainWatcher:
    """A replica's side: a thread that learns the deadline and reports `num_in_flight()`."""

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
        fired = failing = False
        while not self._stopped.is_set():
            try:
                # The deadline first: once it is known nothing more is admitted, so the count
                # reported after it only falls.
                self.deadline = read_deadline()
                write_report(self.replica, Report(self._num_in_flight(), time.time(), self.deadline is not None))
                failing = False
            except Exception:  # noqa: BLE001 - the GCS unreachable for a moment: look again
                if not failing:
                    logger.warning("cannot reach the GCS for the drain's state; retrying", exc_info=True)
                failing = True
            if self.deadline is not None and not fired and time.time() >= self.deadline and self._on_deadline:
                fired = True
                self._on_deadline()
            self._stopped.wait(REPORT_INTERVAL_S if self.draining else IDLE_REPORT_INTERVAL_S)
        try:
            _kv()._internal_kv_del(REPORT_PREFIX + self.replica, namespace=KV_NAMESPACE)
        except Exception:  # noqa: BLE001 - the cluster going down: the report ages out
            pass
