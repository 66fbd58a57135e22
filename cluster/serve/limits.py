"""Input limits of the serving edge: what one request may ask for, checked before any work
(tokenizing, queueing). Each has a default that suits a shared server and is set under `limits:`
in the Serve config. The model's context is checked by PromptEncoder (prompt + max_tokens)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media_prompt import MediaLimits
from cluster.engine.sampling_params import SamplingParams


class InputLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_n: int = Field(16, ge=1, description="candidates per request (n)")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="an HTTP body or gRPC message; larger: 413 / RESOURCE_EXHAUSTED")
    max_json_depth: int = Field(32, ge=4, description="nesting of an HTTP body's JSON")
    max_messages: int = Field(512, ge=1, description="chat messages per request")
    max_stop_strings: int = Field(16, ge=0, description="stop strings per request")
    max_stop_chars: int = Field(256, ge=1, description="characters of one stop string")
    max_media_items: int = Field(8, ge=0, description="images or audio clips per request (the model may allow fewer)")
    max_media_bytes: int = Field(4 << 20, ge=1, description="one image's or audio clip's encoded bytes")
    max_image_pixels: int = Field(25_000_000, ge=1, description="width x height of one image (checked before decoding)")
    max_audio_seconds: float = Field(30.0, gt=0, description="length of one audio clip")

    def media(self) -> MediaLimits:
        return MediaLimits(self.max_media_items, self.max_media_bytes, self.max_image_pixels, self.max_audio_seconds)

    def check(self, params: SamplingParams, messages: list | None) -> None:
        """Raises InvalidRequestError naming the field that asks for too much."""
        if params.n > self.max_n:
            raise InvalidRequestError("n", f"is {params.n}; this server allows at most {self.max_n}")
        if messages is not None and len(messages) > self.max_messages:
            raise InvalidRequestError("messages", f"has {len(messages)} messages; this server allows at most {self.max_messages}")
        if len(params.stop) > self.max_stop_strings:
            raise InvalidRequestError("stop", f"has {len(params.stop)} strings; this server allows at most {self.max_stop_strings}")
        if any(len(s) > self.max_stop_chars for s in params.stop):
            raise InvalidRequestError("stop", f"a stop string is longer than {self.max_stop_chars} characters")

    def check_json_depth(self, body) -> None:
        if json_depth(body) > self.max_json_depth:
            raise InvalidRequestError("body", f"the JSON is nested deeper than {self.max_json_depth} levels")


def json_depth(value) -> int:
    """How deep lists and objects nest in parsed JSON (a scalar is 0), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    return depth
