"""The request pipeline behind both adapters, with its engine in process (no Ray): a served
prompt is checked once, whatever its wire; the two wires answer alike."""

from __future__ import annotations

import pytest

from cluster.engine.prompt import PromptEncoder
from protos import inference_pb2 as pb
from tests.in_process_ingress import GrpcError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def checks(monkeypatch):
    """Counts PromptEncoder.check calls, the ingress's and the engine's alike (one process)."""
    calls = []
    check = PromptEncoder.check
    monkeypatch.setattr(PromptEncoder, "check", lambda self, *args, **kwargs: calls.append(args) or check(self, *args, **kwargs))
    return calls


def test_a_served_prompt_is_checked_once(ingress, checks):
    answer = ingress.http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert len(checks) == 1
    answer = ingress.http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert len(checks) == 2
    messages = ingress.grpc("Generate", pb.GenerateRequest(prompt="The capital of France is",
                                                           sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
    assert sum(len(m.token_ids) for m in messages) == 4
    assert len(checks) == 3


def test_both_wires_give_the_same_greedy_answer(ingress):
    prompt = "The capital of France is"
    http = ingress.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0}).json()
    messages = ingress.grpc("Generate", pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=8, temperature=0)))
    assert "".join(m.text for m in messages) == http["choices"][0]["text"]
    assert messages[-1].finish_reason == http["choices"][0]["finish_reason"] == "length"


def test_errors_come_from_one_table_on_both_wires(ingress):
    http = ingress.http.post("/v1/completions", json={"prompt": "hi", "n": 1000})
    assert http.status_code == 400 and http.json()["error"]["param"] == "n"
    with pytest.raises(GrpcError) as refused:
        ingress.grpc("Generate", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=1000)))
    assert refused.value.code.name == "INVALID_ARGUMENT" and refused.value.details.startswith("n: is 1000")
    unknown = ingress.http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_request_that_fails_before_its_first_token_is_counted_out_once(ingress):
    """The engine refuses it (a schema that cannot compile, found when the engine adds it): the
    drain's count of requests in flight is back to 0, not below (a drain would wait for it)."""
    pipeline = ingress.ingress.pipeline
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}
    refused = ingress.http.post("/v1/chat/completions", json={
        "messages": QUESTION, "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert refused.status_code == 400, refused.text
    assert pipeline.num_in_flight == 0 and pipeline.num_pending_requests == 0


def test_a_stopped_served_model_ends_its_tokenizer_thread():
    """The pipeline's stop (a replica's end) ends the thread that tokenizes its prompts: an
    Ingress made and dropped in one process (in-process ingresses, tests) leaves none behind."""
    import concurrent.futures
    import threading

    from cluster.serve.served_model import ServedModel

    thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
    model = ServedModel("m", {}, None, None, None, False, thread)
    worker = thread.submit(threading.current_thread).result()
    assert worker.is_alive()
    model.close()
    worker.join(10)
    assert not worker.is_alive()
