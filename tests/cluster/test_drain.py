"""Ctrl-C drains `pagoda serve` with the engine in the ingress's process, the session's server up
too (two servers on one host, as in the suite and on a developer's machine): new requests are
refused with 503 / UNAVAILABLE, streams in flight finish (or, past the grace period, end with an
explicit error), the process exits 0 and no Ray or Pagoda process is left. SIGTERM's drain of the
two deployments behind the front door: test_serve_cli.py. The drain's bookkeeping over the GCS."""

import os
import signal
import time

import psutil
import pytest
import requests

from tests.cluster.served_processes import DRAIN_S, assert_drains, ctrl_c, descendants, pagoda_serve

pytestmark = pytest.mark.ray  # a Ray cluster or a served model: make test only

HTTP, GRPC = 18400, 19400


def assert_no_port_shared_with_another_server(children: list[psutil.Process]) -> None:
    """Every address this server listens on is its own. Serve's replicas pick their ports from one
    range per cluster (direct ingress: 40000+ for gRPC), so a second cluster on the host tries the
    first's; a bind that shares the port instead of failing lets the kernel hand this server's
    connections to the other (cluster/serve/grpc_bind.py)."""
    pids = {p.pid for p in children}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    ours = {c.laddr for c in listening if c.pid in pids}
    assert ours, "the server listens nowhere?"
    shared = [(c.laddr, psutil.Process(c.pid).name()) for c in listening if c.pid not in pids and c.laddr in ours]
    assert not shared, shared


def test_ctrl_c_finishes_short_streams_ends_long_ones_with_an_error_refuses_new_ones_and_leaves_nothing(
        model_dir, server):
    """The engine ends the long streams at the deadline while the replica still lives to send
    their error events."""
    proc = pagoda_serve(model_dir, HTTP, GRPC, "--drain-timeout", str(DRAIN_S), "--engine-in-ingress")
    try:
        assert_no_port_shared_with_another_server(descendants(proc.pid))
        assert_drains(proc, HTTP, GRPC, stop=ctrl_c)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_the_drain_counts_replicas_that_report_and_forgets_those_gone_quiet():
    from cluster.serve.drain import GONE_AFTER_S, Report, count_in_flight

    now = 1_000.0
    before_the_drain = [Report(2, now, False), Report(0, now, False)]
    assert count_in_flight(before_the_drain, now) == (2, 2)  # neither has heard of the drain yet
    a_heard = [Report(1, now + 1, True), Report(0, now, False)]
    assert count_in_flight(a_heard, now + 1) == (1, 1)
    b_gone_quiet = [Report(1, now + GONE_AFTER_S, True), Report(0, now, False)]  # Serve replaced b
    assert count_in_flight(b_gone_quiet, now + GONE_AFTER_S) == (1, 0)


def test_replicas_report_to_the_gcs_and_a_new_server_forgets_an_earlier_drain(server):
    from cluster.serve import drain

    def live_reports():
        return drain.live_reports(drain.read_reports(), time.time())

    deadline = time.monotonic() + 10
    while len(live_reports()) < 2 and time.monotonic() < deadline:  # the Ingress and the LLMServer
        time.sleep(0.2)
    assert len(live_reports()) >= 2 and drain.read_deadline() is None
    assert drain.count_in_flight(drain.read_reports(), time.time()) == (0, len(live_reports()))

    # An earlier server's drain left on the cluster (far off: nothing here fails at it).
    from ray.experimental import internal_kv
    internal_kv._internal_kv_put(drain.DEADLINE_KEY, str(time.time() + 3600), namespace=drain.KV_NAMESPACE)
    drain.reset()
    assert drain.read_deadline() is None
    deadline = time.monotonic() + 10
    while any(r.knew_deadline for r in live_reports()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(r.knew_deadline for r in live_reports())  # as before, within a report or two
    assert requests.get(f"{server['http']}/health", timeout=30).status_code == 200
