"""The on-disk (and in-transit) form of one KV page: a checksummed header, then the payload.

    offset  size  field
    0       4     magic b"PGKV"
    4       2     format version (1)
    6       1     codec: 0 raw, 1 lz4, 2 byte-shuffle + lz4
    7       1     element size in bytes (what the shuffle groups by)
    8       4     identity length I (UTF-8 JSON: model, weights hash, dtype, layers, KV heads,
                  head dim, block size; not the TP degree: a page holds every KV head; sorted
                  keys, so equal identities are equal bytes)
    12      8     payload length P (bytes stored)
    20      8     raw length (bytes after decoding)
    28      8     checksum: xxh3-64 of every other byte of the page (header fields, identity, key, payload)
    36      16    key (the block's chained hash)
    52      I     identity
    52+I    P     payload

One page is one block: the unit the engine evicts, looks up and brings back, so a page file is
written once and never rewritten, and losing one costs one block's recompute.

The byte shuffle puts the first byte of every element together, then the second, ...; float KV has
slowly varying exponent bytes, which LZ4 then finds as runs (the ratio with and without it is in
docs/benchmarks-log.md).
"""

from __future__ import annotations

import json
import struct

import lz4.frame
import numpy as np
import xxhash

MAGIC = b"PGKV"
VERSION = 1
RAW, LZ4, SHUFFLE_LZ4 = 0, 1, 2
CODECS = {"raw": RAW, "lz4": LZ4, "shuffle-lz4": SHUFFLE_LZ4}  # by the name EngineConfig uses
_HEADER = struct.Struct("<4sHBBIQQQ16s")  # up to and including the key
HEADER_SIZE = _HEADER.size
_CHECKSUM_AT = 28  # offset of the checksum inside the header


class PageError(Exception):
    """A page that must not be used: `reason` says why (counted, the file quarantined)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def identity_bytes(identity: dict) -> bytes:
    return json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()


def encode(key: bytes, identity: dict, payload: np.ndarray, codec: int = SHUFFLE_LZ4) -> bytes:
    raw = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
    elem = payload.dtype.itemsize
    if codec == SHUFFLE_LZ4:
        body = lz4.frame.compress(_shuffle(raw, elem).tobytes())
    elif codec == LZ4:
        body = lz4.frame.compress(raw.tobytes())
    elif codec == RAW:
        body = raw.tobytes()
    else:
        raise ValueError(f"unknown codec {codec}")
    ident = identity_bytes(identity)
    header = _HEADER.pack(MAGIC, VERSION, codec, elem, len(ident), len(body), raw.size, 0, key)
    checksum = _checksum(header, ident, body)
    return header[:_CHECKSUM_AT] + struct.pack("<Q", checksum) + header[_CHECKSUM_AT + 8:] + ident + body


def read_header(data: bytes) -> tuple[bytes, dict]:
    """(key, identity) of a page from its first bytes (HEADER_SIZE + identity length suffice)."""
    magic, version, _, _, ident_len, _, _, _, key = _unpack(data)
    ident = data[HEADER_SIZE:HEADER_SIZE + ident_len]
    if len(ident) != ident_len:
        raise PageError("truncated", "the identity is cut short")
    try:
        return key, json.loads(ident)
    except ValueError:
        raise PageError("bad_header", "the identity is not JSON") from None


def decode(data: bytes, identity: dict, key: bytes | None = None) -> bytes | bytearray:
    """The raw payload bytes, after every check; raises PageError otherwise."""
    _, _, codec, elem, ident_len, body_len, raw_len, checksum, page_key = _unpack(data)
    ident_end = HEADER_SIZE + ident_len
    if len(data) != ident_end + body_len:
        raise PageError("truncated" if len(data) < ident_end + body_len else "length",
                        f"{len(data)} bytes, the header says {ident_end + body_len}")
    data = memoryview(data)  # slices without copies
    header = data[:HEADER_SIZE]
    if _checksum(header, data[HEADER_SIZE:ident_end], data[ident_end:]) != checksum:
        raise PageError("checksum")
    if data[HEADER_SIZE:ident_end] != identity_bytes(identity):
        raise PageError("foreign", "another model identity")
    if key is not None and page_key != key:
        raise PageError("foreign", "another block's page")
    body = data[ident_end:]
    try:
        if codec == RAW:
            raw = bytes(body)
        elif codec in (LZ4, SHUFFLE_LZ4):
            raw = lz4.frame.decompress(body)
        else:
            raise PageError("bad_header", f"unknown codec {codec}")
    except RuntimeError as e:  # lz4 reports a bad frame as RuntimeError
        raise PageError("codec", str(e)) from None
    if len(raw) != raw_len:
        raise PageError("length", f"decoded {len(raw)} bytes, the header says {raw_len}")
    if codec == SHUFFLE_LZ4:
        raw = _unshuffle(np.frombuffer(raw, np.uint8), elem)
    return raw


def _unpack(data: bytes):
    if len(data) < HEADER_SIZE:
        raise PageError("truncated", f"{len(data)} bytes, shorter than a header")
    fields = _HEADER.unpack_from(data)
    if fields[0] != MAGIC:
        raise PageError("bad_header", "no page magic")
    if fields[1] != VERSION:
        raise PageError("foreign", f"format version {fields[1]}")  # another Pagoda's page: not ours to judge
    return fields


def _checksum(header: bytes, ident: bytes, body: bytes) -> int:
    h = xxhash.xxh3_64()
    h.update(header[:_CHECKSUM_AT])
    h.update(header[_CHECKSUM_AT + 8:])
    h.update(ident)
    h.update(body)
    return h.intdigest()


def _shuffle(raw: np.ndarray, elem: int) -> np.ndarray:
    return raw.reshape(-1, elem).T.copy() if elem > 1 else raw


def _unshuffle(shuffled: np.ndarray, elem: int) -> bytearray:
    """Byte planes back into elements, into a new buffer. One strided store per plane is ~2x
    faster than a transposed copy here (it was most of a restore's time)."""
    out = bytearray(shuffled.size)
    elements = np.frombuffer(out, np.uint8).reshape(-1, elem)
    for i, plane in enumerate(shuffled.reshape(elem, -1)):
        elements[:, i] = plane
    return out
