"""The guard HAProxy runs under (cluster/serve/haproxy_guard.py): it runs the real HAProxy, and
HAProxy dies when the process that started it dies (what a kill -9 of `pagoda serve` needs; the
kv-restart serving test checks it end to end)."""

import os
import signal
import subprocess
import sys
import time

import psutil

from cluster.ports import free_port
from cluster.serve.haproxy_guard import guarded_haproxy


def test_the_guard_runs_the_real_haproxy(tmp_path):
    guard = guarded_haproxy(tmp_path)
    assert guard is not None and os.access(guard, os.X_OK)
    assert guarded_haproxy(tmp_path) == guard  # written once, found again
    version = subprocess.run([guard, "-v"], capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and "HAProxy version" in version.stdout


def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text("defaults\n    mode http\n    timeout connect 1s\n    timeout client 1s\n    timeout server 1s\n"
                      f"frontend f\n    bind 127.0.0.1:{free_port()}\n    http-request return status 200\n")
    # A parent that starts HAProxy through the guard, prints its pid, and then is SIGKILLed.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([{guarded_haproxy(tmp_path)!r}, '-db', '-f', {str(config)!r}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    haproxy = psutil.Process(int(parent.stdout.readline()))
    try:
        deadline = time.monotonic() + 30
        while "haproxy" not in haproxy.name() or not haproxy.net_connections():  # exec'd, and listening
            assert time.monotonic() < deadline and haproxy.status() != psutil.STATUS_ZOMBIE
            time.sleep(0.1)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        haproxy.wait(timeout=10)  # psutil.TimeoutExpired if it outlived its parent
    finally:
        if haproxy.is_running():
            haproxy.kill()


def test_an_unwritable_directory_leaves_haproxy_unguarded(tmp_path):
    (tmp_path / "a-file").write_text("")  # no directory can be made under a file, even by root
    assert guarded_haproxy(tmp_path / "a-file" / "bin") is None
