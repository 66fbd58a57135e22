"""OpenAI's wire format: request models (validated with pydantic at the edge) and response
builders. Nothing outside cluster/serve sees these shapes."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.outputs import RequestDelta
from cluster.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


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


class CompletionRequest(_CommonRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, description="top alternatives per token, 0..20")


class ChatContentPart(BaseModel):
    type: Literal["text", "image_url", "input_audio"]
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ChatContentPart] | None = ""


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def sampling_params(request: _CommonRequest, default_max_tokens: int | None, logprobs: int | None) -> SamplingParams:
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
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


class ResponseBuilder:
    """Accumulates deltas for the non-streaming answer and shapes streaming chunks."""

    def __init__(self, kind: Literal["completion", "chat"], model: str, n: int, decode_token):
        self.kind, self.model = kind, model
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self.decode_token = decode_token  # token id -> its text, for logprobs
        self.texts = [""] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.num_prompt_tokens = 0
        self.num_completion_tokens = 0
        self._sent_role = [False] * n

    def add(self, delta: RequestDelta) -> None:
        self.texts[delta.index] += delta.new_text
        self.finish_reasons[delta.index] = delta.finish_reason
        self.logprobs[delta.index] += delta.new_logprobs
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_completion_tokens += len(delta.new_token_ids)

    def chunk(self, delta: RequestDelta, want_logprobs: bool) -> dict:
        logprobs = self._logprobs(delta.new_logprobs) if want_logprobs else None
        if self.kind == "completion":
            choice = {"index": delta.index, "text": delta.new_text, "finish_reason": delta.finish_reason, "logprobs": logprobs}
            return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice]}
        message = {"content": delta.new_text}
        if not self._sent_role[delta.index]:
            message["role"] = "assistant"
            self._sent_role[delta.index] = True
        choice = {"index": delta.index, "delta": message, "finish_reason": delta.finish_reason, "logprobs": logprobs}
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                "usage": usage(self.num_prompt_tokens, self.num_completion_tokens)}

    def final(self, want_logprobs: bool) -> dict:
        choices = []
        for i, text in enumerate(self.texts):
            logprobs = self._logprobs(self.logprobs[i]) if want_logprobs else None
            if self.kind == "completion":
                choices.append({"index": i, "text": text, "finish_reason": self.finish_reasons[i], "logprobs": logprobs})
            else:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": self.finish_reasons[i], "logprobs": logprobs})
        return {
            "id": self.id, "object": "text_completion" if self.kind == "completion" else "chat.completion",
            "created": self.created, "model": self.model, "choices": choices,
            "usage": usage(self.num_prompt_tokens, self.num_completion_tokens),
        }

    def _logprobs(self, entries) -> dict:
        if self.kind == "chat":
            return {"content": [
                {"token": self.decode_token(e.token_id), "logprob": e.logprob, "bytes": list(self.decode_token(e.token_id).encode()),
                 "top_logprobs": [{"token": self.decode_token(t), "logprob": lp, "bytes": list(self.decode_token(t).encode())} for t, lp in e.top]}
                for e in entries
            ]}
        return {
            "tokens": [self.decode_token(e.token_id) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.decode_token(t): lp for t, lp in e.top} for e in entries],
            "text_offset": [],
        }
