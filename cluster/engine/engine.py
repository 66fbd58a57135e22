"""LLMEngine: requests in, token deltas out, one step at a time.

    add_request ──> Scheduler.schedule() ──plan──> Executor.execute() ──sampled tokens──┐
                        │  counts                        ^ payloads                      │
                        └──────── KVConnector ───────────┘                               │
    deltas <── Request.append_output (detokenize, stop checks) <── update(plan, output) <─┘

The engine owns the tokenizer, the block manager, the KV connector and the scheduler; it is handed
an Executor (cluster/engine/executor.py: one process, or a tensor-parallel group) and the KV tiers
below device memory, both built from the config by `cluster.executor.factory.build_engine`. It is
synchronous and single-threaded; the server
(cluster/serve) runs its step loop in a thread.

A fault belongs to the request that caused it: a request whose numbers go bad fails alone
(finish_reason "error"), and a step that raises is run once more, then in halves until each
failing request stands alone; only those fail. Steps that fail for every request they run, again
and again, mean the engine itself is broken (`is_broken`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from cache_service import KVCacheManager
from cache_service.offload import KVOffload
from cluster.engine.config import EngineConfig
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.errors import InvalidRequestError, WorkerLostError
from cluster.engine.executor import Executor, SampledToken, SequenceInput, StepOutput
from cluster.engine.kv_connector import KVConnector, SwapBudget
from cluster.engine.media import MediaItem, place_media, step_embeds
from cluster.engine.outputs import PrefillResult, RequestDelta
from cluster.engine.prompt import CheckedPrompt, PromptEncoder
from cluster.engine.request import FinishReason, Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerPlan
from cluster.engine.stats import EngineStats
from cluster.engine.tokenizer import load_tokenizer
from model.loader import parse_dtype, weights_fingerprint
from model.kv_transfer import KVImport
from model.multimodal_spec import MultimodalSpec
from model.runner import kv_bytes_per_block
from model.sampler import SamplingRow

logger = logging.getLogger("pagoda.engine")

# Steps in a row in which every request failed: then the engine, not a request, is at fault.
BROKEN_AFTER_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor, offload: KVOffload | None = None):
        self.config = config
        model_dir = Path(config.model)
        self.executor = executor
        self.model_config = executor.config
        # A single request must always fit in the cache, or preempting it could never help.
        self.max_model_len = min(executor.max_model_len, executor.num_blocks * config.block_size)
        self.tokenizer = load_tokenizer(model_dir)
        self.prompts = PromptEncoder(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.model_identity = model_identity(model_dir, config)
        self.multimodal = MultimodalSpec.from_dir(model_dir)  # None: text only
        self.encoder = self._build_encoder(config) if self.multimodal and config.encoder == "colocated" else None
        self._media_prompts = None  # built on first use
        self.kv_cache = KVCacheManager(executor.num_blocks, config.block_size, self.model_identity,
                                       config.enable_prefix_caching, lower_tiers=offload is not None,
                                       write_through=config.kv_write_through)
        # A swap copy holds every KV head (a TP group joins its ranks'): a whole page per block.
        c = self.model_config
        page_bytes = kv_bytes_per_block(c, c.num_key_value_heads, config.block_size, parse_dtype(config.kv_dtype))
        # One budget for host RAM's KV: swap copies come out of the host tier's when there is one.
        swap_space = (offload and offload.host_swap_space(page_bytes)) or SwapBudget(config.swap_space_bytes // page_bytes)
        self.kv_connector = KVConnector(self.kv_cache, offload, executor, prefetch=config.kv_prefetch,
                                        swap_space=swap_space)
        self.scheduler = Scheduler(self.kv_cache, self.kv_connector, config.max_num_batched_tokens,
                                   config.max_num_seqs, config.preemption_mode, config.tenant_scheduling)
        self._requests: dict[str, list[Request]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self.num_failed_steps_in_a_row = 0
        self._last_step_s = self._last_execute_s = 0.0

    # ---- input ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        return self.prompts.encode(prompt, messages)

    def encode_media_prompt(self, messages: list[dict]) -> tuple[list[int], list[MediaItem]]:
        """Chat messages whose content may hold image or audio parts, through the model's HF
        processor (multimodal models only): the prompt's token ids and its media items."""
        if self.multimodal is None:
            raise InvalidRequestError("messages", "this model takes text only")
        if self._media_prompts is None:
            from cluster.engine.media_prompt import MediaPromptEncoder

            self._media_prompts = MediaPromptEncoder(self.config.model, self.multimodal,
                                                     max_text_chars=self.prompts.max_prompt_chars)
        token_ids, media = self._media_prompts.encode(messages)
        return self.prompts.check(token_ids), media

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        salt: str | None = None,
        *,
        media: list[MediaItem] = (),
        export_kv: bool = False,
        prefilled: PrefillResult | None = None,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> list[RequestDelta]:
        """Queue a request. `media`: its images or audio clips, in the order of their placeholders
        in the prompt, encoded already or encoded here (colocated encoder). Disaggregation:
        `export_kv` (prefill side) collects its KV as it is computed and hands it out with its
        last delta; `prefilled` (decode side) starts from a prefill engine's first token and KV.
        `tenant` and its `weight`: the share of the engine its requests get under contention.
        Returns deltas ready now (a prefilled first token)."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if (export_kv or prefilled) and params.n != 1:
            raise InvalidRequestError("n", "disaggregated prefill takes n = 1 only")
        if not (isinstance(prompt_token_ids, CheckedPrompt) and prompt_token_ids.has_room_for(params.max_tokens)):
            self.prompts.check(prompt_token_ids, params.max_tokens)
        media = self._encode_media(list(media))
        segments = place_media(prompt_token_ids, self.multimodal.placeholder_token_id, media, "prompt") \
            if self.multimodal else []
        eos = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        backend = self.tokenizer.backend_tokenizer
        structured = params.structured_output
        if structured is not None:
            self.grammars.compile(structured)  # a spec that cannot compile fails here, before any child
        children = []
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                Request(
                    request_id=child_id,
                    parent_id=request_id,
                    index=i,
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    detokenizer=IncrementalDetokenizer(
                        backend, prompt_token_ids, params.stop, params.skip_special_tokens
                    ),
                    eos_token_ids=tuple(eos),
                    max_model_len=self.max_model_len,
                    salt=salt,
                    tenant=tenant,
                    weight=weight,
                    grammar=self.grammars.matcher(structured) if structured is not None else None,
                    media=media,
                    media_segments=segments,
                )
            )
            if params.seed is not None:
                self._generators[child_id] = torch.Generator().manual_seed(params.seed + i)
        self._requests[request_id] = children
        if prefilled is not None:
            return self._start_prefilled(children[0], prefilled)
        for child in children:
            self.kv_connector.on_add(child, export=export_kv)
            self.scheduler.add(child)
        return []

    def _encode_media(self, media: list[MediaItem]) -> list[MediaItem]:
        if media and self.multimodal is None:
            raise InvalidRequestError(media[0].where, "this model takes text only")
        for item in media:
            if item.modality != self.multimodal.modality:
                raise InvalidRequestError(item.where, f"this model takes {self.multimodal.modality}, not {item.modality}")
        if any(item.embeddings is None for item in media):
            if self.encoder is None:
                raise InvalidRequestError(media[0].where, "arrived unencoded at an engine whose encoder is a deployment")
            self.encoder.encode_items(media)
        return media

    def _build_encoder(self, config: EngineConfig):
        from cluster.engine.embedding_cache import CachingEncoder
        from model.multimodal import MediaEncoder

        return CachingEncoder(MediaEncoder(config.model, parse_dtype(config.dtype), config.device),
                              config.embedding_cache_bytes)

    def _start_prefilled(self, request: Request, prefilled: PrefillResult) -> list[RequestDelta]:
        """The first token was sampled by the prefill engine: append it here (stop checks run with
        this request's own params); unless it ends the request, queue the request with the KV."""
        if prefilled.generator_state is not None and request.request_id in self._generators:
            self._generators[request.request_id].set_state(prefilled.generator_state)
        self.kv_connector.on_add(request, imported=prefilled.kv_parts)
        request.num_cached_tokens = prefilled.num_cached_tokens
        delta = self._append(request, SampledToken(prefilled.token_id, prefilled.logprobs))
        if not request.is_finished:
            self.scheduler.add(request)
        return [delta]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns whether it was still running."""
        children = self._requests.pop(request_id, None)
        if children is None:
            return False
        for child in children:
            if not child.is_finished:
                self.scheduler.finish(child, FinishReason.ABORT)
            self._generators.pop(child.request_id, None)
        return True

    # ---- the loop ------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestDelta]:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        self.kv_connector.save_before_step()  # what the step would overwrite: swap copies, evicted pages
        if plan.is_empty:
            return []
        inputs = self.build_inputs(plan)
        execute_start = time.perf_counter()
        output = self._execute(inputs)
        self._last_execute_s = time.perf_counter() - execute_start
        deltas = self.update(plan, output)
        self.kv_connector.store_shared()
        self._last_step_s = time.perf_counter() - start
        return deltas

    @property
    def is_broken(self) -> bool:
        """Whether steps keep failing whatever they run: no request can succeed here any more."""
        return self.num_failed_steps_in_a_row >= BROKEN_AFTER_FAILED_STEPS

    def _execute(self, inputs: list[SequenceInput]) -> StepOutput:
        """executor.execute, with a fault kept to the requests it belongs to: a step that raises
        runs once more (a passing fault), then in halves down to single requests; the requests
        that fail alone get an error in `failed`, the others their tokens. A lost worker is no
        request's fault: it is raised."""
        try:
            output = self.executor.execute(inputs)
        except WorkerLostError:
            raise
        except Exception:  # noqa: BLE001 - any fault: isolated below, logged once here
            logger.exception("a step of %d requests failed; running it again, apart if it fails again", len(inputs))
            output = StepOutput([None] * len(inputs), [[] for _ in inputs])
            self._execute_apart(inputs, list(range(len(inputs))), output)
        all_failed = len(output.failed) == len(inputs)
        self.num_failed_steps_in_a_row = self.num_failed_steps_in_a_row + 1 if all_failed else 0
        return output

    def _execute_apart(self, inputs: list[SequenceInput], indices: list[int], output: StepOutput) -> None:
        try:
            part = self.executor.execute([inputs[i] for i in indices])
        except WorkerLostError:
            raise
        except Exception as e:  # noqa: BLE001
            if len(indices) == 1:
                logger.error("request %d of the step fails on its own: %r", indices[0], e)
                output.failed[indices[0]] = "the engine failed while running this request"
                return
            half = len(indices) // 2
            self._execute_apart(inputs, indices[:half], output)
            self._execute_apart(inputs, indices[half:], output)
            return
        for j, i in enumerate(indices):
            output.sampled[i], output.kv_parts[i] = part.sampled[j], part.kv_parts[j]
            if j in part.failed:
                output.failed[i] = part.failed[j]

    def spill_prefix_cache(self) -> int:
        """Move every cached block that no request holds down to the lower tiers, freeing device
        memory (a drain before a planned restart; benchmarks). Returns how many went down."""
        offload = self.kv_connector.offload
        if offload is None:
            return 0
        pool = self.kv_cache.pool
        held = pool.allocate(pool.num_free_blocks)  # evicts (and records) every cached free block
        pool.free(held)
        count = self.kv_connector.spill(pool.take_evicted())
        offload.flush()
        return count

    def build_inputs(self, plan: SchedulerPlan) -> list[SequenceInput]:
        inputs, connector = [], self.kv_connector
        for s in plan.scheduled:
            request, start = s.request, s.request.num_computed_tokens
            block_ids = self.kv_cache.block_ids(request.request_id)
            imported = connector.take_import(request.request_id)  # once, before the request's first step
            # pages from a lower tier or a swap copy, into their blocks
            restored = list(zip([block_ids[i] for i in s.restore], connector.take_pages(request.request_id, s.restore)))
            inputs.append(
                SequenceInput(
                    new_token_ids=request.token_ids[start : start + s.num_new_tokens],
                    num_computed_tokens=start,
                    block_ids=block_ids,
                    sampling=self._sampling_row(request) if s.samples else None,
                    export_kv_from=connector.export_from(request.request_id),
                    import_kv=KVImport(*imported, request.num_prompt_tokens) if imported else None,
                    restore_blocks=restored or None,
                    embeds=step_embeds(request.media_segments, request.media, start, start + s.num_new_tokens),
                )
            )
        self._constrain(plan, inputs)
        return inputs

    def _constrain(self, plan: SchedulerPlan, inputs: list[SequenceInput]) -> None:
        """Structured output: the tokens each constrained request may sample, one bitmask for all."""
        constrained = [i for i, s in enumerate(plan.scheduled) if s.samples and s.request.grammar is not None]
        if not constrained:
            return
        bitmask = self.grammars.bitmasks([plan.scheduled[i].request.grammar for i in constrained])
        for row, i in enumerate(constrained):
            inputs[i].sampling.allowed_tokens = bitmask[row]

    @functools.cached_property
    def grammars(self):
        """xgrammar's compiler for this tokenizer and vocabulary (built on the first structured request)."""
        from cluster.engine.structured_output import Grammars

        return Grammars(self.tokenizer, self.model_config.vocab_size)

    def update(self, plan: SchedulerPlan, output: StepOutput) -> list[RequestDelta]:
        # Failed requests end first: their blocks (whose KV may be bad) are never cached.
        deltas = [self._fail(plan.scheduled[i].request, reason) for i, reason in output.failed.items()]
        self.scheduler.update(plan)
        for i, (s, token, parts) in enumerate(zip(plan.scheduled, output.sampled, output.kv_parts)):
            request = s.request
            if i in output.failed:
                continue
            self.kv_connector.on_exported(request.request_id, parts, request.num_computed_tokens)
            if token is not None:
                deltas.append(self._append(request, token))
        return deltas

    def _append(self, request: Request, token: SampledToken) -> RequestDelta:
        text = request.append_output(token.token_id)
        prefilled = None
        if request.finish_reason is not None:
            exported = self.kv_connector.take_exported(request.request_id)
            if exported is not None:
                generator = self._generators.get(request.request_id)
                prefilled = PrefillResult(token.token_id, token.logprobs, exported,
                                          generator.get_state() if generator is not None else None,
                                          request.num_cached_tokens)
            if request.status != RequestStatus.WAITING:  # a prefilled first token may end it unqueued
                self.scheduler.finish(request, request.finish_reason)
            else:
                request.status = RequestStatus.FINISHED
                self.kv_connector.free(request.request_id)
            self._generators.pop(request.request_id, None)
            self._forget_if_done(request.parent_id)
        return RequestDelta(
            request_id=request.parent_id,
            index=request.index,
            new_token_ids=[token.token_id],
            new_text=text,
            new_logprobs=[token.logprobs] if token.logprobs is not None else [],
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prefilled=prefilled,
        )

    def _fail(self, request: Request, reason: str) -> RequestDelta:
        self.scheduler.finish(request, FinishReason.ERROR)
        self._generators.pop(request.request_id, None)
        self._forget_if_done(request.parent_id)
        return RequestDelta(request.parent_id, request.index, [], "", [], FinishReason.ERROR.value,
                            request.num_prompt_tokens, error=reason)

    def _sampling_row(self, request: Request) -> SamplingRow:
        params = request.params
        return SamplingRow(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            generator=self._generators.get(request.request_id, self._default_generator),
            num_logprobs=params.logprobs,
        )

    def _forget_if_done(self, parent_id: str) -> None:
        children = self._requests.get(parent_id, [])
        if all(child.is_finished for child in children):
            self._requests.pop(parent_id, None)

    # ---- introspection -------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler, pool = self.scheduler, self.kv_cache.pool
        return EngineStats(
            num_running=len(scheduler.running), num_waiting=self.num_waiting,
            num_prefilling=sum(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running),
            num_tokens_to_prefill=sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting)
            + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in scheduler.running),
            kv_blocks_total=self.num_blocks, kv_blocks_free=self.num_free_blocks,
            prefix_cache_queried_tokens=pool.stats.num_queried_tokens, prefix_cache_hit_tokens=pool.stats.num_hit_tokens,
            num_preemptions=scheduler.num_preemptions, num_swapped_in=self.kv_connector.num_swapped_in,
            num_swapped_blocks=self.kv_connector.num_swapped_blocks,
            last_step_s=self._last_step_s, last_execute_s=self._last_execute_s)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission (safe to read from another thread: a length)."""
        return len(self.scheduler.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks


def model_identity(model_dir: Path, config: EngineConfig) -> str:
    """What makes a KV page reusable: the same weights (their bytes, not the directory's name),
    layout and numerics. It roots every block hash and is in every page's header."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    weights = weights_fingerprint(model_dir)[:32]
    # A cache of another dtype than the model's holds other values: its own pages (an "auto" cache
    # keeps the identity it always had).
    numerics = config.dtype if config.kv_dtype == config.dtype else f"{config.dtype}-kv-{config.kv_dtype}"
    return f"{model_dir.name}:{digest}:{weights}:{numerics}:{config.quantization or 'noquant'}:bs{config.block_size}"
