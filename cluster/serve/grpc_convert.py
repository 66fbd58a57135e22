"""protos.inference_pb2 <-> internal types. The only module that reads or builds those messages."""

from __future__ import annotations

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media_prompt import message_content
from cluster.engine.outputs import RequestDelta
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.structured_output import StructuredOutput
from cluster.serve.ledger import RequestMeter
from protos import inference_pb2 as pb


def grpc_sampling_params(sampling: pb.SamplingParams, response_format: pb.ResponseFormat | None = None) -> SamplingParams:
    has = sampling.HasField
    return SamplingParams(
        structured_output=structured_output(response_format) if response_format is not None else None,
        n=sampling.n if has("n") else 1,
        max_tokens=sampling.max_tokens if has("max_tokens") else 16,
        temperature=sampling.temperature if has("temperature") else 1.0,
        top_p=sampling.top_p if has("top_p") else 1.0,
        top_k=sampling.top_k if has("top_k") else 0,
        seed=sampling.seed if has("seed") else None,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs if has("logprobs") else None,
    )


def structured_output(response_format: pb.ResponseFormat) -> StructuredOutput | None:
    if response_format.type in ("", "text"):
        return None
    if response_format.type == "json_schema" and not response_format.json_schema:
        raise InvalidRequestError("response_format.json_schema", "is required for type json_schema")
    return StructuredOutput(response_format.type, response_format.json_schema or None)


def prompt_or_messages(request: pb.GenerateRequest) -> tuple[str | None, list[dict] | None]:
    """Exactly one of prompt and messages. A message's content is its text, or, when it holds an
    image or audio part, its parts in order ({"type": "text" | "image" | "audio", ...}, each
    media part with the field it came from, for errors)."""
    if request.prompt and request.messages:
        raise InvalidRequestError("prompt", "give either prompt or messages, not both")
    if not request.messages:
        if not request.prompt:
            raise InvalidRequestError("prompt", "must not be empty (or give messages)")
        return request.prompt, None
    messages = []
    for i, message in enumerate(request.messages):
        parts = []
        for j, part in enumerate(message.parts):
            kind = part.WhichOneof("content")
            if kind is None:
                raise InvalidRequestError(f"messages[{i}].parts[{j}]", "is empty: set text, image or audio")
            if kind == "text":
                parts.append({"type": "text", "text": part.text})
            else:
                parts.append({"type": kind, "data": getattr(part, kind), "where": f"messages[{i}].parts[{j}].{kind}"})
        messages.append({"role": message.role, "content": message_content(parts)})
    return None, messages


def grpc_messages(messages: list[dict]) -> list[pb.Message]:
    """The other way (clients: `pagoda generate`): messages whose content is text or a list of
    parts ({"type": "text", "text"} or {"type": "image" | "audio", "data": bytes})."""
    def parts(content):
        if isinstance(content, str):
            return [pb.Part(text=content)]
        return [pb.Part(text=p["text"]) if p["type"] == "text" else pb.Part(**{p["type"]: p["data"]}) for p in content]

    return [pb.Message(role=m["role"], parts=parts(m["content"])) for m in messages]


def response(delta: RequestDelta, meter: RequestMeter | None = None) -> pb.GenerateResponse:
    """One delta; the request's last one (with its meter) also says what the request cost."""
    cost = {}
    if meter is not None:
        cost["compute_units"] = meter.compute_units
        if meter.units_limit is not None:
            cost["compute_units_limit"] = meter.units_limit
    return pb.GenerateResponse(
        index=delta.index,
        text=delta.new_text,
        token_ids=delta.new_token_ids,
        finish_reason=delta.finish_reason or "",
        prompt_tokens=delta.num_prompt_tokens,
        cached_tokens=delta.num_cached_tokens,
        **cost,
        logprobs=[
            pb.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
            )
            for lp in delta.new_logprobs
        ],
    )


def model_info(info: dict) -> pb.ModelInfo:
    return pb.ModelInfo(
        model_id=info["model_id"], max_model_len=info["max_model_len"], vocab_size=info["vocab_size"],
        block_size=info["block_size"], num_kv_blocks=info["num_kv_blocks"], modalities=info["modalities"],
    )
