"""The C++ layer stack (model/decode_stack.py) computes what the Python layers compute, on the
default model's grouped weights and on a tiny Qwen2's dense weights with qkv biases."""

import pytest
import torch

from model import decode_stack
from model.cpu_ops import cpu_ops
from cluster.engine.executor import SequenceInput
from model.runner import ModelRunner
from tests.model.test_tiny_models import ARCHITECTURES, save_tiny_model

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="Pagoda's CPU kernels could not be built here")


def decode_and_chunk_step(runner: ModelRunner):
    """Two prompts prefilled (long chunks: the Python path), then a step the stack can serve: one
    decode and a 5-token chunk."""
    runner.execute([SequenceInput(list(range(100, 140)), 0, [0, 1, 2], None),
                    SequenceInput(list(range(300, 335)), 0, [3, 4, 5], None)])
    return runner.prepare([SequenceInput([7], 40, [0, 1, 2], None), SequenceInput(list(range(500, 505)), 35, [3, 4, 5], None)])


@pytest.fixture(params=["default", "qwen2"])
def runner(request, model_dir, tmp_path):
    if request.param == "default":
        return ModelRunner(model_dir, num_blocks=8)
    path, _ = save_tiny_model(*ARCHITECTURES["qwen2"], tmp_path / "qwen2", model_dir)
    return ModelRunner(path, num_blocks=8)


@torch.inference_mode()
def test_stack_equals_the_python_layers(runner):
    step = decode_and_chunk_step(runner)
    assert decode_stack.serves(step.ctx)
    stack, runner.model.decode_stack = runner.model.decode_stack, None
    python = runner.model(step.input_ids, step.positions, step.ctx)
    python_cache = runner.kv_cache.clone()
    runner.model.decode_stack = stack
    fused = runner.model(step.input_ids, step.positions, step.ctx)
    assert runner.describe()[0]["attention"] == "paged kernel, layer stack"
    torch.testing.assert_close(fused, python, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(runner.kv_cache, python_cache, rtol=1e-5, atol=1e-5)


def test_int8_weights_take_the_python_path(model_dir):
    runner = ModelRunner(model_dir, num_blocks=8, quantization="int8")
    assert runner.model.decode_stack is None
    assert runner.describe()[0]["attention"] == "paged kernel"


@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("width", [1536, 13])  # 13: the few past the last 8 go through a padded vector
def test_silu_and_mul_equals_torch(rows, width):
    """The stack's SiLU(gate) * up (vectorized, across threads) against torch's, the gates spanning
    where e^-gate overflows a float (gate < -88) and where the sigmoid saturates."""
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * width) * 30
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops().silu_and_mul(x), torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-30)
