"""LLMEngine: requests in, token deltas out, one step at a time.

    add_request ──> Scheduler.schedule() ──plan──> ModelRunner.execute() ──sampled tokens──┐
                                                                                         │
    deltas <── Request.append_output (detokenize, stop checks) <── update(plan, output) <─┘

The engine owns the tokenizer, the model runner, the block manager and the scheduler. It is
synchronous and single-threaded; the server (cluster/serve) runs its step loop in a thread.

A fault belongs to the request that caused it: a request whose numbers go bad fails alone
(finish_reason "error"), and a step that raises is run once more, then in halves until each
failing request stands alone; only those fail. Steps that fail for every request they run, again
and again, mean the engine itself is broken (`is_broken`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from transformers import AutoTokenizer

from cache_service import KVCacheManager, page_codec
from cache_service.offload import KVOffload
from cache_service.tiers import build_tiers
from cluster.engine.config import EngineConfig
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.errors import InvalidRequestError, WorkerLostError
from cluster.engine.outputs import PrefillResult, RequestDelta
from cluster.engine.prompt import PromptEncoder
from cluster.engine.request import FinishReason, Request, RequestStatus
from cluster.engine.sampling_params import SamplingParams
from cluster.engine.scheduler import Scheduler, SchedulerPlan
from model.loader import parse_dtype, weights_fingerprint
from model.kv_transfer import KVImport
from model.runner import ModelRunner, SampledToken, SequenceInput, StepOutput, kv_bytes_per_block
from model.sampler import SamplingRow

logger = logging.getLogger("pagoda.engine")

# Steps in a row in which every request failed: then the engine, not a request, is at fault.
BROKEN_AFTER_FAILED_STEPS = 3


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = Path(config.model)
        runner_options = dict(
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_bytes=config.kv_cache_bytes,
            max_model_len=config.max_model_len,
            dtype=parse_dtype(config.dtype),
            device=config.device,
            quantization=config.quantization,
        )
        if config.tensor_parallel_size > 1:
            from cluster.executor.tp_group import TPGroup

            self.runner = TPGroup(str(model_dir), config.tensor_parallel_size, collective=config.tp_collective,
                                  **runner_options)
        else:
            if config.kv_role is not None:  # KV goes to / comes from another process
                import ray

                runner_options.update(kv_put=ray.put, kv_get=ray.get)
            self.runner = ModelRunner(model_dir, **runner_options)
        self.model_config = self.runner.config
        # A single request must always fit in the cache, or preempting it could never help.
        self.max_model_len = min(self.runner.max_model_len, self.runner.num_blocks * config.block_size)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.prompts = PromptEncoder(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.model_identity = _model_identity(model_dir, config)
        self.kv_cache = KVCacheManager(
            self.runner.num_blocks, config.block_size, self.model_identity, config.enable_prefix_caching,
            offload=self._build_offload(config), write_through=config.kv_write_through,
        )
        c = self.model_config
        page_bytes = kv_bytes_per_block(c, c.num_key_value_heads, config.block_size, parse_dtype(config.dtype))
        self.scheduler = Scheduler(self.kv_cache, config.max_num_batched_tokens, config.max_num_seqs,
                                   config.preemption_mode, prefetch=config.kv_prefetch,
                                   swap_space_blocks=config.swap_space_bytes // page_bytes)
        self._requests: dict[str, list[Request]] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(config.seed)
        self.num_failed_steps_in_a_row = 0

    # ---- input ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> list[int]:
        return self.prompts.encode(prompt, messages)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        salt: str | None = None,
        *,
        export_kv: bool = False,
        prefilled: PrefillResult | None = None,
    ) -> list[RequestDelta]:
        """Queue a request. Disaggregation: `export_kv` (prefill side) collects its KV as it is
        computed and hands it out with its last delta; `prefilled` (decode side) starts from a
        prefill engine's first token and KV. Returns deltas ready now (a prefilled first token)."""
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already running")
        if (export_kv or prefilled) and params.n != 1:
            raise InvalidRequestError("n", "disaggregated prefill takes n = 1 only")
        self.prompts.check(prompt_token_ids, params.max_tokens)
        eos = self.model_config.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        backend = self.tokenizer.backend_tokenizer
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
                    export_kv=export_kv,
                )
            )
            if params.seed is not None:
                self._generators[child_id] = torch.Generator().manual_seed(params.seed + i)
        self._requests[request_id] = children
        if prefilled is not None:
            return self._start_prefilled(children[0], prefilled)
        for child in children:
            self.scheduler.add(child)
        return []

    def _start_prefilled(self, request: Request, prefilled: PrefillResult) -> list[RequestDelta]:
        """The first token was sampled by the prefill engine: append it here (stop checks run with
        this request's own params); unless it ends the request, queue the request with the KV."""
        if prefilled.generator_state is not None and request.request_id in self._generators:
            self._generators[request.request_id].set_state(prefilled.generator_state)
        request.kv_import = prefilled.kv_parts
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
        plan = self.scheduler.schedule()
        # Before the step overwrites blocks just handed out again: copy what must survive.
        for request in plan.preempted:
            if request.swap_out is not None:
                block_ids, num_computed = request.swap_out
                request.swapped, request.swap_out = (num_computed, self.runner.read_blocks(block_ids)), None
        if self.kv_cache.offload is not None:
            self._spill_evicted()
        if plan.is_empty:
            return []
        deltas = self.update(plan, self._execute(self.build_inputs(plan)))
        if self.kv_cache.offload is not None:  # blocks first shared (and, write-through, just filled)
            self._spill(self.kv_cache.pool.take_to_store())
        return deltas

    @property
    def is_broken(self) -> bool:
        """Whether steps keep failing whatever they run: no request can succeed here any more."""
        return self.num_failed_steps_in_a_row >= BROKEN_AFTER_FAILED_STEPS

    def _execute(self, inputs: list[SequenceInput]) -> StepOutput:
        """runner.execute, with a fault kept to the requests it belongs to: a step that raises
        runs once more (a passing fault), then in halves down to single requests; the requests
        that fail alone get an error in `failed`, the others their tokens. A lost worker is no
        request's fault: it is raised."""
        try:
            output = self.runner.execute(inputs)
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
            part = self.runner.execute([inputs[i] for i in indices])
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
        if self.kv_cache.offload is None:
            return 0
        pool = self.kv_cache.pool
        held = pool.allocate(pool.num_free_blocks)  # evicts (and records) every cached free block
        pool.free(held)
        count = self._spill_evicted()
        self.kv_cache.offload.flush()
        return count

    def _spill_evicted(self) -> int:
        """Cached blocks this schedule handed out for new contents: copy them now, before the
        step overwrites them; the writer thread compresses and stores them."""
        return self._spill(self.kv_cache.pool.take_evicted())

    def _spill(self, blocks: list[tuple[int, bytes]]) -> int:
        if blocks:
            payloads = self.runner.read_blocks([block_id for block_id, _ in blocks])
            self.kv_cache.offload.spill([(block_hash, payload) for (_, block_hash), payload in zip(blocks, payloads)])
        return len(blocks)

    def build_inputs(self, plan: SchedulerPlan) -> list[SequenceInput]:
        inputs = []
        for s in plan.scheduled:
            request, start = s.request, s.request.num_computed_tokens
            imported, restored = None, None
            if request.kv_import is not None:  # installed once, before the request's first step
                imported = KVImport(request.kv_import, request.kv_import_from, request.num_prompt_tokens)
                request.kv_import = None
            if s.restore:  # pages from a lower tier or a swap copy, into their blocks
                block_ids = self.kv_cache.block_ids(request.request_id)
                restored = [(block_ids[index], payload) for index, payload in s.restore]
            inputs.append(
                SequenceInput(
                    new_token_ids=request.token_ids[start : start + s.num_new_tokens],
                    num_computed_tokens=start,
                    block_ids=self.kv_cache.block_ids(request.request_id),
                    sampling=self._sampling_row(request) if s.samples else None,
                    # from 0 on the first chunk: a prefix-cache hit must travel too
                    export_kv_from=request.num_exported_tokens if request.export_kv else None,
                    import_kv=imported,
                    restore_blocks=restored,
                )
            )
        return inputs

    def update(self, plan: SchedulerPlan, output: StepOutput) -> list[RequestDelta]:
        # Failed requests end first: their blocks (whose KV may be bad) are never cached.
        deltas = [self._fail(plan.scheduled[i].request, reason) for i, reason in output.failed.items()]
        self.scheduler.update(plan)
        for i, (s, token, parts) in enumerate(zip(plan.scheduled, output.sampled, output.kv_parts)):
            request = s.request
            if i in output.failed:
                continue
            if request.export_kv:
                request.kv_parts += parts
                request.num_exported_tokens = request.num_computed_tokens
            if token is not None:
                deltas.append(self._append(request, token))
        return deltas

    def _append(self, request: Request, token: SampledToken) -> RequestDelta:
        text = request.append_output(token.token_id, token.logprobs)
        prefilled = None
        if request.finish_reason is not None:
            if request.export_kv:
                generator = self._generators.get(request.request_id)
                prefilled = PrefillResult(token.token_id, token.logprobs, request.kv_parts,
                                          generator.get_state() if generator is not None else None)
            if request.status != RequestStatus.WAITING:  # a prefilled first token may end it unqueued
                self.scheduler.finish(request, request.finish_reason)
            else:
                request.status = RequestStatus.FINISHED
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

    def _build_offload(self, config: EngineConfig) -> KVOffload | None:
        if not (config.host_kv_bytes or config.disk_kv_bytes):
            return None
        c = self.model_config
        # Pages hold every KV head whatever the TP degree (TPGroup.read_blocks joins the ranks'),
        # so the degree is not part of their identity: a TP=2 server's pages serve a TP=1 one.
        identity = {"model": self.model_identity, "layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads,
                    "head_dim": c.head_dim, "block_size": config.block_size, "dtype": config.dtype}
        if config.kv_cache_service_shards:
            from cache_service.service import shared_tier

            tiers = [shared_tier(identity, config.kv_cache_service_shards, config.host_kv_bytes,
                                 config.disk_kv_bytes, config.kv_cache_dir)]
        else:
            tiers = build_tiers(identity, config.host_kv_bytes, config.disk_kv_bytes, config.kv_cache_dir)
        return KVOffload(tiers, identity, codec=page_codec.CODECS[config.kv_page_codec])

    # ---- introspection -------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks


def _model_identity(model_dir: Path, config: EngineConfig) -> str:
    """What makes a KV page reusable: the same weights (their bytes, not the directory's name),
    layout and numerics. It roots every block hash and is in every page's header."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]
    weights = weights_fingerprint(model_dir)[:32]
    return f"{model_dir.name}:{digest}:{weights}:{config.dtype}:{config.quantization or 'noquant'}:bs{config.block_size}"
