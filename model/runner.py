"""ModelRunner: the only place that turns a step's sequences into tensors and runs the model.

    [SequenceInput ...] --prepare--> StepTensors (ids, positions, AttentionContext, rows to sample)
                        --forward--> hidden states --logits of sampled rows--> sample --> tokens

It owns the weights and the KV cache tensors; which blocks a sequence uses is decided outside
(cache_service's block manager) and arrives as block ids.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from cluster.engine.executor import SampledToken, SequenceInput, StepOutput
from model.attention import AttentionContext, build_attention_context
from model.attention_flashinfer import build_flashinfer_attention
from model.config import ModelConfig
from model.cpu_ops import cpu_ops
from model.decode_stack import build_decode_stack
from model.kv_transfer import KVExporter, from_numpy, install, to_numpy, token_slots
from model.llama import LlamaForCausalLM
from model.loader import dtype_name, load_weights
from model.multimodal_spec import MultimodalSpec
from model.quantization import GroupedWeight, check_mode, dense_from_once
from model.sampler import sample
from model.tp_layout import head_shard


# Chunks longer than this attend through SDPA on gathered blocks, faster once the chunk's own
# queries share the K/V reads (measured in docs/benchmarks-log.md).
KERNEL_MAX_QUERIES = 16
KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches the paged kernel reads


@dataclass(slots=True)
class StepTensors:
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: AttentionContext
    sample_rows: torch.Tensor  # rows of the hidden states whose logits are sampled
    order: list[int]  # step order (decodes first) -> index in the caller's list
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, their input embeddings)


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_bytes: int = 1 << 30,
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
        device: str = "cpu",
        quantization: str | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce=None,
        kv_put=None,
        kv_get=None,
    ):
        """With tp_size > 1 this runner is one rank of a tensor-parallel group: it holds its shard
        of the weights and of the KV cache, and `reduce` all-reduces partial sums across ranks.
        kv_put / kv_get move exported KV (model/kv_transfer.py); default: in-process.
        kv_cache_dtype: the KV cache's element type (default: the model's); the step computes in
        `dtype` and rounds K and V to it as they are written."""
        self.config = ModelConfig.from_dir(model_dir)
        self.tp_rank = tp_rank
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.kv_dtype = kv_cache_dtype or dtype
        self.max_model_len = min(max_model_len or self.config.max_model_len, self.config.max_model_len)
        with torch.device(self.device), _default_dtype(dtype):
            self.model = LlamaForCausalLM(self.config, self.max_model_len, tp_rank, tp_size, reduce)
        self.num_kv_heads = self.model.layers[0].self_attn.num_kv_heads  # this rank's
        c = self.config
        kv = head_shard(c.num_attention_heads, c.num_key_value_heads, tp_size, tp_rank).kv_heads
        self.kv_heads = (kv.start, kv.stop)  # global indices
        # With replicated KV heads only the first rank holding a head exports it.
        first_holder = all(head_shard(c.num_attention_heads, c.num_key_value_heads, tp_size, r).kv_heads != kv
                           for r in range(tp_rank))
        self._exporter = KVExporter(kv_put or (lambda x: x), self.kv_heads) if first_holder else None
        self._kv_get = kv_get or (lambda xs: xs)
        load_weights(self.model, model_dir, multimodal=MultimodalSpec.from_dir(model_dir) is not None)
        # Decodes and chunks of up to this many queries attend through the paged kernel (0: no kernel).
        kernel = self.device.type == "cpu" and cpu_ops() is not None and self.kv_dtype in KERNEL_KV_DTYPES
        self.kernel_max_queries = KERNEL_MAX_QUERIES if kernel else 0
        self.quantization = check_mode(quantization, self.device)
        self.weight_formats = self.model.quantize(self.quantization)
        # Where prefill chunks leave the group kernel for torch's GEMM, as this host measures it
        # ({} without grouped weights; {"dense_from": None}: the group kernel at every size)
        grouped = [m.packed for m in self.model.modules() if isinstance(getattr(m, "packed", None), GroupedWeight)]
        largest = max(grouped, key=lambda w: w.shape[0] * w.shape[1], default=None)
        self.group_kernel = {} if largest is None else {"dense_from": dense_from_once(largest)}
        self.model.eval()
        self.num_blocks = num_blocks or max(1, kv_cache_bytes // self.bytes_per_block)
        # One allocation for all layers: [layers, K/V, blocks, kv_heads, block_size, head_dim]
        self.kv_cache = torch.zeros(
            c.num_hidden_layers, 2, self.num_blocks, self.num_kv_heads, block_size, c.head_dim,
            dtype=self.kv_dtype, device=self.device,
        )
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[i, 0], self.kv_cache[i, 1]
        self.model.decode_stack = build_decode_stack(self.model) if self.kernel_max_queries else None
        layer = self.model.attention_layers[0]
        # FlashInfer's kernels take one dtype for queries and cache; a mixed pair attends through torch.
        self.flashinfer = build_flashinfer_attention(self.device, dtype, layer.num_heads, layer.num_kv_heads,
                                                     layer.head_dim, block_size) if self.kv_dtype == dtype else None

    def read_blocks(self, block_ids: list[int]) -> list[np.ndarray]:
        """A copy of each block's KV, this rank's heads: [layers, K/V, kv_heads, block_size, head_dim]
        (bfloat16 as its int16 bits: numpy has no bfloat16). With TP=1, a page payload as it is;
        a TP group joins its ranks' heads (TPGroup.read_blocks)."""
        blocks = self.kv_cache[:, :, block_ids].movedim(2, 0).contiguous().cpu()
        return list(to_numpy(blocks))

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """From page payloads, which hold every KV head (any TP degree wrote them): this rank's heads."""
        c = self.config
        shape = (c.num_hidden_layers, 2, c.num_key_value_heads, self.block_size, c.head_dim)
        first, last = self.kv_heads
        for block_id, payload in zip(block_ids, payloads):  # one copy each (a stack first costs 4x more)
            page = from_numpy(np.frombuffer(payload, _numpy_dtype(self.kv_dtype)).reshape(shape), self.kv_dtype)
            self.kv_cache[:, :, block_id] = page[:, :, first:last].to(self.device)

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.num_kv_heads, self.block_size, self.kv_dtype)

    def describe(self) -> list[dict]:
        return [{"rank": self.tp_rank, "pid": os.getpid(), "kv_heads": self.num_kv_heads, "num_blocks": self.num_blocks,
                 "max_model_len": self.max_model_len, "quantization": self.quantization,
                 "weight_formats": self.weight_formats, "amx_tiles": self._amx_tiles(), **self.group_kernel,
                 "kv_cache_dtype": dtype_name(self.kv_dtype),
                 "attention": self._attention_path()}]

    def _amx_tiles(self) -> bool:
        """Whether the grouped weights multiply batches on AMX tiles (hosts that have them)."""
        ops = cpu_ops() if self.device.type == "cpu" else None
        return bool(ops is not None and ops.amx_tiles())

    def _attention_path(self) -> str:
        if self.flashinfer is not None:
            return "FlashInfer paged kernels"
        if not self.kernel_max_queries:
            return "gathered blocks + SDPA"
        return "paged kernel, layer stack" if self.model.decode_stack is not None else "paged kernel"

    def shutdown(self) -> None:
        """Nothing to release: the tensors go with this object."""

    def prepare(self, seqs: list[SequenceInput]) -> StepTensors:
        # Decodes (one new token) first: attention batches them in one pass.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].new_token_ids) != 1)
        ordered = [seqs[i] for i in order]
        num_decodes = sum(1 for s in ordered if len(s.new_token_ids) == 1)
        input_ids, positions, sample_rows, embed_rows, embed_values = [], [], [], [], []
        for s in ordered:
            for offset, rows in s.embeds or ():
                embed_rows += range(len(input_ids) + offset, len(input_ids) + offset + len(rows))
                embed_values.append(rows)
            input_ids += s.new_token_ids
            positions += range(s.num_computed_tokens, s.num_computed_tokens + len(s.new_token_ids))
            if s.sampling is not None:
                sample_rows.append(len(input_ids) - 1)
        ctx = build_attention_context(
            self.block_size,
            num_decodes,
            [len(s.new_token_ids) for s in ordered],
            [s.num_computed_tokens + len(s.new_token_ids) for s in ordered],
            [s.block_ids for s in ordered],
            self.device,
            self.kernel_max_queries,
            self.flashinfer,
        )
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        embeds = None
        if embed_values:
            embeds = as_long(embed_rows), torch.cat(embed_values).to(device=self.device, dtype=self.dtype)
        return StepTensors(as_long(input_ids), as_long(positions), ctx, as_long(sample_rows), order, embeds)

    @torch.inference_mode()
    def forward(self, step: StepTensors, after_layer=None) -> torch.Tensor:
        """The bare model: hidden states -> logits of the rows to sample."""
        hidden = self.model(step.input_ids, step.positions, step.ctx, after_layer, step.embeds)
        return self.model.compute_logits(hidden[step.sample_rows])

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput]) -> StepOutput:
        """One step: install imported KV, run the model (exporting KV layer by layer where asked),
        sample. Returns each sequence's sampled token (None mid-prefill) and exported parts."""
        for s in seqs:
            if s.restore_blocks:
                self.write_blocks(*zip(*s.restore_blocks))
            if s.import_kv is not None:
                blocks, offsets = token_slots(s.block_ids, s.import_kv.start, s.import_kv.stop, self.block_size, self.device)
                install(self.kv_cache, s.import_kv, self.kv_heads, blocks, offsets, self._kv_get)
        exports = [
            (i, (s.export_kv_from, end), *token_slots(s.block_ids, s.export_kv_from, end, self.block_size, self.device))
            for i, s in enumerate(seqs)
            if s.export_kv_from is not None and self._exporter is not None
            for end in [s.num_computed_tokens + len(s.new_token_ids)]
        ]
        after_layer = None
        if exports:
            self._exporter.begin(exports)
            after_layer = lambda layer: self._exporter.after_layer(layer, self.kv_cache[layer])  # noqa: E731
        step = self.prepare(seqs)
        logits = self.forward(step, after_layer)
        sampled_seqs = [i for i in step.order if seqs[i].sampling is not None]
        token_ids, logprobs = sample(logits, [seqs[i].sampling for i in sampled_seqs])
        results: list[SampledToken | None] = [None] * len(seqs)
        failed = {}
        for i, token_id, lp in zip(sampled_seqs, token_ids, logprobs):
            if token_id is None:
                failed[i] = "the model produced non-finite numbers (NaN or infinity) for this request"
            else:
                results[i] = SampledToken(token_id, lp)
        parts = self._exporter.finish(len(seqs)) if exports else [[] for _ in seqs]
        return StepOutput(results, parts, failed)


def kv_bytes_per_block(config: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens, for a rank holding num_kv_heads heads."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * num_kv_heads * block_size * config.head_dim * elem


@contextmanager
def _default_dtype(dtype: torch.dtype):
    """Build parameters in their final dtype: converting afterwards would replace the Parameter
    objects and drop their weight_loader attributes."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _numpy_dtype(dtype: torch.dtype):
    return np.int16 if dtype == torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype
