"""Where `pagoda bench` sends requests. Every backend fills a RequestRecord the same way: a chunk
time for each streamed piece of output that carries text, the output token count (from the
server's usage when it reports one), and a short error kind on failure.

    http://HOST:PORT     any OpenAI-compatible server (Pagoda, llama.cpp's llama-server, vLLM...)
    grpc://HOST:PORT     Pagoda's gRPC Inference service
    hf[:MODEL_DIR]       HF transformers in this process, batching what is queued when the model
                         is free, padded (--max-batch 1: one request at a time)
    engine[:MODEL_DIR]   Pagoda's LLMServer in this process, without Ray or Serve: what the
                         serving path costs is the difference to http:// and grpc://
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

from cluster.bench.metrics import RequestRecord
from model.config import ModelConfig


def make_backend(target: str, *, ignore_eos: bool, max_batch: int | None = None, engine_options: dict | None = None):
    """engine_options: EngineConfig options of an in-process engine target (e.g. its quantization)."""
    if target.startswith(("http://", "https://")):
        return OpenAIHTTPBackend(target, ignore_eos)
    if target.startswith("grpc://"):
        return GrpcBackend(target.removeprefix("grpc://"), ignore_eos)
    if target == "hf" or target.startswith("hf:"):
        return HFBackend(target.partition(":")[2] or None, ignore_eos, max_batch or 1)
    if target == "engine" or target.startswith("engine:"):
        return EngineBackend(target.partition(":")[2] or None, ignore_eos, max_batch or 64, engine_options)
    raise ValueError(f"--target must be http://HOST:PORT, grpc://HOST:PORT, hf[:MODEL_DIR] or engine[:MODEL_DIR]; got {target!r}")


def default_model(model_dir: str | None) -> str:
    if model_dir is not None:
        return model_dir
    from cluster.model_fetch import fetch_default_model

    return str(fetch_default_model())


class OpenAIHTTPBackend:
    def __init__(self, base_url: str, ignore_eos: bool):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.ignore_eos = ignore_eos
        self.model: str | None = None
        self._session = None

    async def start(self) -> None:
        import aiohttp

        # No client-side connection cap: the runner decides concurrency. A fresh connection per
        # request: llama-server closes idle keep-alive connections, and a reused dead one fails.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=aiohttp.ClientTimeout(total=3600))
        async with self._session.get(f"{self.base_url}/v1/models") as r:
            r.raise_for_status()
            self.model = (await r.json())["data"][0]["id"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, prompt, messages, max_tokens: int, record: RequestRecord) -> None:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.ignore_eos:
            body["ignore_eos"] = True  # an extension both Pagoda and llama.cpp accept
        path = "/v1/completions" if messages is None else "/v1/chat/completions"
        body.update({"prompt": prompt} if messages is None else {"messages": messages})
        chunks = 0
        record.start = time.perf_counter()
        async with self._session.post(self.base_url + path, json=body) as response:
            if response.status != 200:
                record.error = f"http_{response.status}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    record.error = "stream_error"
                    return
                for choice in data.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        record.chunk_times.append(time.perf_counter())
                        record.text += text
                        chunks += 1
                if usage := data.get("usage"):
                    record.output_tokens = usage["completion_tokens"]
                    record.prompt_tokens = usage["prompt_tokens"]
        record.output_tokens = record.output_tokens or chunks  # a server without usage: one token a chunk


class GrpcBackend:
    def __init__(self, address: str, ignore_eos: bool):
        self.address = address
        self.ignore_eos = ignore_eos
        self._channel = None
        self._stub = None

    async def start(self) -> None:
        import grpc

        from protos import inference_pb2_grpc as pb_grpc

        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = pb_grpc.InferenceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def generate(self, prompt, messages, max_tokens: int, record: RequestRecord) -> None:
        import grpc

        from protos import inference_pb2 as pb

        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=self.ignore_eos))
        if messages is None:
            request.prompt = prompt
        else:
            request.messages.extend(pb.Message(role=m["role"], parts=[pb.Part(text=m["content"])]) for m in messages)
        record.start = time.perf_counter()
        try:
            async for response in self._stub.Generate(request):
                if response.token_ids:
                    record.chunk_times.append(time.perf_counter())
                    record.output_tokens += len(response.token_ids)
                    record.text += response.text
                record.prompt_tokens = response.prompt_tokens or record.prompt_tokens
        except grpc.aio.AioRpcError as e:
            record.error = f"grpc_{e.code().name}"


class HFBackend:
    """The HF transformers peer: static batching with left padding. A batch is whatever is queued
    (up to max_batch) when the model is free; it runs until its longest request is done, so short
    requests wait for long ones, as in any static-batching server."""

    def __init__(self, model_dir: str | None, ignore_eos: bool, max_batch: int):
        self.model_dir = model_dir
        self.ignore_eos = ignore_eos
        self.max_batch = max_batch
        self._queue: asyncio.Queue | None = None
        self._worker: asyncio.Task | None = None

    async def start(self) -> None:
        # One thread loads and runs the model, as Pagoda's LLMServer does (see its __init__: a
        # second thread running torch makes OpenMP stop spin-waiting, 2x slower per token).
        self._torch_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hf-peer")
        await asyncio.get_running_loop().run_in_executor(self._torch_thread, self._load)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._serve())

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = default_model(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.eos_token_ids = set(ModelConfig.from_dir(self.model_dir).eos_token_ids)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            self._torch_thread.shutdown()

    async def generate(self, prompt, messages, max_tokens: int, record: RequestRecord) -> None:
        record.start = time.perf_counter()
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((prompt, messages, max_tokens, record, done))
        await done

    async def _serve(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await asyncio.get_running_loop().run_in_executor(self._torch_thread, self._run_batch, batch)
            except Exception as e:  # noqa: BLE001 - the batch's requests report it
                for *_, record, _ in batch:
                    record.error = type(e).__name__
            for *_, done in batch:
                done.set_result(None)

    def _run_batch(self, batch) -> None:
        import torch

        texts = [
            prompt if messages is None else self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for prompt, messages, *_ in batch
        ]
        # A chat template already holds the BOS text; raw prompts are tokenized as the servers do.
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        longest = max(max_tokens for _, _, max_tokens, *_ in batch)
        steps = _StepTimes()
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, max_new_tokens=longest, do_sample=False, streamer=steps, pad_token_id=self.tokenizer.pad_token_id,
                **({"min_new_tokens": longest} if self.ignore_eos else {}),
            )
        new_tokens = output[:, inputs.input_ids.shape[1]:].tolist()
        for row, (_, _, max_tokens, record, _) in enumerate(batch):
            tokens = new_tokens[row][:max_tokens]
            if not self.ignore_eos:
                end = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_token_ids), len(tokens))
                tokens = tokens[:end]
            record.prompt_tokens = int(inputs.attention_mask[row].sum())
            record.output_tokens = len(tokens)
            record.chunk_times = steps.times[: len(tokens)]
            record.text = self.tokenizer.decode(tokens, skip_special_tokens=True)


class EngineBackend:
    def __init__(self, model_dir: str | None, ignore_eos: bool, max_num_seqs: int, engine_options: dict | None = None):
        self.model_dir = model_dir
        self.ignore_eos = ignore_eos
        self.max_num_seqs = max_num_seqs
        self.engine_options = engine_options or {}
        self.server = None

    async def start(self) -> None:
        from cluster.serve.llm_server import LLMServer

        self.server = LLMServer({"model": default_model(self.model_dir), "max_num_seqs": self.max_num_seqs,
                                 **self.engine_options}, max_waiting_requests=1 << 20)

    async def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()

    async def generate(self, prompt, messages, max_tokens: int, record: RequestRecord) -> None:
        import uuid

        from cluster.engine.sampling_params import SamplingParams
        from cluster.serve.generation import GenerationRequest

        record.start = time.perf_counter()
        token_ids = self.server.engine.encode_prompt(prompt, messages)  # the ingress tokenizes too
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=self.ignore_eos)
        async for delta in self.server.generate(GenerationRequest(uuid.uuid4().hex, token_ids, params)):
            if delta.new_token_ids:
                record.chunk_times.append(time.perf_counter())
                record.output_tokens += len(delta.new_token_ids)
                record.text += delta.new_text
            record.prompt_tokens = delta.num_prompt_tokens


class _StepTimes:
    """A transformers streamer that only notes when each decoding step's tokens exist."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands over the prompt ids
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
