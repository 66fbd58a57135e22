"""Pagoda's CPU kernels (model/csrc/cpu_ops.cpp), built on first use by torch's extension tooling.

`make install` builds them once per host (`python -m model.cpu_ops`); a process that finds them built
loads them in well under a second (model/cpp_extensions.py). The build is named by the sources'
digest and keyed by torch and this CPU's flags, so a cache shared between hosts never hands one
host another's `-march=native` code. Where the build cannot run (no compiler, an unsupported host),
`cpu_ops()` returns None, says why once, and the model runs torch's own paths: dequantized fp32
weights and gathered-block attention.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import cache
from pathlib import Path

from model.cpp_extensions import host_key, load_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


def build_key() -> str:
    sources = b"".join(path.read_bytes() for path in sorted(SOURCE.parent.glob("*.[ch]*")))  # the .cpp and its headers
    return hashlib.sha256(sources).hexdigest()[:12]


@cache
def cpu_ops():
    """The compiled module, or None where it cannot be built (the reason is logged once)."""
    if os.environ.get("PAGODA_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        name, flags = f"pagoda_cpu_ops_{build_key()}", ["-O3", "-march=native", "-fopenmp"]
        return load_extension(name, f"{host_key()}; {flags}", lambda: load(
            name=name, sources=[str(SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False))
    except Exception as exc:  # noqa: BLE001 - any build failure means: run torch's paths
        logger.warning("Pagoda's CPU kernels are unavailable (%s); using torch's paths", exc)
        return None


if __name__ == "__main__":
    ops = cpu_ops()
    print("Pagoda CPU kernels:", "built" if ops is not None else "unavailable")
    sys.exit(0 if ops is not None else 1)
