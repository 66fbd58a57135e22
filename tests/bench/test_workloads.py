"""Workloads are reproducible and shaped as asked."""

import json

import pytest

from cluster.bench.bench import level_workload
from cluster.bench.workloads import WorkloadSpec, build


def test_random_lengths_stay_in_range_and_repeat_with_the_seed(tokenizer):
    spec = WorkloadSpec("random", num_prompts=20, input_len=100, output_len=40, range_ratio=0.5, seed=3)
    requests = build(spec, tokenizer)
    assert requests == build(spec, tokenizer)
    assert all(20 <= r.max_tokens <= 60 for r in requests) and len({r.max_tokens for r in requests}) > 1
    assert all(r.prompt and r.messages is None for r in requests)


def test_docqa_asks_two_questions_of_each_document_cut_to_input_len(tokenizer):
    requests = build(WorkloadSpec("docqa", num_prompts=4, input_len=300), tokenizer)
    documents = [r.messages[0]["content"].rsplit("\n\n", 1) for r in requests]
    assert documents[0][0] == documents[1][0] != documents[2][0] == documents[3][0]  # shared prefix: cacheable
    assert documents[0][1] != documents[1][1]
    assert all(len(tokenizer(d).input_ids) <= 310 for d, _ in documents)


def test_chat_has_follow_up_turns_and_file_cycles_its_records(tokenizer, tmp_path):
    chat = build(WorkloadSpec("chat", num_prompts=3, turns=3), tokenizer)
    assert all(len(r.follow_ups) == 2 and r.messages[0]["role"] == "user" for r in chat)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a", "max_tokens": 5}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "b"}]}) + "\n")
    records = build(WorkloadSpec("file", num_prompts=3, output_len=9, prompts_file=str(path)), tokenizer)
    assert [(r.prompt, r.max_tokens) for r in records] == [("a", 5), (None, 9), ("a", 5)]


def test_probe_codes_are_unique(tokenizer):
    probes = build(WorkloadSpec("probe", num_prompts=64), tokenizer)
    assert len({p.expected for p in probes}) == 64 and all(p.prompt.endswith("Copy:") for p in probes)


@pytest.mark.parametrize("spec, message", [(WorkloadSpec("poem"), "--workload"), (WorkloadSpec(range_ratio=1.0), "--range-ratio")])
def test_bad_specs_are_clear_errors(tokenizer, spec, message):
    with pytest.raises(ValueError, match=message):
        build(spec, tokenizer)


def test_each_level_of_a_run_sends_prompts_of_its_own(tokenizer):
    """A 64-stream level after a 32-stream one must not find the 32's prompts in a server's prefix
    cache: each level's prompts are new, the first level's those of the spec's own seed."""
    spec = WorkloadSpec("random", num_prompts=64, input_len=64, output_len=8)
    first, second = (build(level_workload(spec, index), tokenizer) for index in (0, 1))
    assert [r.prompt for r in first] == [r.prompt for r in build(spec, tokenizer)]
    assert not {r.prompt for r in first} & {r.prompt for r in second}
