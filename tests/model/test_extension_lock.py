"""model/extension_lock.py: a lock file left by a killed extension builder does not wedge the next
load, and a live builder is still waited for. Real processes and files; nothing is compiled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from model.extension_lock import build_directory, sole_loader

BUILDER = """
import time
from model.extension_lock import build_directory, sole_loader
with sole_loader("probe"):
    (build_directory("probe") / "lock").touch()  # torch's lock, as during a build
    print("building", flush=True)
    time.sleep(600)
"""


def test_a_killed_builders_lock_goes_and_a_live_builder_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builder = subprocess.Popen([sys.executable, "-c", BUILDER], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert builder.stdout.readline() == "building\n"
        lock = build_directory("probe") / "lock"
        assert lock.exists()
        seen_inside = []
        loader = threading.Thread(target=lambda: seen_inside.append(enter_and_look(lock)))
        loader.start()
        loader.join(2)
        assert loader.is_alive() and not seen_inside  # the builder lives: its build is waited for
        builder.send_signal(signal.SIGKILL)  # killed mid-build: torch's lock file stays behind
        loader.join(30)
        assert seen_inside == [False]  # the next loader got in, and the stale lock was gone
    finally:
        builder.kill()


def enter_and_look(lock) -> bool:
    with sole_loader("probe"):
        return lock.exists()
