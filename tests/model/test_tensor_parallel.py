"""Tensor-parallel sharding: the head layout, and TP ranks of the real model whose all-reduced
outputs equal the single-rank model. The ranks run as threads here with an in-process all-reduce
(a stand-in for the collective, in a unit test of the sharding); the worker actors with a real
process group are tested with the executor."""

import threading

import pytest
import torch

from model.config import UnsupportedModelError
from cluster.engine.executor import SequenceInput
from model.runner import ModelRunner
from model.sampler import SamplingRow
from model.tp_layout import HeadShard, head_shard


@pytest.mark.parametrize("tp, expected", [
    (1, [HeadShard(range(0, 9), range(0, 3))]),
    (2, [HeadShard(range(0, 6), range(0, 2)), HeadShard(range(6, 9), range(2, 3))]),
    (3, [HeadShard(range(0, 3), range(0, 1)), HeadShard(range(3, 6), range(1, 2)), HeadShard(range(6, 9), range(2, 3))]),
])
def test_smollm2_heads_split_along_kv_groups(tp, expected):
    assert [head_shard(9, 3, tp, rank) for rank in range(tp)] == expected


@pytest.mark.parametrize("heads, kv_heads, tp", [(9, 3, 9), (8, 2, 4), (32, 8, 16), (32, 8, 8), (12, 4, 3)])
def test_every_query_head_lands_once_next_to_its_kv_head(heads, kv_heads, tp):
    shards = [head_shard(heads, kv_heads, tp, rank) for rank in range(tp)]
    assert sorted(h for s in shards for h in s.q_heads) == list(range(heads))
    group = heads // kv_heads
    for s in shards:
        assert {h // group for h in s.q_heads} == set(s.kv_heads)
        assert len(s.q_heads) % len(s.kv_heads) == 0  # whole groups: attention runs unchanged


@pytest.mark.parametrize("tp", [4, 6])
def test_sizes_that_cannot_split_the_heads_are_refused(tp):
    with pytest.raises(UnsupportedModelError, match="tensor parallel size"):
        head_shard(9, 3, tp, 0)


class ThreadAllReduce:
    """Sums a tensor across `n` threads, in rank order (so every rank gets the same bits)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.parts: list = [None] * n

    def for_rank(self, rank: int):
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # nobody overwrites a part before everyone has summed
            return total
        return reduce


def run_step(runners, seqs, run=lambda runner, seqs: runner.forward(runner.prepare(seqs))) -> list:
    """Every rank runs `run(runner, seqs)` (default: the bare model's logits) in a thread of its own."""
    outputs = [None] * len(runners)

    def work(rank):
        outputs[rank] = run(runners[rank], seqs)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_ranks_of_smollm2_give_the_single_rank_logits(model_dir, tokenizer, tp):
    single = ModelRunner(model_dir, num_blocks=16)
    collective = ThreadAllReduce(tp)
    ranks = [ModelRunner(model_dir, num_blocks=16, tp_rank=r, tp_size=tp, reduce=collective.for_rank(r)) for r in range(tp)]
    assert sum(r.num_kv_heads for r in ranks) == 3  # each rank caches only its KV heads
    greedy = SamplingRow(temperature=0.0)
    prompts = [tokenizer("The capital of France is").input_ids, tokenizer("def fibonacci(n):\n    ").input_ids]
    prefill = [SequenceInput(p, 0, [4 * i, 4 * i + 1], greedy) for i, p in enumerate(prompts)]
    expected = single.forward(single.prepare(prefill))
    got = run_step(ranks, prefill)
    for logits in got:
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
    next_ids = expected.argmax(-1).tolist()
    decode = [SequenceInput([t], len(p), [4 * i, 4 * i + 1], greedy) for i, (t, p) in enumerate(zip(next_ids, prompts))]
    expected = single.forward(single.prepare(decode))
    for logits in run_step(ranks, decode):
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
        assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()
