"""Weight formats: exact recovery of GGUF groups from a dequantized checkpoint (lossless), the group
kernel against fp32 on the same values, weight-only int4/int8, dynamic int8 and int8 activations
(lossy, bounded)."""

import pytest
import torch

from model.cpu_ops import cpu_ops
from model.layers import ReplicatedLinear
from model.quantization import (DENSE_PROBE_ROWS, NEVER_DENSE, GroupedWeight, Int8Weight, check_mode,
                                faster_in_turns,
                                quantize_grouped, recover_grouped)

needs_kernels = pytest.mark.skipif(cpu_ops() is None, reason="Pagoda's CPU kernels could not be built here")


def q4_1_values(n: int, k: int) -> torch.Tensor:
    """What gguf-py's Q4_1 dequantization gives: fp16 d and m per 32 weights, d*q then + m in fp32."""
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps each group's min to 0 and its max to 15
    d = (torch.rand(n, k // 32, 1) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    return (q * d + m).reshape(n, k)


def q8_0_values(n: int, k: int) -> torch.Tensor:
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[..., 0] = 127
    d = (torch.rand(n, k // 32, 1) * 0.01).half().float()
    return (q * d).reshape(n, k)


@needs_kernels
@pytest.mark.parametrize("values, kind", [(q4_1_values, "q4_1"), (q8_0_values, "q8_0")])
def test_gguf_groups_are_recovered_bit_for_bit(values, kind):
    torch.manual_seed(0)
    weight = values(96, 320)
    grouped = recover_grouped(weight)
    assert grouped is not None and grouped.kind == kind
    assert torch.equal(grouped.dequantize(), weight)
    bytes_per_weight = (grouped.qweight.numel() + 2 * grouped.d.numel() * (2 if kind == "q4_1" else 1)) / weight.numel()
    assert bytes_per_weight == (0.625 if kind == "q4_1" else 1.0625)  # GGUF's own sizes


@needs_kernels
def test_a_weight_that_is_not_grouped_stays_dense():
    torch.manual_seed(0)
    weight = q4_1_values(8, 64)
    weight[3, 5] += 1e-4  # one value off the grid
    assert recover_grouped(weight) is None
    assert recover_grouped(torch.randn(8, 64)) is None
    assert recover_grouped(torch.randn(8, 40)) is None  # not a multiple of 32
    weight = q8_0_values(8, 64)
    weight[7, 63] += 1e-4  # the last group's last value
    assert recover_grouped(weight) is None
    for bad in (float("inf"), float("nan")):
        weight = q4_1_values(8, 64)
        weight[0, 0] = bad
        assert recover_grouped(weight) is None


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 65, 200])
def test_group_kernel_equals_fp32_on_the_same_values(values, rows):
    """Every batch size the kernel takes differently (1 to 4 rows: each weight row read once for
    all; 5 on: dequantized tiles, odd, > one 64-token block); with a bias."""
    torch.manual_seed(0)
    layer = ReplicatedLinear(320, 100, bias=True)
    layer.weight.data.copy_(values(100, 320))
    layer.bias.data.normal_()
    x = torch.randn(rows, 320)
    expected = layer(x)
    layer.pack("auto")
    assert layer.weight is None and isinstance(layer.packed, GroupedWeight)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
def test_first_rows_of_a_grouped_weight_give_the_first_outputs(values):
    """What choose_dense_from times on a big model: a view of the weight's first rows."""
    torch.manual_seed(0)
    grouped = recover_grouped(values(100, 320), torch.randn(100))
    x = torch.randn(3, 320)
    torch.testing.assert_close(grouped.first_rows(40).linear(x), grouped.linear(x)[:, :40] - grouped.bias[:40])


@pytest.fixture
def dense_from():
    """Sets from how many rows group_linear takes torch's GEMM (a process-wide choice an engine
    measures at load), and puts the process's value back afterwards."""
    before = cpu_ops().dense_from()
    yield cpu_ops().set_dense_from
    cpu_ops().set_dense_from(before)


@needs_kernels
def test_the_dense_from_choice_is_timed_once_a_process_and_set_at_each_load(monkeypatch, dense_from):
    from model import quantization

    timed = []
    monkeypatch.setattr(quantization, "_dense_from_of_this_process", {})
    monkeypatch.setattr(quantization, "choose_dense_from", lambda weight: timed.append(weight.shape) or 512)
    weight = recover_grouped(q8_0_values(100, 320))
    assert quantization.dense_from_once(weight) == 512 and cpu_ops().dense_from() == 512
    dense_from(1)  # what another engine's choice, or a test, left
    assert quantization.dense_from_once(weight) == 512 and cpu_ops().dense_from() == 512
    assert timed == [(100, 320)]


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
@pytest.mark.parametrize("rows", [127, 128])
def test_a_weight_larger_than_one_dequantized_chunk_equals_fp32(values, rows, dense_from):
    """From 128 rows on (as set here) the kernel dequantizes the weight 2M floats at a time for
    torch's GEMM (an LM head's size: here 3,700 x 576, two chunks, the second of 60 rows); just
    below, the group kernel."""
    dense_from(128)
    torch.manual_seed(0)
    weight, bias = values(3700, 576), torch.randn(3700)
    x = torch.randn(rows, 576)
    grouped = recover_grouped(weight, bias)
    expected = torch.nn.functional.linear(x, weight, bias)  # outputs up to ~50: fp32 sums of 576 products
    torch.testing.assert_close(grouped.linear(x), expected, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
@pytest.mark.parametrize("rows", [15, 16, 17, 40, 300])
def test_batches_on_amx_tiles_equal_fp32(values, rows):
    """From 16 rows, on hosts with AMX (cpu_ops().amx_tiles()), x is split into three bf16 parts
    that add up to it exactly and multiplies the GGUF's integers on the tiles: still the fp32
    product. Elsewhere these rows take the group kernel or torch's GEMM, held to the same bound."""
    torch.manual_seed(0)
    weight, bias = values(192, 576), torch.randn(192)
    x = torch.randn(rows, 576) * torch.logspace(-3, 3, 576)  # magnitudes spread over six decades
    grouped = recover_grouped(weight, bias)
    expected = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    fp32_error = (torch.nn.functional.linear(x, weight, bias).double() - expected).abs().max()
    error = (grouped.linear(x).double() - expected).abs().max()
    assert error <= 2 * fp32_error, (error, fp32_error)


def blocked_products(x: torch.Tensor, weight: torch.Tensor, chunk: int = 192) -> torch.Tensor:
    """x @ weight.T in fp32 summed as the panel kernel sums: over k in chunks of 192, in order, each
    term one fused multiply-add (the product exact in float64, the sum rounded once to fp32), the
    chunks' sums added in order."""
    out = None
    for k0 in range(0, x.shape[1], chunk):
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(k0, min(x.shape[1], k0 + chunk)):
            acc = (acc.double() + x[:, k, None].double() * weight[None, :, k].double()).float()
        out = acc if out is None else out + acc
    return out


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
@pytest.mark.parametrize("rows, k", [(16, 576), (24, 320), (40, 576), (300, 320)])
def test_panels_sum_in_their_blocked_order(values, rows, k, dense_from):
    """On AVX-512 hosts, batches from 16 rows take the panel kernel: 100 rows of W (the last block
    of 12 four rows), 320 (chunks of 192 and 128) or 576 inputs, 16 to 300 rows of x (a last panel
    half zeros; several blocks of 256). Its sums are the blocked order's to the last bit."""
    if not cpu_ops().panels_for(rows) or cpu_ops().amx_tiles():
        pytest.skip("this host multiplies these rows another way")
    dense_from(NEVER_DENSE)
    torch.manual_seed(0)
    weight = values(100, k)
    x = torch.randn(rows, k)
    assert torch.equal(recover_grouped(weight).linear(x), blocked_products(x, weight))


def rounded_per_group(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per group of 32 (scale max|x| / 127, x times its fp32 inverse rounded to
    nearest, as the kernel and llama.cpp's Q8_0 round), back in float64."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.round(groups * (1 / scale.clamp(min=1e-30)))
    return (q.double() * scale.double()).reshape(x.shape)


@needs_kernels
@pytest.mark.parametrize("values", [q4_1_values, q8_0_values])
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 40, 130])
def test_int8_activations_multiply_the_rounded_x_by_the_exact_weights(values, rows):
    """With int8 activations a product is W . x-rounded, whichever kernel takes the rows: integers
    a row of W at a time for one or two rows; beyond, W's tiles of 16 rows on 512-bit VNNI (200
    rows of W: 12 tiles and 8 rows past them; 7 rows of x: passes of 4, 2 and 1), else the fp32
    kernels on the rounded x; so a row's result is the same alone as in a batch up to fp32 rounding.
    That rounding is bounded by the sum of the terms' magnitudes (a sum that cancels can lose more
    than 1e-5 of its result: 1.3e-5 seen on an AVX2 host), 16 units of fp32 rounding of it, ~8x
    what the kernels show; x not rounded first would be off by ~1e-1."""
    torch.manual_seed(0)
    weight, bias = values(200, 576), torch.randn(200)
    x = torch.randn(rows, 576)
    grouped = recover_grouped(weight, bias, int8_activations=True)
    assert grouped.kind.endswith("_x_int8")
    rounded = rounded_per_group(x)
    expected = torch.nn.functional.linear(rounded, weight.double(), bias.double())
    magnitudes = torch.nn.functional.linear(rounded.abs(), weight.double().abs(), bias.double().abs())
    out = grouped.linear(x)
    assert ((out.double() - expected).abs() <= magnitudes * 2**-20).all()
    alone = grouped.linear(x[:1])
    torch.testing.assert_close(out[:1], alone, rtol=1e-5, atol=1e-5)
    fp32 = torch.nn.functional.linear(x, weight, bias)
    assert ((out - fp32).norm() / fp32.norm()).item() < 0.02


@needs_kernels
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_activations_keep_a_non_finite_input_visible(rows):
    """A NaN or infinity in x cannot be rounded to int8: its row comes out NaN (as fp32's would,
    which the engine reports as that request's failure), the other rows unharmed."""
    torch.manual_seed(0)
    grouped = recover_grouped(q4_1_values(64, 320), int8_activations=True)
    x = torch.randn(rows, 320)
    x[0, 7] = float("inf") if rows == 1 else float("nan")
    out = grouped.linear(x)
    assert out[0].isnan().all() and out[1:].isfinite().all()


@needs_kernels
@pytest.mark.parametrize("bits, bound", [(8, 0.01), (4, 0.15)])
def test_weight_only_quantization_is_close(bits, bound):
    torch.manual_seed(0)
    weight = torch.randn(64, 256) * 0.05
    x = torch.randn(4, 256)
    out = quantize_grouped(weight, bits).linear(x)
    expected = x @ weight.t()
    assert ((out - expected).norm() / expected.norm()).item() < bound


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    layer = ReplicatedLinear(256, 512, bias=True)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.1)
    x = torch.randn(8, 256)
    expected = layer(x)
    layer.pack("int8")
    assert layer.weight is None and isinstance(layer.packed, Int8Weight)
    out = layer(x)
    assert ((out - expected).norm() / expected.norm()).item() < 0.03


def test_modes_are_checked():
    assert check_mode("none", torch.device("cpu")) == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        check_mode("int3", torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        check_mode("int8", torch.device("cuda"))
    assert check_mode(None, torch.device("cuda")) == "none"  # auto packs on the CPU only


@needs_kernels
def test_default_model_is_packed_losslessly(model_dir):
    """The default model's checkpoint is a dequantized Q4_1 GGUF (LM head Q8_0): "auto" finds every
    group, and greedy tokens equal the dense model's."""
    from model.runner import ModelRunner

    runner = ModelRunner(model_dir, num_blocks=8)
    assert runner.weight_formats == {"q4_1": 120, "q8_0": 1}
    # Where prefill leaves the group kernel for torch's GEMM: measured at load, set for the process
    chosen = runner.describe()[0]["dense_from"]
    assert chosen in DENSE_PROBE_ROWS or chosen is None
    assert cpu_ops().dense_from() == (chosen or NEVER_DENSE)


class BusyHost:
    """A clock for faster_in_turns: each call of a path takes its own time times how busy the host
    is at that moment, which changes from one pair of calls to the next (warming included)."""

    def __init__(self, busy: list[float]):
        self.now, self.calls, self.busy = 0.0, 0, busy

    def clock(self) -> float:
        return self.now

    def path(self, seconds: float):
        def run():
            self.now += seconds * self.busy[self.calls // 2 % len(self.busy)]
            self.calls += 1
        return run


@pytest.mark.parametrize("busy", [[1.0], [1.0, 1.0, 9.0, 9.0, 9.0, 9.0], [6.0, 1.0, 1.0, 6.0, 1.0, 6.0]])
def test_faster_in_turns_compares_the_two_paths_at_the_same_moments(busy):
    """The load-time choice of prefill's GEMM: the faster path wins however busy the host is, so
    long as a pair of timings shares the moment (with the second pattern the fastest of each path,
    timed one path after the other, would take the slower: its timings all fell in the quiet
    moments)."""
    host = BusyHost(busy)
    assert not faster_in_turns(host.path(1.5), than=host.path(1.0), rounds=5, clock=host.clock)
    host = BusyHost(busy)
    assert faster_in_turns(host.path(1.0), than=host.path(1.5), rounds=5, clock=host.clock)


def test_int8_engine_answers_and_frees_its_blocks(model_dir):
    from cluster import LLM, SamplingParams

    llm = LLM(model_dir, num_blocks=64, quantization="int8")
    # Dynamic int8 flips the chat answer about France on some hosts (AVX2) and not others; Berlin holds.
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], SamplingParams(max_tokens=16, temperature=0))
    assert "Berlin" in out[0].outputs[0].text
    assert llm.engine.num_free_blocks == 64


@needs_kernels
def test_int8_activations_engine_answers_and_frees_its_blocks(model_dir):
    """The default model's own groups times int8 activations: every layer and the head take it."""
    from cluster import LLM, SamplingParams

    llm = LLM(model_dir, num_blocks=64, quantization="int8-activations")
    assert llm.engine.executor.weight_formats == {"q4_1_x_int8": 120, "q8_0_x_int8": 1}
    # Like dynamic int8, it flips the small model's answer about France (to "L'Étoile"); Berlin holds.
    out = llm.chat([{"role": "user", "content": "What is the capital of Germany?"}], SamplingParams(max_tokens=16, temperature=0))
    assert "Berlin" in out[0].outputs[0].text
    assert llm.engine.num_free_blocks == 64


def test_unknown_quantization_is_refused(model_dir):
    from cluster import LLM

    with pytest.raises(ValueError, match="quantization"):
        LLM(model_dir, num_blocks=8, quantization="int3")
