"""Storage tiers below device memory, behind one interface (`Tier`): put / get / contains /
reject, a byte cap with LRU eviction, and counters. Pages are opaque bytes here: page_codec makes
them and KVOffload checks each one it reads, calling `reject` on a page that fails (counted by
reason; the disk tier moves the file to quarantine/). A page is keyed by its block's hash
(cache_service/hashing.py: `BlockHash`).

    HostTier   an LRU dict in this process's RAM
    DiskTier   one file per page in a directory (local NVMe): written to a temporary name, fsynced,
               renamed (the directory fsynced once per batch), so a crash leaves either the whole
               page or no page; on start the index is rebuilt from the files' headers (pages of
               another model identity or format version are left alone; an empty or cut-short file
               is quarantined) and temporary files are swept; a page that fails its checks is moved
               to quarantine/; a full or unwritable disk turns the tier off with a warning instead
               of failing requests.

`build_tiers` orders them fastest first; the shared CacheService tier (service.py) is the third
implementation. A page found in a slower tier is copied into the faster ones (`promote`).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cache_service import page_codec
from cache_service.hashing import BlockHash

logger = logging.getLogger("pagoda.tiers")


class Tier(Protocol):
    name: str
    outlives_process: bool  # whether its pages survive this process (disk, the cache service)
    stats: TierStats
    used_bytes: int | None  # bytes it holds in this process (None: held elsewhere, as the service's)

    def contains(self, block_hashes: list[BlockHash]) -> list[bool]: ...

    def get_many(self, block_hashes: list[BlockHash]) -> list[bytes | None]: ...

    def put(self, block_hash: BlockHash, page: bytes) -> bool: ...

    def put_many(self, pages: list[tuple[BlockHash, bytes]]) -> int:
        """Returns how many it stored (a full or broken tier stores fewer)."""

    def reject(self, block_hash: BlockHash, reason: str) -> None:
        """A page that failed its checks: counted by reason and never served again."""

    def describe(self) -> dict: ...


def promote(tiers: list[Tier], found_in: int, block_hash: BlockHash, page: bytes) -> None:
    """A page found in tiers[found_in] goes into every faster tier: its next hit is faster."""
    for faster in tiers[:found_in]:
        faster.put(block_hash, page)


class BatchedTier:
    """get_many / put_many for a local tier: plain loops (the shared tier batches them per call)."""

    def get_many(self, block_hashes: list[bytes]) -> list[bytes | None]:
        return [self.get(block_hash) for block_hash in block_hashes]

    def put_many(self, pages: list[tuple[bytes, bytes]]) -> int:
        return sum(self.put(block_hash, page) for block_hash, page in pages)

    def describe(self) -> dict:
        return {"used_bytes": self.used_bytes, "capacity_bytes": self.capacity_bytes, "pages": len(self),
                **self.stats.as_dict()}


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    bad_pages: dict[str, int] = field(default_factory=dict)  # reason -> count

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "hit_rate": self.hits / lookups if lookups else 0.0,
                "puts": self.puts, "evictions": self.evictions, "bad_pages": dict(self.bad_pages)}


class HostTier(BatchedTier):
    name = "host"
    outlives_process = False

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0  # cached pages
        # Taken out of the cap for swap copies (HostTierSwapSpace): one budget for host RAM's KV.
        self.reserved_bytes = 0
        self.stats = TierStats()
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()

    def reserve(self, num_bytes: int) -> bool:
        """Take `num_bytes` of the cap for something held elsewhere (a swap copy), pushing out the
        oldest cached pages to make room; False if the cap cannot hold it even with no page."""
        if self.reserved_bytes + num_bytes > self.capacity_bytes:
            return False
        self.reserved_bytes += num_bytes
        self._evict_for(0)
        return True

    def release(self, num_bytes: int) -> None:
        self.reserved_bytes -= num_bytes

    def _evict_for(self, num_bytes: int) -> None:
        while self._pages and self.used_bytes + self.reserved_bytes + num_bytes > self.capacity_bytes:
            _, old = self._pages.popitem(last=False)
            self.used_bytes -= len(old)
            self.stats.evictions += 1

    def put(self, block_hash: bytes, page: bytes) -> bool:
        if len(page) > self.capacity_bytes - self.reserved_bytes:
            return False
        self.discard(block_hash)
        self._evict_for(len(page))
        self._pages[block_hash] = page
        self.used_bytes += len(page)
        self.stats.puts += 1
        return True

    def get(self, block_hash: bytes) -> bytes | None:
        page = self._pages.get(block_hash)
        if page is None:
            self.stats.misses += 1
            return None
        self._pages.move_to_end(block_hash)
        self.stats.hits += 1
        return page

    def contains(self, block_hashes: list[bytes]) -> list[bool]:
        return [k in self._pages for k in block_hashes]

    def discard(self, block_hash: bytes) -> None:
        page = self._pages.pop(block_hash, None)
        if page is not None:
            self.used_bytes -= len(page)

    def reject(self, block_hash: bytes, reason: str) -> None:
        self.stats.bad_pages[reason] = self.stats.bad_pages.get(reason, 0) + 1
        self.discard(block_hash)

    def __len__(self) -> int:
        return len(self._pages)

    def describe(self) -> dict:
        return {**super().describe(), "reserved_bytes": self.reserved_bytes}


class DiskTier(BatchedTier):
    name = "disk"
    outlives_process = True
    SUFFIX, TMP_SUFFIX = ".page", ".tmp"

    def __init__(self, directory: str | Path, capacity_bytes: int, identity: dict):
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.used_bytes = 0
        self.stats = TierStats()
        self.enabled = True
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block_hash -> file size, least recent first
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._rebuild_index()
        except OSError as e:
            self._disable(e)

    # ---- the interface --------------------------------------------------------------------

    def put(self, block_hash: bytes, page: bytes) -> bool:
        return self.put_many([(block_hash, page)]) == 1

    def put_many(self, pages: list[tuple[bytes, bytes]]) -> int:
        written = sum(self._write(block_hash, page) for block_hash, page in pages)
        if written and self.enabled:
            self._sync_directory()
        return written

    def _write(self, block_hash: bytes, page: bytes) -> bool:
        if not self.enabled or len(page) > self.capacity_bytes:
            return False
        if block_hash in self._index:  # pages are immutable: the same block hash holds the same KV
            self._index.move_to_end(block_hash)
            return True
        while self.used_bytes + len(page) > self.capacity_bytes:
            self._evict_oldest()
        path, tmp = self._path(block_hash), self._path(block_hash).with_suffix(self.TMP_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                f.write(page)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:  # disk full, read-only, gone: no disk tier from now on
            tmp.unlink(missing_ok=True)
            self._disable(e)
            return False
        self._index[block_hash] = len(page)
        self.used_bytes += len(page)
        self.stats.puts += 1
        return True

    def get(self, block_hash: bytes) -> bytes | None:
        if not self.enabled or block_hash not in self._index:
            self.stats.misses += 1
            return None
        try:
            data = self._path(block_hash).read_bytes()
        except OSError:  # removed behind our back
            self._forget(block_hash)
            self.stats.misses += 1
            return None
        self._index.move_to_end(block_hash)
        self.stats.hits += 1
        return data

    def contains(self, block_hashes: list[bytes]) -> list[bool]:
        return [self.enabled and k in self._index for k in block_hashes]

    def discard(self, block_hash: bytes) -> None:
        if block_hash in self._index:
            self._path(block_hash).unlink(missing_ok=True)
            self._forget(block_hash)

    def __len__(self) -> int:
        return len(self._index)

    # ---- internals ------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{self.SUFFIX}"

    def _rebuild_index(self) -> None:
        for tmp in self.directory.glob(f"*{self.TMP_SUFFIX}"):  # writes a crash cut short
            tmp.unlink(missing_ok=True)
        pages = sorted(self.directory.glob(f"*{self.SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in pages:
            try:
                with open(path, "rb") as f:
                    head = f.read(page_codec.HEADER_SIZE + 4096)
                block_hash, identity = page_codec.read_header(head)
            except OSError:
                continue
            except page_codec.PageError as e:
                if e.reason != "foreign":  # empty, cut short or not a page at all
                    self._quarantine(path, e.reason)
                continue
            if identity != self.identity or path.name != f"{block_hash.hex()}{self.SUFFIX}":
                continue  # another model's page, or a misnamed file: never used, never counted
            size = path.stat().st_size
            self._index[block_hash] = size
            self.used_bytes += size
        while self.used_bytes > self.capacity_bytes:  # the cap may have shrunk since
            self._evict_oldest()

    def _sync_directory(self) -> None:
        """The renames themselves reach the disk (a crash after put returned keeps the pages)."""
        try:
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            self._disable(e)

    def _evict_oldest(self) -> None:
        block_hash, _ = next(iter(self._index.items()))
        self._path(block_hash).unlink(missing_ok=True)
        self._forget(block_hash)
        self.stats.evictions += 1

    def _forget(self, block_hash: bytes) -> None:
        self.used_bytes -= self._index.pop(block_hash, 0)

    def reject(self, block_hash: bytes, reason: str) -> None:
        """A page that failed its checks: counted, moved to quarantine/, never read again."""
        self._quarantine(self._path(block_hash), reason)
        self._forget(block_hash)

    def _quarantine(self, path: Path, reason: str) -> None:
        self.stats.bad_pages[reason] = self.stats.bad_pages.get(reason, 0) + 1
        logger.warning("KV page %s failed its check (%s); quarantined", path.name, reason)
        quarantine = self.directory / "quarantine"
        try:
            quarantine.mkdir(exist_ok=True)
            os.replace(path, quarantine / path.name)
        except OSError:
            path.unlink(missing_ok=True)

    def _disable(self, error: OSError) -> None:
        if self.enabled:
            logger.warning("KV disk tier at %s is off: %s", self.directory, error)
        self.enabled = False


def build_tiers(identity: dict, host_bytes: int = 0, disk_bytes: int = 0, directory: str | Path | None = None) -> list:
    """The lower tiers, fastest first; a tier with a zero cap is left out."""
    tiers: list = []
    if host_bytes > 0:
        tiers.append(HostTier(host_bytes))
    if disk_bytes > 0:
        if directory is None:
            raise ValueError("kv_cache_dir is needed for a disk tier")
        tiers.append(DiskTier(directory, disk_bytes, identity))
    return tiers
