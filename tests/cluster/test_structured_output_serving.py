"""Structured output and tool calls served, with the official openai client: 32 concurrent requests
under a JSON schema all parse and validate, a tool call round trip, the same over gRPC, and a schema that
cannot compile is 400 / INVALID_ARGUMENT naming the field. The client talks to the Ingress with its
engine in this process (tests/in_process_ingress.py), the pipeline and adapters a replica runs:
what is asserted here is the front's and the engine's, not Ray's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI

from protos import inference_pb2 as pb
from tests.cluster.test_structured_output import PERSON
from tests.in_process_ingress import GrpcError

# Nested object, enums, an array, a bounded integer and a boolean, in ~30 tokens.
ANIMAL = {
    "type": "object", "additionalProperties": False, "required": ["animal", "size", "tags", "friendly"],
    "properties": {
        "animal": {"enum": ["cat", "dog", "owl", "fox"]},
        "size": {"type": "object", "additionalProperties": False, "required": ["weight_kg", "legs"],
                 "properties": {"weight_kg": {"type": "integer", "minimum": 0, "maximum": 99}, "legs": {"enum": [0, 2, 4]}}},
        "tags": {"type": "array", "items": {"enum": ["wild", "pet", "night", "fast"]}, "maxItems": 3},
        "friendly": {"type": "boolean"},
    },
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}


@pytest.fixture(scope="module")
def client(ingress):
    return OpenAI(base_url=f"{ingress.http.base_url}/v1", http_client=ingress.http, api_key="unused", max_retries=0,
                  timeout=300)


@pytest.fixture(scope="module")
def served(ingress):
    """What the server calls its model (`model` in each request)."""
    return {"model": ingress.http.get("/v1/models").json()["data"][0]["id"]}


def test_concurrent_requests_under_a_schema_all_validate(client, served):
    """Two full batches of 16, sampled: every answer parses and validates (a benchmark's hundreds
    would assert nothing more: 100 took 97 s of the suite)."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "animal", "schema": ANIMAL, "strict": True}}

    def ask(i: int) -> str:
        answer = client.chat.completions.create(
            model=served["model"], messages=[{"role": "user", "content": f"Describe animal number {i} as JSON."}],
            response_format=schema_format, max_tokens=80, temperature=1.0, seed=i)
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        return answer.choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(32)))
    for text in answers:
        jsonschema.validate(json.loads(text), ANIMAL)
    assert len(set(answers)) > 20  # sampled, seeded apart


def test_a_schema_that_cannot_compile_is_refused_naming_the_field(client, served):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served["model"], messages=[{"role": "user", "content": "Hi"}],
                                       response_format=bad, max_tokens=8)
    assert refused.value.status_code == 400 and refused.value.body["param"] == "response_format.json_schema"
    with pytest.raises(openai.BadRequestError):  # a json_schema without its schema
        client.chat.completions.create(model=served["model"], messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_a_tool_call_round_trip(client, served):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model=served["model"], messages=messages, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    second = client.chat.completions.create(model=served["model"], messages=messages, tools=[WEATHER],
                                            max_tokens=30, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    required = client.chat.completions.create(model=served["model"], messages=messages[:1], tools=[WEATHER],
                                              tool_choice="required", max_tokens=60, temperature=0)
    assert required.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=served["model"], messages=messages[:1], tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert refused.value.body["param"] == "tool_choice"


def test_grpc_response_format(ingress):
    request = pb.GenerateRequest(
        messages=[pb.Message(role="user", parts=[pb.Part(text="Describe a person.")])],
        sampling=pb.SamplingParams(max_tokens=160, temperature=0),
        response_format=pb.ResponseFormat(type="json_schema", json_schema=json.dumps(PERSON)))
    responses = ingress.grpc("Generate", request)
    assert responses[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(r.text for r in responses)), PERSON)
    bad = pb.GenerateRequest(prompt="Hi", response_format=pb.ResponseFormat(type="json_schema", json_schema="{"))
    with pytest.raises(GrpcError) as refused:
        ingress.grpc("Generate", bad)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format.json_schema" in refused.value.details
