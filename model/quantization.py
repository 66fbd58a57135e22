"""Weight formats for linear layers other than a dense float matrix. Each has `linear(x)`.

    mode (engine `quantization`)   weights                                    lossless?
    "auto" (default) / None        grouped where the checkpoint's values are   yes: the same fp32 values,
                                   exactly GGUF Q4_1 / Q8_0 groups, else dense  multiplied in fp32
    "none"                         dense, as loaded                            yes
    "int8"                         Int8Weight: int8 weights x int8 activations  no (perplexity +4%)
    "int8-weights"                 GroupedWeight Q8_0 from any checkpoint       no (see docs/benchmarks-log.md)
    "int4-weights"                 GroupedWeight Q4_1 from any checkpoint       no (see docs/benchmarks-log.md)
    "int8-activations"             grouped as "auto" finds them, times          no (llama.cpp's arithmetic;
                                   activations rounded to int8 per group of 32  see docs/benchmarks-log.md)

The default model comes from a Q4_1 GGUF (its LM head Q8_0): dequantized to fp32 once at fetch, its
weights are exactly representable again as those groups, so `recover_grouped` finds the groups, and
decode reads ~0.63 byte per weight instead of 4 with the same numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Protocol

import torch

from model.config import QUANTIZATION_MODES
from model.cpu_ops import cpu_ops

GROUP = 32


class PackedWeight(Protocol):
    def linear(self, x: torch.Tensor) -> torch.Tensor: ...


class GroupedWeight:
    """A weight [N, K] in groups of 32 along K, each with an fp16 scale d (and for Q4_1 a minimum
    m): Q4_1 stores q in 0..15 two to a byte, w = d*q + m; Q8_0 stores q in -127..127, w = d*q.
    Multiplied by Pagoda's group_linear kernel, which dequantizes group by group in fp32, or, with
    int8_activations, rounds x to int8 per group of 32 and multiplies integers (llama.cpp's way)."""

    def __init__(self, qweight: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, bias: torch.Tensor | None,
                 int8_activations: bool = False):
        self.qweight, self.d, self.m, self.bias = qweight, d, m, bias
        self.int8_activations = int8_activations
        self.kind = ("q4_1" if m is not None else "q8_0") + ("_x_int8" if int8_activations else "")
        self._ops = cpu_ops()

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * GROUP

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1]).float()
        out = self._ops.group_linear(x, self.qweight, self.d, self.m if self.m is not None else self.d, self.bias,
                                     self.int8_activations)
        return out.reshape(*shape[:-1], out.shape[-1]).to(dtype)

    def dequantize(self) -> torch.Tensor:
        return self._ops.group_dequantize(self.qweight, self.d, self.m if self.m is not None else self.d)

    def first_rows(self, n: int) -> GroupedWeight:
        """The first n output rows (a view of the same bytes, no bias)."""
        return GroupedWeight(self.qweight[:n], self.d[:n], None if self.m is None else self.m[:n], None,
                             self.int8_activations)


