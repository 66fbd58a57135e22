"""LLM: the offline, in-process API.

    llm = LLM(model="~/.cache/pagoda/models/SmolLM2-135M-Instruct")
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))

All prompts go into the engine at once and are batched continuously, like the server does.
"""

from __future__ import annotations

import itertools

from tqdm import tqdm

from cluster.engine.config import EngineConfig
from cluster.executor.factory import build_engine
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_options):
        self.engine = build_engine(EngineConfig(model=str(model), **engine_options))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Raw prompts (text or token ids), encoded as `tokenizer(prompt)` does."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.run([self.encode(p) for p in prompts], sampling_params or SamplingParams(), use_tqdm)

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Conversations of {"role", "content"} messages, through the model's chat template. With a
        multimodal model a content may be a list of parts: {"type": "text", "text": ...},
        {"type": "image" | "audio", "data": <the file's bytes>}."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.run([self.encode(messages=c) for c in conversations], sampling_params or SamplingParams(), use_tqdm)

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> tuple:
        """(prompt text or None, token ids, media items) for `run`."""
        if messages is not None and self.engine.multimodal is not None:
            return (None, *self.engine.encode_media_prompt(messages))
        return (prompt if isinstance(prompt, str) else None, self.engine.encode_prompt(prompt, messages), [])

    def run(self, encoded: list[tuple], params: SamplingParams, use_tqdm: bool = False) -> list[RequestOutput]:
        """Requests as `encode` makes them, batched together."""
        results: dict[str, RequestOutput] = {}
        for prompt, token_ids, media in encoded:
            request_id = str(next(self._ids))
            results[request_id] = RequestOutput(
                request_id, prompt, token_ids, [CompletionOutput(i) for i in range(params.n)]
            )
            self.engine.add_request(request_id, token_ids, params, media=media)
        with tqdm(total=len(results), disable=not use_tqdm, desc="generate") as progress:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    result = results[delta.request_id]
                    result.outputs[delta.index].add(delta)
                    if delta.finished and result.finished:
                        progress.update(1)
        return list(results.values())

    def shutdown(self) -> None:
        """Release the executor's workers (a tensor-parallel group's actors)."""
        self.engine.executor.shutdown()
