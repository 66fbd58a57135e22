"""Chained hashes of full KV blocks.

A block's hash covers its parent's hash, its own token ids and the content hash of every media
item (image, audio clip) whose placeholder tokens it holds, so equal hashes mean an equal whole
prefix: two prompts with the same text and different images share no block. The chain starts from a root that covers the model identity and an optional salt (a tenant's,
later), so two models or two tenants never share a page. xxh3-128 is fast and wide enough that a
collision is not a practical worry; a hit still checks the token ids (see BlockPool.get_cached_block).
"""

from __future__ import annotations

from array import array
from typing import Protocol, Sequence

import xxhash

BlockHash = bytes


class MediaSpan(Protocol):
    """Prompt positions [start, start + length) hold placeholders of the media item content_hash."""

    start: int
    length: int
    content_hash: bytes


def root_hash(model_identity: str, salt: str | None = None) -> BlockHash:
    """The parent hash of a sequence's first block."""
    text = f"pagoda-kv-v1\0{model_identity}\0{salt or ''}"
    return xxhash.xxh3_128_digest(text.encode())


def hash_block_tokens(parent: BlockHash, token_ids: list[int] | tuple[int, ...], media: bytes = b"") -> BlockHash:
    return xxhash.xxh3_128_digest(parent + array("I", token_ids).tobytes() + media)


def hash_full_blocks(
    token_ids: list[int], block_size: int, parent: BlockHash, start_block: int = 0,
    media: Sequence[MediaSpan] = (),
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`
    (the hash of block `start_block - 1`, or the root)."""
    hashes = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        stop = start + block_size
        held = b"".join(s.content_hash for s in media if s.start < stop and s.start + s.length > start)
        parent = hash_block_tokens(parent, token_ids[start:stop], held)
        hashes.append(parent)
    return hashes
