"""KV moving from a prefill engine to a decode engine (disaggregation), in one process: the same
code the cluster runs, with the object store replaced by passing the arrays themselves.

- engines: prompts prefilled on one engine (in chunks, with prefix hits) and decoded on another
  give exactly the tokens of one engine doing both; blocks all free afterwards on both.
- re-sharding: KV exported by TP=2 ranks installs into a TP=1 runner, and TP=1's into TP=3 ranks,
  and the next step's logits equal a single runner's.
"""

import dataclasses

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.sampling_params import SamplingParams
from model.kv_transfer import KVImport, KVPart
from cluster.engine.executor import SequenceInput
from model.runner import ModelRunner
from model.sampler import SamplingRow
from tests.model.test_tensor_parallel import ThreadAllReduce, run_step
from tests.parity_prompts import DOC


def run_to_end(engine: LLMEngine) -> dict:
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).append(delta)
    return outputs


def covered(parts: list[KVPart], num_layers: int, num_kv_heads: int, stop: int) -> bool:
    """Whether the parts hold every layer and head for positions [0, stop) (a complete export)."""
    for layer in range(num_layers):
        for head in range(num_kv_heads):
            ranges = sorted(p.tokens for p in parts if p.layer == layer and p.heads[0] <= head < p.heads[1])
            reach = 0
            for lo, hi in ranges:
                if lo > reach:
                    return False
                reach = max(reach, hi)
            if reach < stop:
                return False
    return True


def test_prefill_on_one_engine_decode_on_another_equals_one_engine(model_dir, tokenizer):
    config = dict(model=model_dir, num_blocks=128, max_num_batched_tokens=96)
    single = build_engine(EngineConfig(**config))
    prompts = {
        "short": single.encode_prompt(messages=[{"role": "user", "content": "What is the capital of France?"}]),
        "doc": tokenizer(DOC[:1500] + "\nSummarize the text above in one line:").input_ids,  # several chunks
        "doc-again": tokenizer(DOC[:1500] + "\nWhat is this text about?").input_ids,  # a prefix hit on both sides
    }
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    prefill, decode = build_engine(EngineConfig(**config)), build_engine(EngineConfig(**config))
    for name, params in [("greedy", greedy), ("seeded", seeded)]:
        expected = {}
        for key, ids in prompts.items():
            single.add_request(key, ids, params)
            expected[key] = [d.new_token_ids[0] for d in run_to_end(single)[key]]

        for key, ids in prompts.items():  # one after another: "doc-again" hits "doc"'s blocks
            prefill.add_request(key, ids, dataclasses.replace(params, max_tokens=1), export_kv=True)
            (last,) = run_to_end(prefill)[key]
            result = last.prefilled
            assert result is not None and result.token_id == last.new_token_ids[0]
            c = prefill.model_config
            assert covered(result.kv_parts, c.num_hidden_layers, c.num_key_value_heads, len(ids))
            assert result.kv_bytes == c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4 * len(ids)
            first = decode.add_request(key, ids, params, prefilled=result)
            got = [first[0].new_token_ids[0]] + [d.new_token_ids[0] for d in run_to_end(decode).get(key, [])]
            assert got == expected[key], (name, key)
        for engine in (single, prefill, decode):
            assert engine.num_free_blocks == engine.num_blocks
    assert decode.kv_cache.pool.stats.num_hit_tokens > 0  # the decode side reused its own prefix cache too


def tp_ranks(model_dir, tp):
    collective = ThreadAllReduce(tp)
    return [ModelRunner(model_dir, num_blocks=8, tp_rank=r, tp_size=tp, reduce=collective.for_rank(r)) for r in range(tp)]


def test_kv_reshards_between_tp_degrees(model_dir, tokenizer):
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 3).input_ids
    greedy = SamplingRow(temperature=0.0)
    single = ModelRunner(model_dir, num_blocks=8)
    out = single.execute([SequenceInput(prompt, 0, [0, 1, 2, 3], greedy, export_kv_from=0)])
    next_token = out.sampled[0].token_id
    decode_step = lambda blocks, imp=None: [SequenceInput([next_token], len(prompt), blocks, greedy, import_kv=imp)]  # noqa: E731
    expected = single.forward(single.prepare(decode_step([0, 1, 2, 3])))

    # TP=2 prefill ranks export their heads (2 + 1); a TP=1 runner installs all three.
    ranks = tp_ranks(model_dir, 2)
    outputs = run_step(ranks, [SequenceInput(prompt, 0, [4, 5, 6, 7], greedy, export_kv_from=0)], run=ModelRunner.execute)
    parts = outputs[0].kv_parts[0] + outputs[1].kv_parts[0]
    assert {p.heads for p in parts} == {(0, 2), (2, 3)}
    target = ModelRunner(model_dir, num_blocks=8)
    target.execute(decode_step([7, 6, 5, 4], KVImport(parts, 0, len(prompt))))  # other blocks, other order
    got = target.forward(target.prepare(decode_step([7, 6, 5, 4])))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)

    # TP=1's export installs into TP=3 ranks (one head each).
    three = tp_ranks(model_dir, 3)
    run_step(three, decode_step([1, 2, 3, 4], KVImport(out.kv_parts[0], 0, len(prompt))), run=ModelRunner.execute)
    for logits in run_step(three, decode_step([1, 2, 3, 4])):
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
