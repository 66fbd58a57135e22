"""A free TCP port on this host, for a server that binds it a moment later.

A port the kernel picks for bind(0) comes from its ephemeral range, where every other bind(0) and
every outgoing connection on the host draws too: between the check here and the server's own
bind, one of Ray's listeners took such a port once (HAProxy then exited with "Address already in
use"). The ports here come from between Ray's worker ports (10002-19999 by default) and the
ephemeral range, where nothing is handed out without asking for the number.
"""

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 19999
_handed_out: set[int] = set()  # by this process: two callers never get the same port


def ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start
        return 49152


def free_port(host: str = "127.0.0.1") -> int:
    low, high = RAY_WORKER_PORTS_END + 1, ephemeral_range_start() - 1
    for _ in range(200 if low <= high else 0):
        port = random.randint(low, high)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range on this host: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]
