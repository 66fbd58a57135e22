"""Hostile input against the real server: every bad request gets its 4xx / INVALID_ARGUMENT naming
the problem (never a 5xx, INTERNAL or UNKNOWN, a traceback or a class name), while 4 benign streams
running beside it finish with exactly their solo outputs, and every block is free afterwards."""

import json
import threading

import grpc
import pytest
import requests

from cluster import SamplingParams
from protos import inference_pb2 as pb
from tests.cluster.test_serving import chat_request, collect, engine_stats, wait_idle
from tests.parity_prompts import CHAT_QUESTIONS

BENIGN = dict(max_tokens=12, temperature=0, ignore_eos=True)  # still running while a bad request is answered
LEAKS = ("Traceback", "Error'>", "<class", 'File "')


@pytest.fixture(scope="module")
def solo_answers(llm):
    outputs = llm.chat([[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:4]], SamplingParams(**BENIGN))
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture
def beside(server, stub, solo_answers):
    """Runs `send()` while 4 benign gRPC streams are generating; checks their outputs and that
    every block is free afterwards; returns what send() returned."""

    def run(send):
        started = [threading.Event() for _ in range(4)]
        results = [None] * 4

        def stream(i):
            token_ids = []
            for r in stub.Generate(chat_request(CHAT_QUESTIONS[i], **BENIGN)):
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
        stats = wait_idle(server, 10)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
        return outcome

    return run


def post(server, path, body=None, data=None, headers=None, method="POST"):
    r = requests.request(method, f"{server['http']}{path}", json=body, data=data, headers=headers, timeout=60)
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
def test_http_bad_input_is_refused_and_hurts_no_one_beside_it(server, beside, path, raw, status, param, says):
    r = beside(lambda: post(server, path, data=raw, headers={"content-type": "application/json"}))
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
def test_http_errors_of_the_framework_are_openai_error_json(server, beside, method, path, headers, status):
    r = beside(lambda: post(server, path, data=b'{"prompt": "hi"}', headers=headers, method=method))
    assert r.status_code == status
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_a_vanishing_temperature_is_greedy_and_hurts_no_one(server, beside, llm, temperature):
    r = beside(lambda: post(server, COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 8,
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


@pytest.mark.parametrize(
    "payload, details",
    [
        (b"\xff\xff\xff\xff", "not a valid pagoda.v1.GenerateRequest message"),
        (b"\x0a\x02\xff\xfe", "not a valid pagoda.v1.GenerateRequest message"),  # prompt: invalid UTF-8
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(n=10000)).SerializeToString(), "n: is 10000"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=10**9)).SerializeToString(), "max_tokens"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(stop=["s"] * 17)).SerializeToString(), "stop"),
    ],
)
def test_grpc_bad_messages_are_invalid_argument_and_hurt_no_one(server, beside, payload, details):
    def send():
        with pytest.raises(grpc.RpcError) as error:
            raw_generate(server, payload)
        return error.value

    error = beside(send)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert details in error.details() and not any(leak in error.details() for leak in LEAKS)


def test_grpc_vanishing_temperature_is_greedy(server, stub, beside, llm):
    request = pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=8, temperature=1e-40))
    text, _, finish = beside(lambda: collect(stub.Generate(request)))
    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
    assert (text, finish) == (greedy, "length")
    assert engine_stats(server)["num_running"] == 0
