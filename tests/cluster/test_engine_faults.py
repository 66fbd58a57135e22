"""A fault belongs to the request that caused it: one request's bad numbers, or a step that raises
because of one request, fail that request alone; the others finish with exactly their solo outputs."""

import pytest

from cluster import SamplingParams
from model import runner as runner_module
from model.sampler import sample

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# The victim is told apart by asking for 3 logprobs; nobody else does.
VICTIM = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
QUESTIONS = ["Name a color.", "What is 2 + 2?", "Say hi.", "Where is Paris?"]


def is_victim(row) -> bool:
    return row is not None and row.num_logprobs == 3


def run(engine, victim_at: int | None) -> dict[str, tuple[list[int], str | None, str | None]]:
    """Runs the four questions together (the victim among them at `victim_at`); returns
    request id -> (token ids, finish reason, error)."""
    results = {}
    for i, question in enumerate(QUESTIONS):
        params = VICTIM if i == victim_at else GREEDY
        engine.add_request(f"q{i}", engine.encode_prompt(messages=[{"role": "user", "content": question}]), params)
        results[f"q{i}"] = ([], None, None)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, _, _ = results[delta.request_id]
            results[delta.request_id] = (tokens + delta.new_token_ids, delta.finish_reason, delta.error)
    return results


@pytest.fixture
def solo(llm):
    return run(llm.engine, victim_at=None)


def test_nan_logits_of_one_request_fail_it_alone(llm, solo, monkeypatch):
    def poisoned_sample(logits, rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            if is_victim(row):
                logits[i, 5] = float("nan")
        return sample(logits, rows)

    monkeypatch.setattr(runner_module, "sample", poisoned_sample)
    results = run(llm.engine, victim_at=2)
    assert results["q2"] == ([], "error", "the model produced non-finite numbers (NaN or infinity) for this request")
    for request_id in ("q0", "q1", "q3"):
        assert results[request_id] == solo[request_id]
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert not llm.engine.is_broken


def test_a_step_that_raises_for_one_request_fails_that_request_alone(llm, solo, monkeypatch):
    execute = llm.engine.executor.execute
    calls = []

    def failing_execute(seqs):
        calls.append(len(seqs))
        if any(is_victim(s.sampling) for s in seqs):
            raise RuntimeError("a kernel fault of the test's")
        return execute(seqs)

    monkeypatch.setattr(llm.engine.executor, "execute", failing_execute)
    results = run(llm.engine, victim_at=1)
    assert results["q1"] == ([], "error", "the engine failed while running this request")
    for request_id in ("q0", "q2", "q3"):
        assert results[request_id] == solo[request_id]
    # the whole step, its retry, then halves down to the victim alone: [0..3], [0..3], [0 1] -> [0] [1], [2 3]
    assert calls[:6] == [4, 4, 2, 1, 1, 2]
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert not llm.engine.is_broken


def test_steps_that_fail_whatever_they_run_mark_the_engine_broken(llm, monkeypatch):
    def always_fails(seqs):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(llm.engine.executor, "execute", always_fails)
    engine = llm.engine
    for i in range(3):
        assert not engine.is_broken
        engine.add_request(f"b{i}", engine.encode_prompt("Hello"), GREEDY)
        deltas = engine.step()
        assert [(d.request_id, d.finish_reason) for d in deltas] == [(f"b{i}", "error")]
    assert engine.is_broken
    monkeypatch.undo()
    engine.add_request("ok", engine.encode_prompt("Hello"), GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.is_broken  # a step that works again clears it
    assert engine.num_free_blocks == engine.num_blocks