def _groups(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    return weight.float().reshape(weight.shape[0], -1, GROUP)


def _pack_q4(q: torch.Tensor) -> torch.Tensor:
    """[N, G, 32] values 0..15 -> [N, G*16] bytes: byte j of a group holds weights j and j+16 (GGUF's order)."""
    q = q.to(torch.uint8)
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(q.shape[0], -1).contiguous()


def recover_grouped(weight: torch.Tensor, bias: torch.Tensor | None = None,
                    int8_activations: bool = False) -> GroupedWeight | None:
    """The weight as Q4_1 or Q8_0 groups if every one of its values is exactly what those groups
    dequantize to (a checkpoint dequantized from such a GGUF), else None. Pagoda's kernel finds
    them in one pass (group_recover)."""
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return None
    found = cpu_ops().group_recover(weight.float().contiguous())
    if not found:
        return None
    qweight, d, *m = found
    return GroupedWeight(qweight, d, m[0] if m else None, bias, int8_activations)


def quantize_grouped(weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> GroupedWeight:
    """Weight-only quantization of any weight to Q4_1 (bits=4) or Q8_0 (bits=8), as llama.cpp's
    reference quantizers round: lossy, its cost measured in docs/benchmarks-log.md."""
    groups = _groups(weight)
    if groups is None:
        raise ValueError(f"a grouped weight needs input features divisible by {GROUP}, got {tuple(weight.shape)}")
    if bits == 4:
        low, high = groups.amin(-1), groups.amax(-1)
        d, m = ((high - low) / 15).half(), low.half()
        step = d.float()[..., None]
        q = torch.round((groups - m.float()[..., None]) / step.clamp(min=1e-30)).clamp(0, 15)
        return GroupedWeight(_pack_q4(q), d.contiguous(), m.contiguous(), bias)
    if bits == 8:
        d = (groups.abs().amax(-1) / 127).half()
        q = torch.round(groups / d.float()[..., None].clamp(min=1e-30)).clamp(-127, 127)
        return GroupedWeight(q.to(torch.int8).reshape(weight.shape).contiguous(), d.contiguous(), None, bias)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


class Int8Weight:
    """A linear weight in int8, one scale per output channel, multiplied by activations that are
    quantized to int8 per token (one scale per row) at each call; torch._int_mm accumulates in
    int32. Per-token scales keep one token's outliers (the first token's are huge) from costing the
    others their precision, and keep a request's numbers independent of its batch neighbours.
    Decode is bound by reading weights, so a quarter of the bytes is most of the speed-up; the cost
    in quality is measured in docs/benchmarks-log.md. CPU only."""

    kind = "int8_dynamic"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.float()
        self.scale = weight.abs().amax(dim=1).clamp(min=1e-8) / 127  # [out]
        # [in, out] laid out column-major: the layout _int_mm's CPU kernel reads fastest
        self.qweight = torch.round(weight / self.scale[:, None]).to(torch.int8).t()
        self.bias = None if bias is None else bias.float()

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        x = x.reshape(-1, shape[-1]).float()
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-8) / 127
        qx = torch.round(x / x_scale).to(torch.int8)
        out = torch._int_mm(qx, self.qweight).float().mul_(x_scale).mul_(self.scale)
        if self.bias is not None:
            out += self.bias
        return out.reshape(*shape[:-1], out.shape[-1]).to(dtype)


# Rows of x (prefill chunks) at which choose_dense_from compares the group kernel with torch's GEMM.
DENSE_PROBE_ROWS = (128, 512)
NEVER_DENSE = 1 << 62
DENSE_PROBE_WEIGHTS = 2 << 20  # at most this many of the weight's values are timed (a big model's load stays short)


def choose_dense_from(weight: GroupedWeight, rounds: int = 5) -> int | None:
    """From how many rows of x torch's GEMM of the dequantized weight is faster than the group
    kernel on this host: timed on `weight` (a model's largest grouped layer; its first ~2M values)
    at DENSE_PROBE_ROWS, once at load (~0.2 s). Sets it for every group_linear of this process and
    returns it; None: the group kernel at every size."""
    weight = weight.first_rows(max(GROUP, DENSE_PROBE_WEIGHTS // weight.shape[1]))
    ops, chosen = cpu_ops(), NEVER_DENSE

    def run_with(rows_from: int, x: torch.Tensor) -> Callable[[], object]:
        def run():
            ops.set_dense_from(rows_from)
            return weight.linear(x)
        return run

    for rows in DENSE_PROBE_ROWS:
        x = torch.randn(rows, weight.shape[1])
        if faster_in_turns(run_with(1, x), than=run_with(NEVER_DENSE, x), rounds=rounds):
            chosen = rows
            break
    ops.set_dense_from(chosen)
    return None if chosen == NEVER_DENSE else chosen


_dense_from_of_this_process: dict[tuple, int | None] = {}


def dense_from_once(weight: GroupedWeight) -> int | None:
    """choose_dense_from, timed once in a process for each shape and kind of weight: the host does
    not change between loads, and an engine built again in the same process (the tests, the
    benchmarks, a restarted engine) spent ~0.3 s timing it each time. Sets it, as the first did."""
    key = (weight.shape, weight.kind)
    if key not in _dense_from_of_this_process:
        _dense_from_of_this_process[key] = choose_dense_from(weight)
    chosen = _dense_from_of_this_process[key]
    cpu_ops().set_dense_from(NEVER_DENSE if chosen is None else chosen)
    return chosen


def faster_in_turns(candidate: Callable[[], object], than: Callable[[], object], rounds: int,
                    clock: Callable[[], float] = time.perf_counter) -> bool:
    """Whether `candidate` runs faster than `than`: each warmed once, then timed in turns, and the
    median of the rounds' time ratios below 1. A process starting beside busy ones (a replica
    scaled up on a loaded node) has its timings stretched by whoever holds the cores at the moment:
    a pair timed back to back shares that moment, where the fastest of each path timed apart did
    not (it chose torch's GEMM from 512 rows in 2 of 6 loads beside two busy processes here, and
    the process's prefill ran 1.5x slower for its whole life)."""

    def timed(run: Callable[[], object]) -> float:
        start = clock()
        run()
        return clock() - start

    candidate(), than()  # warm: buffers allocated, the weight in cache, for both alike
    ratios = []
    for round_ in range(rounds):  # which goes first alternates: neither always finds the cache the other left
        if round_ % 2:
            theirs, ours = timed(than), timed(candidate)
        else:
            ours, theirs = timed(candidate), timed(than)
        ratios.append(ours / max(theirs, 1e-9))
    return statistics.median(ratios) < 1.0


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None, mode: str) -> PackedWeight | None:
    """The format `mode` gives this weight; None: keep it dense."""
    if mode == "int8":
        return Int8Weight(weight, bias)
    if mode == "int8-weights":
        return quantize_grouped(weight, 8, bias)
    if mode == "int4-weights":
        return quantize_grouped(weight, 4, bias)
    if mode in ("auto", "int8-activations"):
        return recover_grouped(weight, bias, int8_activations=mode == "int8-activations")
    return None


def check_mode(mode: str | None, device: torch.device) -> str:
    """The effective mode: None is "auto"; every mode but "none" needs the CPU, and the grouped
    ones Pagoda's CPU kernels ("auto" quietly keeps dense weights without them)."""
    mode = mode or "auto"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_MODES)}, got {mode!r}")
    if mode == "auto":
        return "auto" if device.type == "cpu" and cpu_ops() is not None else "none"
    if mode != "none" and device.type != "cpu":
        raise ValueError(f"quantization={mode!r} runs on the CPU only")
    if mode in ("int8-weights", "int4-weights", "int8-activations") and cpu_ops() is None:
        raise ValueError(f"quantization={mode!r} needs Pagoda's CPU kernels, which could not be built here")
    return mode
