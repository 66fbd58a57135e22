"""Hostile input against the serving front: every bad request gets its 4xx / INVALID_ARGUMENT naming
the problem (never a 5xx, INTERNAL or UNKNOWN, a traceback or a class name), while 4 benign streams
running beside it finish with exactly their solo outputs, and every block is free afterwards.

The requests go to the Ingress with its engine in this process (tests/in_process_ingress.py): the
pipeline, both adapters and the engine as a replica runs them. What only the real server sees,
bytes that are no protobuf message at all (Serve's gRPC proxy parses them), goes to the session's
server."""

import json
import threading
import time

import grpc
import pytest

from cluster import SamplingParams
from protos import inference_pb2 as pb
from tests.cluster.test_serving import chat_request, engine_stats
from tests.in_process_ingress import GrpcError
from tests.parity_prompts import CHAT_QUESTIONS

BENIGN = dict(max_tokens=12, temperature=0, ignore_eos=True)  # still running while a bad request is answered
LEAKS = ("Traceback", "Error'>", "<class", 'File "')


@pytest.fixture(scope="module")
def solo_answers(llm):
    outputs = llm.chat([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:4]], SamplingParams(**BENIGN))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def beside(ingress, solo_answers):
    """Runs `send()` while 4 benign gRPC streams are generating; checks their outputs and that
    every block is free afterwards; returns what send() returned."""

    def run(send):
        started = [threading.Event() for _ in range(4)]
        results = [None] * 4

        def stream(i):
            token_ids = []
            for r in ingress.grpc_stream("Generate", chat_request(CHAT_QUESTIONS[i], **BENIGN)):
                token_ids += r.token_ids
                started[i].set()
            results[i] = token_ids

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for event in started:
            assert event.wait(120)
        outcome = send()
        for t in threads:
            t.join(120)
        assert results == solo_answers, "a benign stream beside the bad request changed"
        stats = idle_stats(ingress)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
        return outcome

    return run


def idle_stats(ingress, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ingress.http.get("/v1/pagoda/stats").json()
        if (stats["num_running"], stats["num_waiting"]) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def post(ingress, path, body=None, data=None, headers=None, method="POST"):
    r = ingress.http.request(method, path, json=body, content=data, headers=headers)
    assert not any(leak in r.text for leak in LEAKS), r.text
    return r


NESTED = ("[" * 100_000 + "]" * 100_000).encode()
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    "path, raw, status, param, says",
    [
        (COMPLETIONS, '{"prompt": "hi \\ud800 there"}', 400, "prompt", "not valid Unicode"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi \\udfff"}]}', 400, "messages[0].content", "not valid Unicode"),
        (CHAT, NESTED, 400, "body", "nested deeper than"),
        (CHAT, '{"messages": [{"role": "user", "content": "x"}], "nested": ' + "[" * 40 + "]" * 40 + "}", 400, "body", "nested deeper than 32"),
        (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "n": 10000}', 400, "n", "at most 16"),
        (COMPLETIONS, '{"prompt": "hi", "max_tokens": 1000000000000}', 400, "max_tokens", "max_tokens is 1000000000000"),
        (COMPLETIONS, '{"prompt": "hi", "max_tokens": 18446744073709551616}', 400, "max_tokens", "tokens do not fit the context of"),
        (COMPLETIONS, '{"prompt": "hi", "temperature": NaN}', 400, "temperature", "finite"),
        (COMPLETIONS, '{"prompt": "hi", "temperature": Infinity}', 400, "temperature", "finite"),
        (COMPLETIONS, json.dumps({"prompt": "hi", "stop": ["s"] * 17}), 400, "stop", "at most 16"),
        (COMPLETIONS, json.dumps({"prompt": "hi", "stop": ["s" * 257]}), 400, "stop", "longer than 256"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}] * 513}), 400, "messages", "at most 512"),
        (COMPLETIONS, json.dumps({"prompt": "word " * 200_000}), 400, "prompt", "characters, more than a context"),
        (COMPLETIONS, json.dumps({"prompt": "x" * (5 << 20)}), 413, None, "the cap is 4194304 bytes"),
        (COMPLETIONS, "{not json", 400, "body", "not valid JSON"),
        (CHAT, json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "segment": "document"}]}]}),
         400, "messages[0].content[0].segment", "not a field of a content part"),
        (COMPLETIONS, json.dumps({"model": "gpt-4o", "prompt": "hi"}), 404, "model", "'gpt-4o' does not exist"),
    ],
)
def test_http_bad_input_is_refused_and_hurts_no_one_beside_it(ingress, beside, path, raw, status, param, says):
    r = beside(lambda: post(ingress, path, data=raw, headers={"content-type": "application/json"}))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(
    "method, path, headers, status",
    [
        ("GET", COMPLETIONS, None, 405),
        ("POST", "/v1/no-such-route", None, 404),
        ("POST", COMPLETIONS, {"content-type": "multipart/form-data; boundary=x"}, 415),
    ],
)
def test_http_errors_of_the_framework_are_openai_error_json(ingress, beside, method, path, headers, status):
    r = beside(lambda: post(ingress, path, data=b'{"prompt": "hi"}', headers=headers, method=method))
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_vanishing_temperature_is_greedy_and_hurts_no_one(ingress, beside, llm, temperature):
    r = beside(lambda: post(ingress, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8,
                                                  "temperature": temperature}))
    assert r.status_code == 200, r.text
    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == greedy


def raw_generate(server, payload: bytes):
    channel = grpc.insecure_channel(server["grpc"])
    try:
        call = channel.unary_stream("/pagoda.v1.Inference/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
        return list(call(payload, timeout=60))
    finally:
        channel.close()


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x02\xff\xfe"], ids=["no message", "prompt not UTF-8"])
def test_grpc_bytes_that_do_not_parse_are_invalid_argument(server, payload):
    with pytest.raises(grpc.RpcError) as error:
        raw_generate(server, payload)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value
    details = error.value.details()
    assert "not a valid pagoda.v1.GenerateRequest message" in details and not any(leak in details for leak in LEAKS)
    assert engine_stats(server)["num_running"] == 0


@pytest.mark.parametrize(
    "sampling, details",
    [(pb.SamplingParams(n=10000), "n: is 10000"), (pb.SamplingParams(max_tokens=10**9), "max_tokens"),
     (pb.SamplingParams(stop=["s"] * 17), "stop")],
    ids=["n", "max_tokens", "stop"],
)
def test_grpc_bad_messages_are_invalid_argument_and_hurt_no_one(ingress, beside, sampling, details):
    def send():
        with pytest.raises(GrpcError) as error:
            ingress.grpc("Generate", pb.GenerateRequest(prompt="hi", sampling=sampling))
        return error.value

    error = beside(send)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
    assert details in error.details and not any(leak in error.details for leak in LEAKS)


def test_grpc_vanishing_temperature_is_greedy(ingress, beside, llm):
    request = pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=8, temperature=1e-40))
    messages = beside(lambda: ingress.grpc("Generate", request))
    text, finish = "".join(m.text for m in messages), messages[-1].finish_reason
    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert (text, finish) == (greedy, "length")
