"""KV moving between engines (disaggregated prefill -> decode), layer by layer.

The prefill side exports, for each layer as soon as that layer has run, the K/V of the tokens a
step computed for a request; the decode side installs them into its own blocks before its first
step for that request. A part names its token range and its *global* KV heads, so a decode group
with another TP degree takes the heads it holds from whichever prefill ranks sent them:
re-sharding is picking and concatenating heads.

Parts travel through a `put` function and come back through `get`. In the cluster these are
Ray's object store (ray.put / ray.get): a put copies the layer into shared memory, which a reader
on the same node maps without copying and a reader on another node pulls. The put runs in a
sender thread, so layer i's copy overlaps layer i+1's compute. Without Ray (one process) both
are the identity.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from model.loader import dtype_name, parse_dtype


@dataclass(slots=True)
class KVPart:
    layer: int
    heads: tuple[int, int]  # global KV heads [start, stop)
    tokens: tuple[int, int]  # positions [start, stop)
    nbytes: int
    dtype: str  # torch dtype name: bfloat16 travels as int16 (numpy has no bfloat16)
    data: Any  # [tokens, 2 (K, V), heads, head_dim]: an array, or an object-store reference to one


@dataclass(slots=True)
class KVImport:
    """KV to write into a sequence's blocks before its step: positions [start, stop)."""

    parts: list[KVPart]
    start: int
    stop: int


def token_slots(block_ids: list[int], start: int, stop: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each position in [start, stop), as index tensors into a layer's cache."""
    positions = torch.arange(start, stop)
    table = torch.tensor(block_ids, dtype=torch.long)
    return table[positions // block_size].to(device), (positions % block_size).to(device)


class KVExporter:
    """Collects one step's exports. The runner calls `after_layer` as each layer finishes."""

    def __init__(self, put: Callable[[Any], Any], heads: tuple[int, int]):
        self._put = put
        self._heads = heads
        self._sender = ThreadPoolExecutor(1, thread_name_prefix="kv-export")
        self._step: list[tuple[int, tuple[int, int], torch.Tensor, torch.Tensor]] = []
        self._pending: list[tuple[int, KVPart, Future]] = []

    def begin(self, exports: list[tuple[int, tuple[int, int], torch.Tensor, torch.Tensor]]) -> None:
        """exports: (sequence index, token range, blocks, offsets) for each exporting sequence."""
        self._step = exports
        self._pending = []

    def after_layer(self, layer: int, layer_cache: torch.Tensor) -> None:
        """layer_cache: [2, num_blocks, heads, block_size, head_dim]; gathers a copy on this thread
        (the next layer may not overwrite what it reads), hands the copy to the sender."""
        for index, tokens, blocks, offsets in self._step:
            gathered = layer_cache[:, blocks, :, offsets].cpu()  # [tokens, 2, heads, head_dim]
            data = to_numpy(gathered)
            part = KVPart(layer, self._heads, tokens, data.nbytes, dtype_name(gathered.dtype), None)
            self._pending.append((index, part, self._sender.submit(self._put, data)))

    def finish(self, num_seqs: int) -> list[list[KVPart]]:
        """Waits for the sender; returns each sequence's parts (empty for sequences not exporting)."""
        parts: list[list[KVPart]] = [[] for _ in range(num_seqs)]
        for index, part, future in self._pending:
            part.data = future.result()
            parts[index].append(part)
        self._step, self._pending = [], []
        return parts


def install(layer_caches: torch.Tensor, imp: KVImport, heads: tuple[int, int], blocks: torch.Tensor,
            offsets: torch.Tensor, get: Callable[[list], list]) -> None:
    """Write the parts covering positions [imp.start, imp.stop) and this rank's `heads` into
    `layer_caches` [layers, 2, num_blocks, heads, block_size, head_dim] at (blocks, offsets)."""
    wanted = [p for p in imp.parts if p.heads[0] < heads[1] and heads[0] < p.heads[1]
              and p.tokens[0] < imp.stop and imp.start < p.tokens[1]]
    datas = get([p.data for p in wanted])
    for part, data in zip(wanted, datas):
        data = from_numpy(data, parse_dtype(part.dtype))
        lo, hi = max(part.tokens[0], imp.start), min(part.tokens[1], imp.stop)
        h_lo, h_hi = max(part.heads[0], heads[0]), min(part.heads[1], heads[1])
        src = data[lo - part.tokens[0]: hi - part.tokens[0], :, h_lo - part.heads[0]: h_hi - part.heads[0]]
        rows = slice(lo - imp.start, hi - imp.start)
        cache = layer_caches[part.layer][:, :, h_lo - heads[0]: h_hi - heads[0]]
        cache[:, blocks[rows], :, offsets[rows]] = src.to(cache.device, cache.dtype)


def to_numpy(t: torch.Tensor):
    """A CPU tensor as a numpy array; bfloat16 as its int16 bits (numpy has no bfloat16)."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def from_numpy(array, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of to_numpy, without a copy. Arrays from the object store or from bytes are
    read-only; the tensors made here are only read (copied into the cache)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t
