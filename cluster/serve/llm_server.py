"""LLMServer: one engine, driven by a thread, shared by every concurrent caller.

    generate() (asyncio, one per request) ──inbox──> engine thread: add / abort / deadlines / step
         ^                                                        │
         └──────── per-request asyncio.Queue <── deltas ──────────┘

The engine is single-threaded, so only the engine thread touches it; callers talk to it through a
thread-safe inbox and receive deltas on their own asyncio queue. A caller that goes away (client
cancel, disconnect) aborts its request in `finally`, which frees its blocks on the next loop turn.

Disaggregated, the same class plays two roles (engine_config["kv_role"]):
  prefill: `prefill()` runs a prompt to its first token and returns it with the prompt's KV, which
           the engine's workers put into Ray's object store layer by layer while they compute;
  decode:  `generate()` first asks a prefill deployment (the `prefill_server` handle; Serve's
           router picks the replica by load and prefix affinity), streams that first token, and
           admits the request with the KV, which its workers read from the object store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import os
import queue
import threading
import time

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.executor.factory import build_engine
from cluster.engine.outputs import PrefillResult, RequestDelta, coalesce
from cluster.serve.delta_stream import DeltaStream, stream_interval
from cluster.serve.generation import GenerationRequest, RequestDeadline
from cluster.serve.autoscaling import RecentPercentile, replica_signals
from cluster.serve.drain import DrainWatcher, ServerDrainingError, replica_name
from cluster.serve.errors import EngineOverloadedError, RequestFailedError, RequestTimeoutError, WorkerLostError
from cluster.serve.light_steps import LightStepThreads
from cluster.serve.metrics import EngineMetrics, MediaMetrics, start_gpu_telemetry

logger = logging.getLogger("pagoda.llm_server")


# Decodes per step up to which the engine may leave a core to the serving processes (_is_light_step).
LIGHT_STEP_ROWS = 4

class LLMServer:
    def __init__(
        self,
        engine_config: dict,
        max_waiting_requests: int = 256,
        request_timeout_s: float | None = 600.0,
        torch_threads: int | None = None,
        prefill_server=None,
        request_deadline: dict | None = None,
        stream_interval: int | None = None,
    ):
        self.max_waiting_requests = max_waiting_requests
        # Tokens of one stream per message after its first (vLLM's stream_interval; None: by load,
        # delta_stream.stream_interval): every message costs each hop (LLMServer -> ingress -> proxy -> client)
        # CPU that, on a small node, the engine's step waits for. The first token, the last and
        # errors go at once.
        self.stream_interval = stream_interval
        self.request_timeout_s = request_timeout_s
        self.request_deadline = RequestDeadline.model_validate(request_deadline or {})
        self.prefill_server = prefill_server  # a DeploymentHandle when prefill is disaggregated
        self._worker_lost: str | None = None  # why the engine can no longer run, if it cannot
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, DeltaStream] = {}  # engine thread only
        self._ids = itertools.count()
        self._stopped = False
        self._ready = threading.Event()
        self._recent_ttft = RecentPercentile(window_s=30.0)
        # The engine is built in its own thread, and only that thread ever runs torch: libgomp
        # keeps an OpenMP pool per thread that has run torch, and once more pool threads exist
        # than CPUs it stops spin-waiting between ops, which made every decode step 2x slower
        # (measured: 32 -> 63 ms per token when the model was loaded in another thread).
        built = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(engine_config, torch_threads, built), name="pagoda-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = built.result()  # re-raises a failed build
        self._last_stats = self.engine.stats()  # then the engine thread's, after each step
        self.metrics = EngineMetrics(self.model_info()["model_id"])
        self.media_metrics = MediaMetrics(self.model_info()["model_id"]) if self.engine.encoder else None
        start_gpu_telemetry()
        # its own name: with engine_in_ingress the Ingress in this replica reports too
        self._drain = DrainWatcher(f"{replica_name(self)} engine", lambda: len(self._streams),
                                   on_deadline=lambda: self._send(("drain_deadline",)))
        self._ready.set()

    # ---- called by the ingress (through a deployment handle) -------------------------------

    async def generate(self, request: GenerationRequest):
        """Yields RequestDelta objects until every candidate has finished."""
        prefilled = None
        now = time.monotonic()
        if self.prefill_server is not None and request.params.n == 1:  # n > 1: prefilled here
            self._check_admission(request)
            prefilled = (await self.prefill_server.prefill.remote(request)).prefilled
            await fetch_prefilled_kv(prefilled)
        async for delta in self._generate(request, arrival=now, prefilled=prefilled):
            yield delta

    async def prefill(self, request: GenerationRequest):
        """Disaggregated prefill: run the prompt to its first token; returns that token's delta,
        whose `prefilled` holds the KV (object-store references) for the decode side."""
        one_token = dataclasses.replace(request, params=dataclasses.replace(request.params, max_tokens=1))
        last = None
        async for delta in self._generate(one_token, arrival=time.monotonic(), export_kv=True):
            last = delta
        return last

    def _check_admission(self, request: GenerationRequest) -> None:
        self._drain.check_admission()
        if self._worker_lost is not None:
            raise WorkerLostError(self._worker_lost)
        # The inbox is a fair count of what the engine thread has not taken yet.
        if self._inbox.qsize() + self.engine.num_waiting >= self.max_waiting_requests:
            raise EngineOverloadedError.queue_full(self.max_waiting_requests)
        # The prompt itself was checked by the ingress; the engine checks it once more against
        # its own capacity in add_request (a prefill and a decode engine may hold different
        # numbers of blocks), and that error reaches the caller through its stream.

    async def _generate(self, request: GenerationRequest, arrival: float, export_kv: bool = False, prefilled=None):
        self._check_admission(request)
        timeout = self._timeout(request)
        stream = DeltaStream(
            asyncio.get_running_loop(), asyncio.Queue(), arrival + timeout if timeout else None,
            request.params.n, arrival=arrival,
        )
        request_id = f"{request.request_id}-{next(self._ids)}"  # unique even if a client reuses ids
        self._send(("add", request_id, request, stream, export_kv, prefilled))
        finished, num_unfinished = False, request.params.n
        try:
            while True:
                # A stream that fell behind the engine (many streams, a slow consumer) takes every
                # step's tokens waiting for it in one message per hop; one waiting: sent as is.
                items = [await stream.queue.get()]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                for item in coalesce(items):
                    if isinstance(item, BaseException):
                        finished = True
                        raise item
                    yield item
                    if item.finished:
                        num_unfinished -= 1
                        if num_unfinished == 0:
                            finished = True
                            return
        finally:
            if not finished:
                self._send(("abort", request_id))

    def _timeout(self, request: GenerationRequest) -> float:
        wanted = request.timeout_s
        if wanted is None:
            num_prompt = len(request.prompt_token_ids)
            max_tokens = request.params.max_tokens or max(self.engine.max_model_len - num_prompt, 0)
            wanted = self.request_deadline.for_size(num_prompt, max_tokens * request.params.n)
        return min(wanted, self.request_timeout_s) if self.request_timeout_s else wanted

    def model_info(self) -> dict:
        engine = self.engine
        return {
            "model_id": engine.model_identity.split(":")[0],
            "model_dir": engine.config.model,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.model_config.vocab_size,
            "block_size": engine.config.block_size,
            "num_kv_blocks": engine.num_blocks,
            "eos_token_ids": list(engine.model_config.eos_token_ids),
            "modalities": ["text"] + ([engine.multimodal.modality] if engine.multimodal else []),
        }

    def stats(self) -> dict:
        """The engine's stats as plain data (`pagoda status`), with this server's open streams
        (the engine thread's last snapshot: only that thread touches the engine)."""
        stats = self._last_stats
        encoder = self.engine.encoder
        return {**dataclasses.asdict(stats), "num_streams": len(self._streams), "kv_usage": stats.kv_usage,
                "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
                **({"encoder": encoder.describe()} if encoder is not None else {})}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What this replica's autoscaling policy scales on (cluster/serve/autoscaling.py); Serve
        calls it on the replica every few seconds. Reads the engine thread's last snapshot."""
        return replica_signals(self._last_stats, self._inbox.qsize(), self._recent_ttft.percentile(95))

    def describe(self) -> dict:
        """This replica's engine: its role and its ranks, with where each one runs."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()  # a TP=1 executor runs in this process
        ranks = [{"node_id": node_id, **rank} for rank in self.engine.executor.describe()]
        offload = self.engine.kv_connector.offload
        return {"role": self.engine.config.kv_role or "colocated",
                "tensor_parallel_size": self.engine.config.tensor_parallel_size,
                "replica_pid": os.getpid(), "ranks": ranks, "stats": self.stats(),
                # the tiers below device memory (may ask the shared cache service: not per step)
                "kv_tiers": offload.describe() if offload else None}

    def check_health(self) -> None:
        """Serve calls this periodically; a dead engine thread or a lost worker makes the replica
        unhealthy, and Serve replaces it."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        if self._worker_lost is not None:
            raise RuntimeError(self._worker_lost)
        if self.engine.is_broken:
            raise RuntimeError("every step of the engine fails, whatever it runs")

    def is_serving(self) -> bool:
        """Whether this replica takes new requests (the gRPC health service asks, through the ingress)."""
        try:
            self.check_health()
        except RuntimeError:
            return False
        return not self._drain.draining

    def shutdown(self) -> None:
        """Stop the engine thread and wait for it (a thread killed inside torch at interpreter
        exit aborts the process). Requests still running end with ServerDrainingError; the
        prefix cache moves down to the tiers that outlive the process."""
        if getattr(self, "_drain", None) is not None:
            self._drain.stop()
        self._stopped = True
        if hasattr(self, "_thread"):  # __init__ may have failed before starting it
            self._ready.set()
            self._wake.set()
            self._thread.join(timeout=30)

    def __del__(self):  # Serve calls this when a replica stops
        self.shutdown()

    # ---- the engine thread -----------------------------------------------------------------

    def _send(self, message) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _run(self, engine_config: dict, torch_threads: int | None, built: concurrent.futures.Future) -> None:
        # Ray caps OMP threads at the replica's num_cpus (1 by default), which halves decode speed
        # on a small CPU node; the engine is the node's main CPU consumer, so it takes them all.
        threads = torch_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        light_threads = LightStepThreads(threads)
        try:
            engine = build_engine(EngineConfig(**engine_config))
        except BaseException as e:  # noqa: BLE001 - handed to __init__, which raises it
            built.set_exception(e)
            return
        # The model and engine are long-lived: moved out of the collector's view, so that its
        # collections during steps (~4 ms per decode step otherwise) traverse only what steps make.
        gc.freeze()
        built.set_result(engine)
        self._ready.wait()  # metrics exist before the first step
        while not self._stopped:
            if self._worker_lost is not None:  # until Serve replaces this replica: fail fast
                self._drain_inbox()
                self._fail_all(WorkerLostError(self._worker_lost))
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            self._drain_inbox()
            self._expire_deadlines()
            if not engine.has_unfinished_requests():
                self._last_stats = engine.stats()  # aborts since the last step freed their blocks
                self._record_metrics(engine)  # and blocks that went down to the tiers after it
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            light = self._is_light_step(engine)
            step_threads = light_threads.pick() if light else threads
            if step_threads != torch.get_num_threads():
                torch.set_num_threads(step_threads)
            try:
                started = time.perf_counter()
                deltas = engine.step()
                if light:
                    light_threads.record(step_threads, time.perf_counter() - started)
            except WorkerLostError as e:  # a TP rank's process died: this engine cannot run again
                self._worker_lost = str(e)
                logger.error("%s", self._worker_lost)
                engine.executor.shutdown()  # the other ranks would wait in a collective forever
                continue
            except Exception:  # not one request's fault (the engine isolates those): fail the running ones
                logger.exception("engine step failed; failing the running requests")
                self._fail_all(RequestFailedError("the engine failed while running this request"))
                continue
            self._last_stats = engine.stats()  # before the deltas: whoever gets a last one sees its blocks freed
            for delta in deltas:
                self._deliver(delta)
            self._flush_stalled({delta.request_id for delta in deltas})
            self._last_stats = engine.stats()  # a stream found gone has been aborted
            self._record_metrics(engine)
        self._drain_inbox()
        self._fail_all(ServerDrainingError("the server stopped before this request finished; retry"))
        self._drain_kv(engine)

    def _record_metrics(self, engine: LLMEngine) -> None:
        self.metrics.record_engine(self._last_stats)
        if engine.kv_connector.offload is not None:
            self.metrics.record_tiers(engine.kv_connector.offload)

    def _is_light_step(self, engine: LLMEngine) -> bool:
        """A step of a few decodes and nothing to prefill: it may run on one thread fewer, leaving
        that core to the streams' other processes (cluster/serve/light_steps.py decides by timing
        both). Prefill and larger batches take every thread."""
        stats = self._last_stats  # the last step's; arrivals since then are in num_waiting
        return engine.num_waiting == 0 and stats.num_prefilling == 0 and stats.num_running <= LIGHT_STEP_ROWS

    def _drain_kv(self, engine: LLMEngine) -> None:
        """A planned stop (Serve stops the replica, `pagoda serve` is interrupted): the device
        prefix cache goes down to the tiers that outlive this process, so a restart finds it."""
        offload = engine.kv_connector.offload
        if offload is None or not offload.outlives_process or self._worker_lost is not None:
            return
        start = time.monotonic()
        try:
            count = engine.spill_prefix_cache()
        except Exception:  # noqa: BLE001 - a stop must not fail: the blocks are recomputed later
            logger.exception("could not move the KV prefix cache down at shutdown")
            return
        logger.info("moved %d cached KV blocks down to the lower tiers in %.1f s", count, time.monotonic() - start)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "drain_deadline":
                self._fail_all(ServerDrainingError("the server is shutting down and this request did not "
                                                   "finish within the drain period; retry"))
            elif message[0] == "add":
                _, request_id, request, stream, export_kv, prefilled = message
                try:
                    ready = self.engine.add_request(request_id, request.prompt_token_ids, request.params,
                                                    salt=request.salt, media=request.media,
                                                    export_kv=export_kv, prefilled=prefilled,
                                                    tenant=request.tenant, weight=request.weight)
                except Exception as e:  # invalid input: the caller gets the error, the loop goes on
                    stream.put(e)
                    continue
                finally:
                    if self.media_metrics is not None and request.media:
                        self.media_metrics.record_encoder(self.engine.encoder.stats, "colocated")
                self._streams[request_id] = stream
                self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
                for delta in ready:  # a prefilled request's first token
                    self._deliver(delta)
            else:
                _, request_id = message
                self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        self._end_streams(list(self._streams), error)

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        expired = [rid for rid, stream in self._streams.items() if stream.deadline is not None and now > stream.deadline]
        self._end_streams(expired, RequestTimeoutError("the request ran past its deadline and was stopped"))

    def _end_streams(self, request_ids: list[str], error: Exception) -> None:
        """Aborts these requests, then tells their callers: whoever gets the error sees the
        blocks freed (the stats snapshot is taken in between)."""
        if not request_ids:
            return
        streams = [self._streams.pop(request_id) for request_id in request_ids]
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        self._last_stats = self.engine.stats()
        for stream in streams:
            stream.put(error)

    def _deliver(self, delta: RequestDelta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        if delta.error is not None:  # the request failed alone (its other candidates end with it)
            self.engine.abort_request(delta.request_id)
            del self._streams[delta.request_id]
            stream.put(RequestFailedError(delta.error))
            return
        if self._holds(stream, delta):
            stream.held.append(delta)
        elif not stream.put(delta):
            self.engine.abort_request(delta.request_id)
            del self._streams[delta.request_id]
            return
        self._record_latency(stream, delta)
        if delta.finished:
            stream.num_unfinished -= 1  # the engine thread's own count; the caller keeps another
            if stream.num_unfinished == 0:
                del self._streams[delta.request_id]

    def _holds(self, stream: DeltaStream, delta: RequestDelta) -> bool:
        """Whether this delta waits for the next message of its stream."""
        interval = self.stream_interval or stream_interval(self._last_stats.num_running)
        return interval > 1 and stream.first_token is not None and not delta.finished and len(stream.held) + 1 < interval

    def _flush_stalled(self, stepped: set[str]) -> None:
        """A stream that got no token this step (preempted, or its request waits) sends what it
        holds: a held token never waits on other requests' steps."""
        for request_id, stream in list(self._streams.items()):
            if stream.held and request_id not in stepped and not stream.put():
                self.engine.abort_request(request_id)
                del self._streams[request_id]

    def _record_latency(self, stream: DeltaStream, delta: RequestDelta) -> None:
        now, m = time.monotonic(), self.metrics
        m.generation_tokens.inc(len(delta.new_token_ids))
        if stream.first_token is None:
            stream.first_token = now
            m.ttft.observe(now - stream.arrival)
            self._recent_ttft.add(now - stream.arrival)
        else:
            m.itl.observe(now - stream.last_token)
        stream.last_token = now
        stream.num_tokens += len(delta.new_token_ids)
        if delta.finished and stream.num_unfinished == 1:  # the last candidate: the request ends
            m.e2e.observe(now - stream.arrival)
            if stream.num_tokens > 1:
                m.tpot.observe((now - stream.first_token) / (stream.num_tokens - 1))


async def fetch_prefilled_kv(prefilled: PrefillResult | None) -> None:
    """Bring a prompt's KV (object-store references) to this node before the engine takes the
    request: a prefill replica lost in between then fails this request alone (UNAVAILABLE, retry),
    not the decode step of every request running here."""
    import ray

    refs = [part.data for part in prefilled.kv_parts if isinstance(part.data, ray.ObjectRef)] if prefilled else []
    try:
        await asyncio.gather(*refs)
    except ray.exceptions.RayError as e:
        raise WorkerLostError(f"the prompt's KV was lost with its prefill replica ({type(e).__name__}); retry") from None
