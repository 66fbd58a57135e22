"""The llama.cpp peer: `llama-server` built from the llama-cpp-python sdist's vendored llama.cpp,
serving the default model's own Q4_1 GGUF over its OpenAI-compatible API.

Why llama-server and not `python -m llama_cpp.server`: llama-cpp-python's server runs one request
at a time; llama-server has parallel slots with continuous batching, the fair peer for a batching
server. Both come from the same sdist (the only llama.cpp on PyPI).

    python -m benchmarks.llama_cpp_server build          # once: ~12 min on 2 cores
    python -m benchmarks.llama_cpp_server serve --parallel 16 --port 18500
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import requests

from cluster.model_fetch import fetch_default_gguf, pagoda_home

SDIST = "llama-cpp-python==0.3.36"


def binary() -> Path:
    return pagoda_home() / "peers" / f"llama.cpp-{SDIST.split('==')[1]}" / "llama-server"


def build(log=print) -> Path:
    """Build llama-server once (cmake, Release, this CPU's vector extensions but never AMX, no web UI)."""
    target = binary()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        tmp = Path(tmp)
        log(f"downloading the {SDIST} sdist")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", SDIST,
                        "-d", str(tmp)], check=True)
        with tarfile.open(next(tmp.glob("*.tar.gz"))) as tar:
            tar.extractall(tmp, filter="data")
        source = next(tmp.glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        flags = cpu_feature_flags()
        log(f"building llama-server (cmake, Release, {' '.join(flags)})")
        subprocess.run(["cmake", "-S", str(source), "-B", str(tmp / "build"), "-DCMAKE_BUILD_TYPE=Release",
                        *flags, "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_USE_PREBUILT_UI=OFF"],
                       check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(tmp / "build"), "--target", "llama-server", "-j", str(os.cpu_count() or 1)],
                       check=True, stdout=subprocess.DEVNULL)
        shutil.move(tmp / "build" / "bin" / "llama-server", target)
    return target


# cpuinfo flag -> ggml's cmake option. GGML_NATIVE (-march=native) also turns AMX on where the CPU
# has it, and on a host whose kernel did not grant AMX tile state that llama-server died at start
# with SIGILL; naming each extension from the CPU's flags keeps AMX off and still fast elsewhere.
GGML_CPU_OPTIONS = {
    "avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2",
    "avx_vnni": "GGML_AVX_VNNI", "avx512f": "GGML_AVX512", "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16",
}


def cpu_feature_flags(cpuinfo: str | None = None) -> list[str]:
    if cpuinfo is None:
        cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    line = next((l for l in cpuinfo.splitlines() if l.startswith("flags")), "")
    present = set(line.partition(":")[2].split())
    options = [f"-D{option}={'ON' if flag in present else 'OFF'}" for flag, option in GGML_CPU_OPTIONS.items()]
    return ["-DGGML_NATIVE=OFF", *options, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


@contextlib.contextmanager
def serving(port: int, parallel: int, ctx_per_slot: int = 1024, threads: int | None = None):
    """llama-server on 127.0.0.1:port with `parallel` slots sharing one KV cache; yields its URL."""
    threads = threads or os.cpu_count() or 1
    process = subprocess.Popen(
        [str(build()), "-m", str(fetch_default_gguf()), "--host", "127.0.0.1", "--port", str(port),
         "--parallel", str(parallel), "--ctx-size", str(ctx_per_slot * parallel), "--kv-unified", "--cont-batching",
         "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(requests.ConnectionError):
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start (exit code {process.poll()})")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "serve"])
    parser.add_argument("--port", type=int, default=18500)
    parser.add_argument("--parallel", type=int, default=4)
    args = parser.parse_args()
    if args.command == "build":
        print(build())
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that `finally` stops llama-server
    with serving(args.port, args.parallel) as url:
        print(f"llama-server ready at {url} (Ctrl-C stops it)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    main()
