"""torch C++ extensions (Pagoda's CPU kernels, deepspeed's shared-memory op): built once per host,
loaded in well under a second after that, and never wedged by a killed builder.

Built once: torch's JIT loader (torch.utils.cpp_extension.load) runs ninja on every load, and ninja
compiles again whenever a source or any torch header is newer than its object, which every fresh
virtualenv makes them (~35 s of Pagoda's kernels and 50-80 s of deepspeed's op on 2 cores, each
fresh clone). `load_extension` imports the library it built before when the build's key (sources,
torch, CPU) is the same, and runs the builder only when it is not.

Never wedged: torch's loader takes a lock file, `lock`, in the extension's build directory for
every load, built or not, and a process that finds one waits until it goes. A builder killed
mid-build (a test's timeout, a Ray worker killed with its cluster, the OOM killer) leaves it
behind in ~/.cache/torch_extensions, and from then on every load of that extension on the machine
waits forever: seen on this host as two TP ranks stuck for 500 s in deepspeed's shared-memory op
at `FileBaton.wait`. Pagoda's processes load an extension while holding an flock on a file beside
it. The kernel drops an flock when its holder dies, so whoever holds it knows no Pagoda process
is building: a `lock` found then is stale and goes.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Callable

FLOCK_NAME = "pagoda.flock"


def build_directory(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextmanager
def sole_loader(name: str):
    """While inside, this process alone among Pagoda's loads extension `name`; a lock file left
    by a dead builder is gone. Yields the extension's build directory."""
    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / FLOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield directory
    finally:
        os.close(fd)  # releases the flock


KEY_NAME = "pagoda.key"


def load_extension(name: str, key: str, build: Callable[[], ModuleType]) -> ModuleType:
    """Extension `name`: the library built before under the same `key`, imported from its build
    directory, or else what `build()` (torch's loader) returns, its key then recorded beside it.
    `key` names everything the library depends on besides its name (sources, flags, torch)."""
    with sole_loader(name) as directory:
        library, recorded = directory / f"{name}.so", directory / KEY_NAME
        if library.exists() and recorded.exists() and recorded.read_text() == key:
            spec = importlib.util.spec_from_file_location(name, library)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        recorded.unlink(missing_ok=True)  # a build that fails halfway leaves no key behind
        module = build()
        recorded.write_text(key)
        return module


def host_key() -> str:
    """What every build here depends on: torch's version (its headers and ABI) and this CPU's
    flags (`-march=native`), so a cache shared between hosts never hands one host another's code."""
    import torch

    return f"torch {torch.__version__}; {cpu_flags()}"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()
