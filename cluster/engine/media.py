"""Media items of a request inside the engine: where their embeddings go in the prompt.

A multimodal prompt holds one placeholder token per embedding row of each media item (the model's
HF processor expanded them: cluster/engine/media_prompt.py). The items' rows fill the placeholder
positions in order, as HF's `masked_scatter` does; `place_media` records which positions take
which rows, and `step_embeds` hands a step the rows of the positions it computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from cluster.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(slots=True)
class MediaItem:
    """One image or audio clip of a request: the processor's output for it until it is encoded,
    then its embeddings [placeholder tokens, hidden]."""

    modality: str  # "image" or "audio"
    content_hash: bytes  # of the bytes as sent: the embedding cache's key, and part of block hashes
    encoder_inputs: dict[str, np.ndarray] | None
    embeddings: torch.Tensor | None = None
    where: str = "media"  # the request field it came from, for errors: "messages[0].parts[1]"

    @property
    def nbytes(self) -> int:
        e = self.embeddings
        return 0 if e is None else e.numel() * e.element_size()


def content_hash(modality: str, data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(modality.encode() + b"\0" + data)


@dataclass(frozen=True, slots=True)
class MediaSegment:
    """Prompt positions [start, start + length) take rows [row, row + length) of item `item`."""

    start: int
    length: int
    item: int
    row: int
    content_hash: bytes  # the item's (a block holding these positions hashes it: cache_service/hashing.py)


def place_media(token_ids: list[int], placeholder_id: int, items: list[MediaItem], field: str) -> list[MediaSegment]:
    """The segments of a prompt whose placeholders the items fill, in order. The number of
    placeholders must equal the items' rows: a prompt that spells a placeholder in its text, or
    an item its processor did not expand, is refused (HF raises on both too)."""
    positions = [i for i, t in enumerate(token_ids) if t == placeholder_id]
    num_rows = sum(len(item.embeddings) for item in items)
    if len(positions) != num_rows:
        raise InvalidRequestError(
            field, f"has {len(positions)} media placeholder tokens but its {len(items)} media item(s) fill {num_rows}; "
                   "a prompt may not spell the model's placeholder token itself")
    segments, p = [], 0
    for index, item in enumerate(items):
        row = 0
        while row < len(item.embeddings):
            start = positions[p]
            length = 1
            while row + length < len(item.embeddings) and positions[p + length] == start + length:
                length += 1
            segments.append(MediaSegment(start, length, index, row, item.content_hash))
            row, p = row + length, p + length
    return segments


def step_embeds(segments: list[MediaSegment], items: list[MediaItem], start: int, stop: int):
    """(offset from `start`, rows) for the media positions among [start, stop); None if none."""
    embeds = []
    for s in segments:
        lo, hi = max(start, s.start), min(stop, s.start + s.length)
        if lo < hi:
            rows = items[s.item].embeddings[s.row + lo - s.start : s.row + hi - s.start]
            embeds.append((lo - start, rows))
    return embeds or None
