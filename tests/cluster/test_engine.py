"""Engine behaviour on the real default model: block accounting, sampling options, errors."""

import math

import pytest
import torch

from cluster import LLM, InvalidRequestError, SamplingParams
from model.config import UnsupportedModelError

CHAT = [{"role": "user", "content": "Tell me a short story about a robot."}]


def test_pool_returns_to_free_count_after_finished_aborted_and_preempted(model_dir):
    llm = LLM(model_dir, num_blocks=14)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", engine.encode_prompt(messages=[{"role": "user", "content": f"Count to {i + 5}."}]), params)
    finished = set()
    for step in range(400):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            if delta.finished:
                finished.add(delta.request_id)
        if step == 25:
            assert engine.abort_request("r0")  # running
            assert engine.abort_request("r5")  # still waiting or running
        assert engine.num_free_blocks <= engine.num_blocks
    assert engine.stats().num_preemptions > 0
    assert finished == {"r1", "r2", "r3", "r4"}
    assert not engine.abort_request("r1")  # already finished
    assert engine.num_free_blocks == engine.num_blocks == 14


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    first = llm.chat(CHAT, params)[0].outputs[0].token_ids
    again = llm.chat(CHAT, params)[0].outputs[0].token_ids
    other = llm.chat(CHAT, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))[0].outputs[0].token_ids
    assert first == again
    assert first != other


def test_n_gives_distinct_candidates(llm):
    out = llm.chat(CHAT, SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=5))[0]
    assert [o.index for o in out.outputs] == [0, 1]
    assert all(len(o.token_ids) > 0 for o in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids


def test_stop_string_cuts_exactly(llm):
    full = llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    stop = full.text[20:26]
    cut = full.text[: full.text.index(stop)]
    out = llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0].outputs[0]
    assert out.text == cut
    assert out.finish_reason == "stop"


def test_stop_token_ids_max_tokens_and_ignore_eos(llm):
    full = llm.chat(CHAT, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0]
    out = llm.chat(CHAT, SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[full.token_ids[3]]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[3]) + 1]
    assert out.finish_reason == "stop"
    short = llm.chat(CHAT, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    natural = llm.chat(capital, SamplingParams(max_tokens=30, temperature=0))[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == 2
    forced = llm.chat(capital, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0]
    assert len(forced.token_ids) == 30 and forced.finish_reason == "length"


def test_text_is_the_decoded_tokens_and_answers_sensibly(llm, tokenizer):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=30, temperature=0))[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


def test_logprobs_match_hf_log_softmax(llm, hf_model):
    out = llm.chat(CHAT, SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0]
    completion = out.outputs[0]
    ids = torch.tensor([out.prompt_token_ids + completion.token_ids])
    with torch.inference_mode():
        logits = hf_model(ids).logits[0].float()
    reference = torch.log_softmax(logits[len(out.prompt_token_ids) - 1 : -1], dim=-1)
    assert len(completion.logprobs) == len(completion.token_ids)
    for step, (token, lp) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert abs(lp.logprob - reference[step, token].item()) < 1e-4
        top_values, top_ids = reference[step].topk(5)
        assert [t for t, _ in lp.top] == top_ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top_values.tolist())) < 1e-4


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(params, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**params)
    assert err.value.field == field


def test_bad_prompts_name_the_field(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="prompt: must not be empty"):
        engine.encode_prompt("")
    with pytest.raises(InvalidRequestError) as err:
        engine.encode_prompt("hello " * 9000)
    assert err.value.field == "prompt" and "context" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        engine.encode_prompt([1, 2, 10**9])
    assert err.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as err:
        engine.encode_prompt(messages=[{"role": "wizard", "content": "hi"}])
    assert err.value.field == "messages[0].role"
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", [], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_unsupported_model_directories_are_refused(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        LLM(str(tmp_path))
