"""ServedModel: what an ingress replica learns once from a model server, and the prompt work it
does itself with that, off the engine's thread: the tokenizer and its chat template, the checks a
prompt must pass (one PromptEncoder), and, for a multimodal model, its HF processor.

Tokenizing runs on a thread of its own so that no body stalls the event loop that answers everyone
else (a fast tokenizer is not safe to share between threads, hence one)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from cluster.engine.errors import InvalidRequestError
from cluster.engine.media import MediaItem
from cluster.engine.media_prompt import MediaPromptEncoder
from cluster.engine.prompt import CheckedPrompt, PromptEncoder
from cluster.engine.tokenizer import load_tokenizer
from cluster.serve.limits import InputLimits
from cluster.serve.metrics import MediaMetrics
from model.multimodal_spec import MultimodalSpec


@dataclass(slots=True)
class ServedModel:
    name: str
    info: dict  # the model server's model_info()
    prompts: PromptEncoder
    media_prompts: MediaPromptEncoder | None  # multimodal models only
    media_metrics: MediaMetrics | None
    template_knows_tools: bool  # a template that reads `tools` is given them; others get them described
    tokenizer_thread: concurrent.futures.ThreadPoolExecutor

    @classmethod
    async def load(cls, llm, limits: InputLimits, name: str | None) -> ServedModel:
        """Asks the model server (a handle) what it serves, and loads its tokenizer here."""
        info = await llm.model_info.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, info["model_dir"])
        name = name or info["model_id"]
        prompts = PromptEncoder(tokenizer, info["vocab_size"], info["max_model_len"])
        spec = await asyncio.to_thread(MultimodalSpec.from_dir, info["model_dir"])
        media_prompts = media_metrics = None
        if spec is not None:
            media_prompts = await asyncio.to_thread(
                MediaPromptEncoder, info["model_dir"], spec, limits.media(), prompts.max_prompt_chars)
            media_metrics = MediaMetrics(name)
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        return cls(name, info, prompts, media_prompts, media_metrics,
                   "tools" in str(tokenizer.chat_template or ""), thread)

    async def encode(self, prompt, messages: list[dict] | None, tools: list[dict] | None,
                     max_tokens: int | None) -> tuple[CheckedPrompt, list[MediaItem]]:
        """The prompt's token ids, checked once against the model (vocabulary, context with room
        for max_tokens), and its media items (decoded and processed) in placeholder order."""
        loop = asyncio.get_running_loop()
        if messages is not None and self.media_prompts is not None:
            token_ids, media = await loop.run_in_executor(self.tokenizer_thread, self.media_prompts.encode, messages)
        else:
            refuse_media(messages)
            token_ids, media = await loop.run_in_executor(
                self.tokenizer_thread, self.prompts.tokenize, prompt, messages, tools), []
        return self.prompts.check(token_ids, max_tokens), media

    def decode_token(self, token_id: int) -> str:
        return self.prompts.tokenizer.decode([token_id])

    def close(self) -> None:
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def refuse_media(messages: list[dict] | None) -> None:
    """A text-only model: an image or audio part is refused, naming it."""
    for message in messages or ():
        if isinstance(message.get("content"), list):
            for part in message["content"]:
                if part.get("type") != "text":
                    raise InvalidRequestError(part["where"], f"{part['type']} parts need a multimodal model; "
                                              "the model served here takes text only")
