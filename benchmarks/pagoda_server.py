"""`pagoda serve` as a child process of a benchmark: its own session (a benchmark can signal the
whole group), ready once it prints its ready line."""

from __future__ import annotations

import subprocess
import sys


def start(*options: str) -> subprocess.Popen:
    """Starts `pagoda serve OPTIONS...` and returns once it serves."""
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *options], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("pagoda ready"):
            return proc
    raise RuntimeError("pagoda serve did not start")
