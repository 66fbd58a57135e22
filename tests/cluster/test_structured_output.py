"""Structured output in the engine: greedy generation under a JSON schema equals HF transformers'
generate with the same xgrammar grammar (xgrammar's own HF logits processor), token for token; every
answer parses and validates; a schema xgrammar cannot compile is refused naming the field."""

from __future__ import annotations

import json
from importlib.metadata import version

import jsonschema
import pytest
import torch

from cluster import SamplingParams
from cluster.engine.errors import InvalidRequestError
from cluster.engine.structured_output import StructuredOutput
from tests.hf_reference import Reference, kept_on_disk

# Nested objects, enums, arrays, bounded strings and numbers: what a small model can finish in budget.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe a person as JSON.", "Invent a character who lives in Paris.", "Who is your favourite painter?"]


def chat(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def hf_greedy_under_grammar(hf_model, tokenizer, token_ids: list[int], schema: dict, max_new_tokens: int) -> list[int]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf_model.config.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([token_ids]), logits_processor=[xgr.contrib.hf.LogitsProcessor(grammar)],
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(token_ids):].tolist()


def test_greedy_under_a_schema_equals_hf_with_the_same_grammar(llm, model_dir, request):
    params = SamplingParams(max_tokens=120, temperature=0,
                            structured_output=StructuredOutput("json_schema", json.dumps(PERSON)))
    encoded = [llm.encode(messages=chat(q)) for q in QUESTIONS]
    prompts = [list(token_ids) for _, token_ids, _ in encoded]

    def hf_answers() -> list[Reference]:
        hf_model, tokenizer = request.getfixturevalue("hf_model"), request.getfixturevalue("tokenizer")
        return [Reference(hf_greedy_under_grammar(hf_model, tokenizer, ids, PERSON, 120), []) for ids in prompts]

    expected = kept_on_disk(model_dir, ["under a JSON schema", version("xgrammar"), PERSON, prompts, 120], hf_answers)
    outputs = llm.run(encoded, params)
    for output, hf in zip(outputs, expected):
        ours = output.outputs[0]
        assert ours.finish_reason == "stop", ours.text
        jsonschema.validate(json.loads(ours.text), PERSON)
        assert ours.token_ids == hf.token_ids


def test_sampled_answers_all_validate(llm):
    params = SamplingParams(n=4, max_tokens=160, temperature=1.0, seed=3,
                            structured_output=StructuredOutput("json_schema", json.dumps(PERSON)))
    [output] = llm.run([llm.encode(messages=chat("Make up a person."))], params)
    for candidate in output.outputs:
        assert candidate.finish_reason == "stop", candidate.text
        jsonschema.validate(json.loads(candidate.text), PERSON)
    assert len({c.text for c in output.outputs}) > 1


def test_json_object_is_an_object(llm):
    params = SamplingParams(max_tokens=80, temperature=0, structured_output=StructuredOutput("json_object"))
    [output] = llm.run([llm.encode(messages=chat("Give me a JSON object about cats."))], params)
    answer = output.outputs[0]
    assert answer.finish_reason in ("stop", "length")
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.text), dict)
    else:
        assert answer.text.startswith("{")


@pytest.mark.parametrize("schema, problem", [
    ("{not json", "cannot be compiled"),
    (json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "cannot be compiled"),
])
def test_a_schema_that_cannot_compile_is_refused_naming_the_field(llm, schema, problem):
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput("json_schema", schema))
    with pytest.raises(InvalidRequestError, match=problem) as refused:
        llm.run([llm.encode(messages=chat("Hi"))], params)
    assert refused.value.field == "response_format.json_schema"
    assert llm.engine.num_free_blocks == llm.engine.num_blocks  # nothing was admitted


def test_an_unresolvable_reference_is_refused_without_the_compilers_source_location(llm):
    schema = json.dumps({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}})
    params = SamplingParams(max_tokens=8, structured_output=StructuredOutput("json_schema", schema))
    with pytest.raises(InvalidRequestError) as refused:
        llm.run([llm.encode(messages=chat("Hi"))], params)
    assert "$defs" in str(refused.value) and ".cc" not in str(refused.value) and "/project" not in str(refused.value)


def test_a_forced_call_of_tools_with_nested_models_follows_their_references(llm):
    """What openai.pydantic_function_tool (and instructor's TOOLS mode) sends for a nested model
    or an enum: parameters with `$defs` and `$ref`s into them."""
    import enum

    import openai
    import pydantic

    from cluster.serve.tools import forced_call

    class Unit(str, enum.Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Place(pydantic.BaseModel):
        city: str
        country: str

    class Weather(pydantic.BaseModel):
        place: Place
        unit: Unit

    class Visit(pydantic.BaseModel):
        place: Place
        days: int

    tools = [openai.pydantic_function_tool(Weather), openai.pydantic_function_tool(Visit)]
    prompt = llm.encode(messages=chat("What is the weather in Paris, France, in celsius?"))
    for choice in ({"type": "function", "function": {"name": "Weather"}}, "required"):
        params = SamplingParams(max_tokens=96, temperature=0, structured_output=forced_call(tools, choice))
        [answer] = llm.run([prompt], params)
        assert answer.outputs[0].finish_reason == "stop", answer.outputs[0].text
        call = json.loads(answer.outputs[0].text)
        {"Weather": Weather, "Visit": Visit}[call["name"]].model_validate(call["arguments"])
