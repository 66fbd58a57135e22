"""OpenAI's wire format: request models (validated with pydantic at the edge) and response
builders. Nothing outside cluster/serve sees these shapes."""

from __future__ import annotations

import base64
import binascii
import json
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media_prompt import message_content
from cluster.engine.outputs import RequestDelta
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_output import StructuredOutput
from cluster.serve.ledger import RequestMeter
from cluster.serve.tools import parse_tool_calls


# OpenAI / vLLM fields that change what is generated and that Pagoda does not do (yet): a request
# that sets one to anything but its no-op value is refused naming it, not answered as if it had not.
UNSUPPORTED_FIELDS = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {}, "min_p": 0,
    "min_tokens": 0, "best_of": 1, "echo": False, "suffix": None, "functions": None, "function_call": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None, "prompt_logprobs": None,
    "parallel_tool_calls": True,
}


def refuse_unsupported(body) -> None:
    """400 naming the first field of UNSUPPORTED_FIELDS set to something other than its no-op."""
    if not isinstance(body, dict):
        return
    for name, no_op in UNSUPPORTED_FIELDS.items():
        if name in body and body[name] is not None and body[name] != no_op:
            raise InvalidRequestError(name, "is not supported by this server; leave it out")


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured_output(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required for type json_schema")
        return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class _CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, description="tokens to generate; default 16 (completions) or up to the context (chat)")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(0, description="vLLM extension: 0 or -1 for no limit")
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, description="vLLM extension: KV is shared only among requests with the same salt")
    response_format: ResponseFormat | None = None
    request_id: str | None = Field(None, description="vLLM extension: the client's id of the request (scoped by tenant); "
                                   "default: the X-Request-Id header, else one the server makes")


class CompletionRequest(_CommonRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, description="top alternatives per token, 0..20")


class ImageURL(BaseModel):
    url: str  # a data: URL; the server fetches nothing from the network
    detail: str | None = None


class InputAudio(BaseModel):
    data: str  # base64
    format: str


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be refused by name (chat_messages), not dropped

    type: Literal["text", "image_url", "input_audio"]
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = "{}"  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: str
    content: str | list[ChatContentPart] | None = ""
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None


def chat_messages(request: ChatCompletionRequest) -> list[dict]:
    """Messages as the engine takes them: content is the text, or, when a message holds an image
    or audio part, its parts in order (media decoded from base64, with the field it came from)."""
    messages = []
    for i, m in enumerate(request.messages):
        if not isinstance(m.content, list):
            messages.append({"role": m.role, "content": m.content or ""}
                            | ({"tool_calls": [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls)]}
                               if m.tool_calls else {}))
            continue
        parts = [_content_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(m.content)]
        messages.append({"role": m.role, "content": message_content(parts)})
    return messages


def _call(call: ToolCall, where: str) -> dict:
    """An earlier call as HF chat templates take it (arguments an object, not JSON text)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        raise InvalidRequestError(f"{where}.function.arguments", "must be JSON text") from None
    return {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _content_part(part: ChatContentPart, where: str) -> dict:
    for name in part.model_extra or ():
        raise InvalidRequestError(f"{where}.{name}", "is not a field of a content part; leave it out")
    if part.type == "text":
        return {"type": "text", "text": part.text or ""}
    if part.type == "image_url":
        if part.image_url is None:
            raise InvalidRequestError(f"{where}.image_url", "is missing")
        url = part.image_url.url
        if not url.startswith("data:"):
            raise InvalidRequestError(f"{where}.image_url.url", "must be a data: URL (data:image/png;base64,...); "
                                      "this server fetches nothing from the network")
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise InvalidRequestError(f"{where}.image_url.url", "must be a base64 data: URL (data:image/png;base64,...)")
        return {"type": "image", "data": _base64(payload, f"{where}.image_url.url"), "where": f"{where}.image_url"}
    if part.input_audio is None:
        raise InvalidRequestError(f"{where}.input_audio", "is missing")
    if part.input_audio.format.lower() not in ("wav", "flac"):
        raise InvalidRequestError(f"{where}.input_audio.format", f"is {part.input_audio.format!r}; taken: wav, flac")
    return {"type": "audio", "data": _base64(part.input_audio.data, f"{where}.input_audio.data"),
            "where": f"{where}.input_audio"}


def _base64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(where, "is not valid base64") from None


def openai_sampling_params(request: _CommonRequest, default_max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """default_max_tokens None: until the context is full."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    return SamplingParams(
        n=request.n,
        max_tokens=request.max_tokens if request.max_tokens is not None else default_max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=stop,
        stop_token_ids=list(request.stop_token_ids or []),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        structured_output=request.response_format.structured_output() if request.response_format else None,
    )


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(meter: RequestMeter) -> dict:
    """OpenAI's usage, plus the compute units the request was charged (and the most it could
    have been, when a tenant's cap or budget lowered its max_tokens)."""
    counted = meter.usage
    extra = {"compute_units_limit": meter.units_limit} if meter.units_limit is not None else {}
    return {
        "prompt_tokens": counted.prompt_tokens,
        "completion_tokens": counted.output_tokens,
        "total_tokens": counted.prompt_tokens + counted.output_tokens,
        "prompt_tokens_details": {"cached_tokens": counted.cached_tokens},
        "compute_units": meter.compute_units,
        **extra,
    }


