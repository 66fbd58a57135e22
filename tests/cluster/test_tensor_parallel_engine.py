"""The engine over a TP=2 group of Ray actors gives the single-process engine's tokens, also a group
whose first rendezvous port was taken by another process before rank 0 could bind it.
Uses the session's Ray cluster (the `server` fixture starts it with its metrics port)."""

import socket
from pathlib import Path

import pytest
import ray

from cluster import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.xdist_group("session-cluster")]  # make test only; on the session cluster, beside its server's tests

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, a small robot"]


@pytest.fixture(scope="module")
def tp2(server, model_dir):
    """The module's TP=2 group, started while the rendezvous port first picked for it is taken:
    the port is free when picked, and another process binds it before rank 0's store does."""
    from cluster.executor import tp_group

    taken = socket.create_server(("0.0.0.0", 0))
    taken_address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    picked = tp_group._rendezvous_on_rank0_node
    picks = []

    class FirstPickTaken:
        def options(self, **options):
            picks.append(options)
            if len(picks) == 1:
                return type("Taken", (), {"remote": lambda _: ray.put(taken_address)})()
            return picked.options(**options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tp_group, "_rendezvous_on_rank0_node", FirstPickTaken())
        llm = LLM(model_dir, tensor_parallel_size=2, num_blocks=64)
    llm.rendezvous = {"picks": len(picks), "taken": taken_address}
    yield llm
    llm.engine.executor.shutdown()
    taken.close()


def test_tp2_greedy_and_seeded_outputs_equal_tp1(tp2, llm):
    greedy = SamplingParams(max_tokens=12, temperature=0)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
    for params in (greedy, seeded):
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        got = [o.outputs[0].token_ids for o in tp2.generate(PROMPTS, params)]
        assert got == expected, params
    assert tp2.engine.num_free_blocks == 64


def test_tp2_ranks_hold_their_kv_heads(tp2):
    ranks = sorted(tp2.engine.executor.describe(), key=lambda r: r["rank"])
    assert [r["kv_heads"] for r in ranks] == [2, 1]  # SmolLM2's 3 KV heads: 2 + 1
    assert len({r["pid"] for r in ranks}) == 2 and all(r["num_blocks"] == 64 for r in ranks)
    # one host: deepspeed's shared-memory all-reduce, not gloo over TCP
    assert [r["collective"] for r in ranks] == ["deepspeed-shm"] * 2
    # its shared-memory segments (named after the rendezvous address) are unlinked once mapped:
    # nothing of this group stays in /dev/shm
    host, port = tp2.engine.executor.init_method.removeprefix("tcp://").rsplit(":", 1)
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{host}_{port}_*"))


def test_tp2_swap_preemption_gives_the_same_tokens(server, model_dir, llm):
    """Swapped-out KV is joined from both ranks and written back to each rank's heads."""
    prompts = PROMPTS * 2  # six requests of ~50 tokens want ~18 blocks of 12
    greedy = SamplingParams(max_tokens=40, temperature=0)
    tight = LLM(model_dir, tensor_parallel_size=2, num_blocks=12, preemption_mode="swap", enable_prefix_caching=False)
    try:
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, greedy)]
        stats = tight.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_in == stats.num_preemptions
        assert got == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert tight.engine.num_free_blocks == 12 and stats.num_swapped_blocks == 0
    finally:
        tight.engine.executor.shutdown()


def test_a_rendezvous_port_taken_before_rank_0_binds_it_starts_the_group_on_another(tp2):
    """The group of the module's other tests (their tokens equal TP=1's on it)."""
    assert tp2.rendezvous["picks"] == 2 and tp2.engine.executor.init_method != tp2.rendezvous["taken"]
