"""Pagoda's CPU kernels (model/csrc/cpu_ops.cpp), built on first use by torch's extension tooling.

`make install` builds them once (`python -m model.cpu_ops`); a process that finds them built loads
them in well under a second. The build is keyed by the source and by this CPU's flags, so a cache
shared between hosts never hands one host another's `-march=native` code. Where the build cannot
run (no compiler, an unsupported host), `cpu_ops()` returns None, says why once, and the model
runs torch's own paths: dequantized fp32 weights and gathered-block attention.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from functools import cache
from pathlib import Path

from model.extension_lock import build_directory, sole_loader

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def build_key() -> str:
    sources = b"".join(path.read_bytes() for path in sorted(SOURCE.parent.glob("*.[ch]*")))  # the .cpp and its headers
    digest = hashlib.sha256(sources + _cpu_flags().encode())
    return digest.hexdigest()[:12]


@cache
def cpu_ops():
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    if os.environ.get("PAGODA_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        name = f"pagoda_cpu_ops_{build_key()}"
        with sole_loader(name):
            return load(name=name, sources=[str(kept_sources(name))], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                        extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: run torch's paths
        logger.warning("Pagoda's CPU kernels are unavailable (%s); using torch's paths", exc)
        return None


def kept_sources(name: str) -> Path:
    """The .cpp in a copy of model/csrc kept in the build's own directory (the name holds the
    sources' digest, so the copy never goes stale): torch's builder compiles again when a source's
    path or time changes, which every fresh checkout would do (~35 s on 2 cores)."""
    kept = build_directory(name) / "src"
    if not (kept / SOURCE.name).exists():
        scratch = kept.with_name(f"src.{os.getpid()}.tmp")
        shutil.copytree(SOURCE.parent, scratch, dirs_exist_ok=True)
        os.replace(scratch, kept)  # whole or absent
    return kept / SOURCE.name


if __name__ == "__main__":
    ops = cpu_ops()
    print("Pagoda CPU kernels:", "built" if ops is not None else "unavailable")
    sys.exit(0 if ops is not None else 1)
