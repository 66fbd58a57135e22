"""A torch C++ extension build that a killed builder cannot wedge.

torch's JIT loader (torch.utils.cpp_extension.load) takes a lock file, `lock`, in the extension's
build directory for every load, built or not, and a process that finds one waits until it goes.
A builder killed mid-build (a test's timeout, a Ray worker killed with its cluster, the OOM
killer) leaves it behind in ~/.cache/torch_extensions, and from then on every load of that
extension on the machine waits forever: seen on this host as two TP ranks stuck for 500 s in
deepspeed's shared-memory op at `FileBaton.wait`.

Pagoda's processes load an extension while holding an flock on a file beside it. The kernel
drops an flock when its holder dies, so whoever holds it knows no Pagoda process is building:
a `lock` found then is stale and goes.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path

FLOCK_NAME = "pagoda.flock"


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextmanager
def sole_loader(name: str):
    """While inside, this process alone among Pagoda's loads extension `name`; a lock file left
    by a dead builder is gone."""
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the flock
