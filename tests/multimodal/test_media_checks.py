"""Media before any model: what each bad file gets (the reason and the part it names), where
media rows go in a prompt, media in the block hashes, and the embedding cache's byte bound."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from cache_service.hashing import hash_full_blocks, root_hash
from cluster.engine.embedding_cache import EmbeddingCache
from cluster.engine.errors import InvalidRequestError
from cluster.engine.media import MediaItem, MediaSegment, content_hash, place_media, step_embeds
from cluster.engine.media_prompt import MediaLimits, decode_audio, decode_image
from tests.multimodal.models import blank_image, png, silence, wav

LIMITS = MediaLimits(max_image_pixels=4_000_000, max_audio_seconds=2.0)


@pytest.mark.parametrize("data, reason", [
    (b"hello", "is not an image (taken: PNG, JPEG, WEBP)"),
    (blank_image("GIF"), "is a GIF image; taken: PNG, JPEG, WEBP"),
    (blank_image("BMP"), "is a BMP image; taken: PNG, JPEG, WEBP"),
    (png(5, (64, 64))[:400], "is a damaged PNG image"),
    (blank_image("JPEG", (64, 64))[:300], "is a damaged image"),
    (blank_image("PNG", (2001, 2000), "L"), "is 2001x2000 pixels; this server takes images of at most 4000000 pixels"),
], ids=["text", "gif", "bmp", "damaged png", "damaged jpeg", "too many pixels"])
def test_bad_images_are_refused_naming_the_part(data, reason):
    with pytest.raises(InvalidRequestError) as error:
        decode_image(data, "messages[2].parts[1].image", LIMITS)
    assert error.value.field == "messages[2].parts[1].image" and reason in error.value.message


def test_good_images_decode_to_rgb():
    for fmt in ("PNG", "JPEG", "WEBP"):
        image = decode_image(blank_image(fmt, (20, 10), "L"), "image", LIMITS)
        assert image.mode == "RGB" and image.size == (20, 10)


def _noise_flac() -> bytes:
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.random.default_rng(0).uniform(-0.5, 0.5, 16000).astype(np.float32), 16000, format="FLAC")
    return buffer.getvalue()


@pytest.mark.parametrize("data, reason", [
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", "is not audio (taken: WAV, FLAC)"),
    (png(1), "is not audio"),
    (silence("OGG"), "is OGG audio; taken: WAV, FLAC"),
    (silence("WAV", seconds=2.5), "is 2.5 s of audio; this server takes at most 2 s"),
    (_noise_flac()[:3000], "is damaged FLAC audio"),
], ids=["wav header only", "png", "ogg", "too long", "damaged flac"])  # named: an OGG's bytes differ each run
def test_bad_audio_is_refused_naming_the_part(data, reason):
    with pytest.raises(InvalidRequestError) as error:
        decode_audio(data, "messages[0].parts[0].audio", LIMITS, 16000)
    assert error.value.field == "messages[0].parts[0].audio" and reason in error.value.message


def test_audio_is_mono_at_the_models_rate():
    samples = decode_audio(wav(1, seconds=0.5, rate=8000), "audio", LIMITS, 16000)
    assert samples.dtype == np.float32 and samples.shape == (8000,)
    assert decode_audio(silence("FLAC", 1.0), "audio", LIMITS, 16000).shape == (16000,)


def _item(rows: int, tag: int) -> MediaItem:
    return MediaItem("image", bytes([tag]) * 16, None, torch.full((rows, 2), float(tag)))


def test_media_rows_fill_the_placeholders_in_order():
    P = 9
    tokens = [1, P, P, P, 2, P, P, 3]  # item 0: 4 rows (3 + 1 across the text), item 1: 1 row
    items = [_item(4, 1), _item(1, 2)]
    segments = place_media(tokens, P, items, "prompt")
    assert segments == [MediaSegment(1, 3, 0, 0, items[0].content_hash), MediaSegment(5, 1, 0, 3, items[0].content_hash),
                        MediaSegment(6, 1, 1, 0, items[1].content_hash)]
    # a step over positions [2, 6): rows 1-2 of item 0 at offsets 0-1, row 3 at offset 3
    embeds = step_embeds(segments, items, 2, 6)
    assert [(offset, rows[:, 0].tolist()) for offset, rows in embeds] == [(0, [1.0, 1.0]), (3, [1.0])]
    assert step_embeds(segments, items, 7, 8) is None
    with pytest.raises(InvalidRequestError, match="has 5 media placeholder tokens but its 1 media item"):
        place_media(tokens, P, [_item(4, 1)], "prompt")


def test_media_joins_the_block_hashes_from_its_first_block_on():
    tokens = list(range(100, 148))  # 3 blocks of 16; an image at positions 20..29 (block 1)
    root = root_hash("model")
    plain = hash_full_blocks(tokens, 16, root)
    a = hash_full_blocks(tokens, 16, root, media=[MediaSegment(20, 10, 0, 0, content_hash("image", b"cat"))])
    b = hash_full_blocks(tokens, 16, root, media=[MediaSegment(20, 10, 0, 0, content_hash("image", b"dog"))])
    assert a[0] == b[0] == plain[0]  # the block before the image is shared
    assert a[1] != b[1] and a[2] != b[2]  # from the image's block on, nothing is
    assert a == hash_full_blocks(tokens, 16, root, media=[MediaSegment(20, 10, 0, 0, content_hash("image", b"cat"))])


def test_embedding_cache_keeps_the_recently_used_within_its_bytes():
    cache = EmbeddingCache(max_bytes=3 * 64)  # three items of 16 float32 each
    for key in (b"a", b"b", b"c"):
        cache.put(key, torch.zeros(4, 4))
    assert cache.get(b"a") is not None  # a is now the most recent: b goes first
    cache.put(b"d", torch.zeros(4, 4))
    assert cache.get(b"b") is None and all(cache.get(k) is not None for k in (b"a", b"c", b"d"))
    assert cache.used_bytes == 3 * 64
    cache.put(b"huge", torch.zeros(8, 8))  # larger than the whole cache: not kept, nothing evicted
    assert cache.get(b"huge") is None and len(cache) == 3
