"""Tool calling's pieces on their own: the schema a forced call is generated under, the answer
parsed back into OpenAI tool_calls, earlier calls written for a template that has no tools."""

import json

import jsonschema
import pytest

from cluster.engine.errors import InvalidRequestError
from cluster.serve.tools import calls_as_text, forced_call, offer_tools, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_a_named_or_required_call_is_held_to_its_schema():
    named = json.loads(forced_call([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}).json_schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, named)
    for wrong in ({"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, named)
    required = json.loads(forced_call([WEATHER, TIME], "required").json_schema)
    jsonschema.validate({"name": "get_time", "arguments": {}}, required)
    assert forced_call([WEATHER], "auto") is None
    with pytest.raises(InvalidRequestError, match="nope"):
        forced_call([WEATHER], {"type": "function", "function": {"name": "nope"}})


def test_answers_that_are_calls_become_tool_calls():
    [call] = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}', [WEATHER])
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    tagged = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather"}</tool_call>'
    assert [c["function"]["name"] for c in parse_tool_calls(tagged, [WEATHER, TIME])] == ["get_time", "get_weather"]
    for text in ("It is sunny.", '{"name": "unknown", "arguments": {}}', '{"name": "get_time", "arguments": 3}'):
        assert parse_tool_calls(text, [WEATHER, TIME]) is None


def test_a_template_without_tools_gets_them_described_and_earlier_calls_written():
    earlier = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    messages, template_tools = offer_tools([{"role": "user", "content": "Weather?"}, earlier], [WEATHER], False)
    assert template_tools is None and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert "tool_calls" not in messages[2]
    assert offer_tools([earlier], [WEATHER], True) == ([earlier], [WEATHER])
    assert calls_as_text([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
