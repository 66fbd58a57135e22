"""KV pages: bit-exact round trips for every dtype the engine uses, and every kind of damage is
detected with its reason (never decoded into wrong KV)."""

import struct

import numpy as np
import pytest

from cache_service import page_codec
from cache_service.page_codec import PageError

IDENTITY = {"model": "SmolLM2-135M-Instruct", "weights": "abc123", "dtype": "float32", "layers": 30,
            "kv_heads": 3, "head_dim": 64, "block_size": 16}
KEY = bytes(range(16))


def kv_block(dtype, seed=0) -> np.ndarray:
    """A block's KV shaped like the engine's: [layers, K/V, heads, block_size, head_dim]."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((30, 2, 3, 16, 64)).astype(np.float32)
    if dtype == "bfloat16":  # numpy has no bfloat16: the engine ships its bits as uint16
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", [page_codec.RAW, page_codec.LZ4, page_codec.SHUFFLE_LZ4])
def test_round_trip_is_bit_exact(dtype, codec):
    block = kv_block(dtype)
    page = page_codec.encode(KEY, IDENTITY, block, codec)
    raw = page_codec.decode(page, IDENTITY, KEY)
    assert raw == block.tobytes()
    assert page_codec.read_header(page) == (KEY, IDENTITY)


def damage(page: bytes, kind: str) -> bytes:
    if kind == "flipped_payload_byte":
        i = len(page) - 100
        return page[:i] + bytes([page[i] ^ 0x01]) + page[i + 1:]
    if kind == "flipped_header_byte":  # inside the identity
        i = page_codec.HEADER_SIZE + 3
        return page[:i] + bytes([page[i] ^ 0x20]) + page[i + 1:]
    if kind == "truncated":
        return page[: len(page) // 2]
    if kind == "zero_length":
        return b""
    if kind == "bad_magic":
        return b"XXXX" + page[4:]
    if kind == "bad_lz4_frame":  # a writer bug rather than disk damage: the checksum matches
        ident_end = page_codec.HEADER_SIZE + struct.unpack_from("<I", page, 8)[0]
        body = bytearray(page[ident_end:])
        body[10:40] = bytes(30)  # inside the compressed blocks
        header = bytearray(page[:page_codec.HEADER_SIZE])
        checksum = page_codec._checksum(bytes(header), page[page_codec.HEADER_SIZE:ident_end], bytes(body))
        header[page_codec._CHECKSUM_AT:page_codec._CHECKSUM_AT + 8] = struct.pack("<Q", checksum)
        return bytes(header) + page[page_codec.HEADER_SIZE:ident_end] + bytes(body)
    raise AssertionError(kind)


@pytest.mark.parametrize("kind, reason", [
    ("flipped_payload_byte", "checksum"), ("flipped_header_byte", "checksum"), ("truncated", "truncated"),
    ("zero_length", "truncated"), ("bad_magic", "bad_header"),
])
def test_damaged_pages_are_refused_with_their_reason(kind, reason):
    page = page_codec.encode(KEY, IDENTITY, kv_block("float32"))
    with pytest.raises(PageError) as e:
        page_codec.decode(damage(page, kind), IDENTITY, KEY)
    assert e.value.reason == reason


def test_a_bad_lz4_frame_with_a_valid_checksum_is_refused():
    page = page_codec.encode(KEY, IDENTITY, kv_block("float32"))
    with pytest.raises(PageError) as e:
        page_codec.decode(damage(page, "bad_lz4_frame"), IDENTITY, KEY)
    assert e.value.reason in ("codec", "length")


def test_pages_of_another_model_identity_or_block_are_never_used():
    page = page_codec.encode(KEY, IDENTITY, kv_block("float32"))
    for change in ({"weights": "other"}, {"dtype": "bfloat16"}, {"kv_heads": 2}, {"block_size": 32}):
        with pytest.raises(PageError) as e:
            page_codec.decode(page, {**IDENTITY, **change}, KEY)
        assert e.value.reason == "foreign"
    with pytest.raises(PageError) as e:
        page_codec.decode(page, IDENTITY, bytes(16))
    assert e.value.reason == "foreign"
