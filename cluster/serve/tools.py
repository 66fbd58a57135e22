"""Tool calling (OpenAI `tools` / `tool_choice`): the tools reach the model through its chat
template, a forced call is generated under a JSON schema (structured output), and the answer is
parsed back into `tool_calls`.

    tool_choice "none"      the tools are not offered; plain text
                "auto"      offered; the answer is a tool call if it parses as one, else text
                "required"  offered; the answer is a call of one of them: {"name", "arguments"}
                {"type": "function", "function": {"name": N}}   a call of N

A template that knows tools (it reads a `tools` variable) is given them; one that does not (the
default model's) gets them described in the system message, with the JSON form of a call.
"""

from __future__ import annotations

import json
import re
import uuid

from cluster.engine.errors import InvalidRequestError
from cluster.engine.structured_output import StructuredOutput

TOOL_CALL_TAGS = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def forced_call(tools: list[dict], tool_choice) -> StructuredOutput | None:
    """The structured output that makes the answer a call, for "required" or a named function."""
    if tool_choice == "required":
        schemas = [_call_schema(tool) for tool in tools]
        if len(schemas) == 1:
            return StructuredOutput("json_schema", json.dumps(schemas[0]), field="tool_choice")
        definitions = {name: value for schema in schemas for name, value in schema.pop("$defs", {}).items()}
        either = {"anyOf": schemas, **({"$defs": definitions} if definitions else {})}
        return StructuredOutput("json_schema", json.dumps(either), field="tool_choice")
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
        if not chosen:
            raise InvalidRequestError("tool_choice", f"names the function {name!r}, which is not in tools")
        return StructuredOutput("json_schema", json.dumps(_call_schema(chosen[0])), field="tool_choice")
    return None


def _call_schema(tool: dict) -> dict:
    """{"name": N, "arguments": <the parameters' schema>}. The parameters' own definitions
    (`$defs`, or draft 7's `definitions`: what pydantic writes for any nested model or enum) move
    to the wrapper's root, where their `$ref`s ("#/$defs/X") point, renamed per function so that
    the calls of several functions (tool_choice "required") keep theirs apart."""
    function = tool["function"]
    parameters = dict(function.get("parameters") or {"type": "object"})
    definitions = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
    prefix = f"{function['name']}."
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": function["name"]}, "arguments": _renamed_refs(parameters, prefix)}}
    if definitions:
        schema["$defs"] = {prefix + name: _renamed_refs(value, prefix) for name, value in definitions.items()}
    return schema


def _renamed_refs(schema, prefix: str):
    """The schema with each reference to a definition pointing at its hoisted, renamed copy."""
    if isinstance(schema, list):
        return [_renamed_refs(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    renamed = {key: _renamed_refs(value, prefix) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str):
        for root in ("#/$defs/", "#/definitions/"):
            if ref.startswith(root):
                renamed["$ref"] = "#/$defs/" + prefix + ref[len(root):]
    return renamed


def offer_tools(messages: list[dict], tools: list[dict], template_knows_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template): a template that knows tools gets them (and the earlier
    calls as they are); another gets them described in the system message, and the earlier calls
    written as the model would write them."""
    if template_knows_tools:
        return messages, tools
    messages = calls_as_text(messages)
    described = ("You can call these functions. To call one, answer with only a JSON object "
                 '{"name": <function name>, "arguments": <its arguments>}.\n'
                 + "\n".join(json.dumps(tool["function"]) for tool in tools))
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + described}, *messages[1:]], None
    return [{"role": "system", "content": described}, *messages], None


def calls_as_text(messages: list[dict]) -> list[dict]:
    """Assistant messages of earlier calls, for a template without tools: each call written as the
    model is asked to write one, {"name", "arguments"}."""
    written = []
    for message in messages:
        calls = message.get("tool_calls")
        message = {key: value for key, value in message.items() if key != "tool_calls"}
        if calls and not message.get("content"):
            message["content"] = "\n".join(json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                                           for c in calls)
        written.append(message)
    return written


def parse_tool_calls(text: str, tools: list[dict]) -> list[dict] | None:
    """OpenAI tool_calls from an answer that is one call (or several, in <tool_call> tags) of the
    offered functions; None when it is not."""
    names = {tool["function"]["name"] for tool in tools}
    pieces = TOOL_CALL_TAGS.findall(text) or [text]
    calls = []
    for piece in pieces:
        try:
            call = json.loads(piece)
        except json.JSONDecodeError:
            return None
        if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict)):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    return calls