class ResponseBuilder:
    """Accumulates deltas for the non-streaming answer and shapes streaming chunks. The two APIs
    share everything but the shapes of a choice and of logprobs (the subclasses below)."""

    id_prefix: str
    object_name: str  # the whole answer's "object"
    chunk_object_name: str  # a streamed chunk's

    def __init__(self, model: str, n: int, decode_token, request_id: str, meter: RequestMeter):
        self.tools: list[dict] | None = None  # chat: offered to the model (the ingress sets them)
        self.model = model
        self.id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.decode_token = decode_token  # token id -> its text, for logprobs
        self.meter = meter  # counts the deltas before they reach the builder
        self.texts = [""] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list] = [[] for _ in range(n)]

    def add(self, delta: RequestDelta) -> None:
        self.texts[delta.index] += delta.new_text
        self.finish_reasons[delta.index] = delta.finish_reason
        self.logprobs[delta.index] += delta.new_logprobs

    def chunk(self, delta: RequestDelta, want_logprobs: bool) -> dict:
        logprobs = self._logprobs(delta.new_logprobs) if want_logprobs else None
        choice = {"index": delta.index, **self._chunk_choice(delta), "finish_reason": delta.finish_reason,
                  "logprobs": logprobs}
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": [choice]}

    def usage_chunk(self) -> dict:
        return {"id": self.id, "object": self.chunk_object_name, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage()}

    def usage(self) -> dict:
        return usage(self.meter)

    def final(self, want_logprobs: bool) -> dict:
        choices = [{"index": i, **self._final_choice(text), "finish_reason": self.finish_reasons[i],
                    "logprobs": self._logprobs(self.logprobs[i]) if want_logprobs else None}
                   for i, text in enumerate(self.texts)]
        return {
            "id": self.id, "object": self.object_name, "created": self.created, "model": self.model,
            "choices": choices, "usage": self.usage(),
        }

    def _chunk_choice(self, delta: RequestDelta) -> dict:
        raise NotImplementedError

    def _final_choice(self, text: str) -> dict:
        raise NotImplementedError

    def _logprobs(self, entries) -> dict:
        raise NotImplementedError


class CompletionResponseBuilder(ResponseBuilder):
    id_prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"

    def _chunk_choice(self, delta: RequestDelta) -> dict:
        return {"text": delta.new_text}

    def _final_choice(self, text: str) -> dict:
        return {"text": text}

    def _logprobs(self, entries) -> dict:
        return {
            "tokens": [self.decode_token(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.decode_token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": [],
        }


class ChatResponseBuilder(ResponseBuilder):
    id_prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, n: int, decode_token, request_id: str, meter: RequestMeter):
        super().__init__(model, n, decode_token, request_id, meter)
        self._sent_role = [False] * n

    def final(self, want_logprobs: bool) -> dict:
        response = super().final(want_logprobs)
        for choice in response["choices"] if self.tools else ():
            calls = parse_tool_calls(choice["message"]["content"], self.tools)
            if calls:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                choice["finish_reason"] = "tool_calls"
        return response

    def _chunk_choice(self, delta: RequestDelta) -> dict:
        message = {"content": delta.new_text}
        if not self._sent_role[delta.index]:  # the first chunk of each choice names the role
            message["role"] = "assistant"
            self._sent_role[delta.index] = True
        return {"delta": message}

    def _final_choice(self, text: str) -> dict:
        return {"message": {"role": "assistant", "content": text}}

    def _logprobs(self, entries) -> dict:
        def token(token_id: int, logprob: float) -> dict:
            text = self.decode_token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**token(e.token_id, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]}
                            for e in entries]}
