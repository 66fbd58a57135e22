"""The group kernel of this working tree against another revision's, on the default model's shapes,
in alternating processes: one build per process (two builds' Python bindings cannot share one),
the two builds taking turns, so that a VM whose speed swings over minutes slows both alike.

    python -m benchmarks.kernel_ab --against HEAD~1 [--rows 32] [--turns 5] [--shapes gate_up,lm_head]

Each process builds (first time only; torch's extension cache keeps every build by its source's
hash) or loads one revision's `model/csrc`, times `group_linear` on random Q4_1 weights (the layers)
and Q8_0 (the LM head) with the weight hot, and reports µs per call (median of its rounds) and a
hash of its outputs. Printed: each build's median over the turns, the ratio, and whether the two
builds' outputs are equal bit for bit. Environment variables (PAGODA_AMX=0, say) reach both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.cpu_kernels import SHAPES as KERNEL_SHAPES
from benchmarks.cpu_kernels import microseconds

ROOT = Path(__file__).resolve().parents[1]
CSRC = Path("model") / "csrc"
SHAPES = {label.split()[0]: shape for label, shape in KERNEL_SHAPES.items()}  # qkv, gate_up, down, lm_head


def export_sources(revision: str, into: Path) -> Path:
    """`revision`'s model/csrc written under `into`; returns the path of its cpu_ops.cpp."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{CSRC.as_posix()}"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{revision}:{(CSRC / name).as_posix()}"], cwd=ROOT, check=True,
                              capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into / "cpu_ops.cpp"


def time_one_build(source: Path, rows: int, shapes: list[str]) -> dict:
    """In this process: build or load the kernels from `source`, time each shape."""
    import torch

    from model import cpu_ops as loader

    loader.SOURCE = source  # before the first cpu_ops() call, which the weights' linear() makes
    from model.quantization import NEVER_DENSE, quantize_grouped

    ops = loader.cpu_ops()
    if ops is None:
        raise SystemExit(f"the kernels of {source} did not build")
    ops.set_dense_from(NEVER_DENSE)
    torch.manual_seed(0)
    result = {"build": loader.build_key(), "us": {}, "outputs": {}}
    for name in shapes:
        k, n, bits = SHAPES[name]
        weight = quantize_grouped(torch.randn(n, k) * 0.05, bits)
        x = torch.randn(rows, k)
        calls = max(3, round(5e8 / (n * k * rows)))  # rounds of ~5 ms at ~200 Gflop/s, whatever the shape
        result["us"][name] = statistics.median(microseconds(lambda: weight.linear(x), calls) for _ in range(7))
        result["outputs"][name] = hashlib.sha256(weight.linear(x).numpy().tobytes()).hexdigest()[:16]
    return result


def run_child(source: Path, rows: int, shapes: list[str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.kernel_ab", "--child", str(source), "--rows", str(rows),
               "--shapes", ",".join(shapes)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"timing the kernels of {source} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="HEAD", help="the revision whose model/csrc is the baseline")
    parser.add_argument("--rows", type=int, default=32, help="rows of x (a decode batch's sequences)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    if unknown := set(shapes) - set(SHAPES):
        parser.error(f"--shapes: unknown {sorted(unknown)}; known: {', '.join(SHAPES)}")
    if args.child:
        print(json.dumps(time_one_build(args.child, args.rows, shapes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:
            baseline = export_sources(args.against, Path(tmp))
        except subprocess.CalledProcessError as exc:
            parser.error(f"--against: no model/csrc at {args.against!r} ({exc.stderr.strip()})")
        sources = {args.against: baseline, "working tree": ROOT / CSRC / "cpu_ops.cpp"}
        results = {label: [] for label in sources}
        for turn in range(args.turns):
            for label in list(sources) if turn % 2 == 0 else list(reversed(sources)):
                result = run_child(sources[label], args.rows, shapes)
                results[label].append(result)
                timings = ", ".join(f"{name} {us:,.0f}" for name, us in result["us"].items())
                print(f"turn {turn + 1}, {label}: {timings}", flush=True)
    base, new = results.values()
    builds = f"builds {base[0]['build']} / {new[0]['build']}"
    print(f"\n{args.rows} rows, medians of {args.turns} turns (µs per call); {builds}")
    print(f"| shape | {args.against} | working tree | ratio | outputs equal |\n|---|---:|---:|---:|---|")
    for name in shapes:
        old_us = statistics.median(result["us"][name] for result in base)
        new_us = statistics.median(result["us"][name] for result in new)
        equal = base[0]["outputs"][name] == new[0]["outputs"][name]
        print(f"| {name} | {old_us:,.0f} | {new_us:,.0f} | {new_us / old_us:.3f} | {'yes' if equal else 'NO'} |")


if __name__ == "__main__":
    main()
