"""Host and disk tiers: LRU under a byte cap, exact bytes back from real files, atomic writes,
the index rebuilt on start, quarantine of damaged pages, and an unwritable disk degrading quietly."""

import os

import pytest

from cache_service import page_codec
from cache_service.offload import KVOffload
from cache_service.tiers import DiskTier, HostTier, build_tiers
from tests.cache_service.test_page_codec import IDENTITY, damage, kv_block


def page(i: int, dtype="float32") -> tuple[bytes, bytes]:
    key = i.to_bytes(16, "little")
    return key, page_codec.encode(key, IDENTITY, kv_block(dtype, seed=i))


def test_host_tier_evicts_least_recently_used_under_its_cap():
    pages = [page(i) for i in range(4)]
    size = len(pages[0][1])
    tier = HostTier(capacity_bytes=3 * size + 10)
    for key, data in pages[:3]:
        assert tier.put(key, data)
    assert tier.get(pages[0][0]) == pages[0][1]  # page 0 is now the most recent
    tier.put(*pages[3])
    assert tier.contains([k for k, _ in pages]) == [True, False, True, True]
    assert tier.used_bytes <= tier.capacity_bytes and tier.stats.evictions == 1


def test_a_swap_copy_takes_the_host_tiers_room_and_pushes_out_the_oldest_pages():
    size = 1000
    pages = [(bytes([i]) * 8, bytes([i]) * size) for i in range(4)]
    tier = HostTier(capacity_bytes=3 * size)
    for key, data in pages[:3]:
        assert tier.put(key, data)
    assert tier.reserve(2 * size)  # a swap copy of two pages' size: the two oldest pages go
    assert tier.contains([k for k, _ in pages[:3]]) == [False, False, True]
    assert tier.put(*pages[3])  # one page's room is left: page 2 makes way for page 3
    assert tier.contains([k for k, _ in pages]) == [False, False, False, True]
    assert not tier.reserve(2 * size)  # beyond the cap even with no page: no room, nothing pushed out
    assert tier.contains([pages[3][0]]) == [True] and tier.reserved_bytes == 2 * size
    tier.release(2 * size)
    assert tier.put(*pages[0]) and tier.put(*pages[1])
    assert tier.used_bytes == 3 * size and tier.describe()["reserved_bytes"] == 0


def test_a_page_that_fits_only_without_the_swap_copies_is_refused():
    tier = HostTier(capacity_bytes=1000)
    assert tier.reserve(1)
    assert not tier.put(b"key", bytes(1000)) and len(tier) == 0


def test_disk_round_trip_is_exact_bytes_in_real_files(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30, IDENTITY)
    for dtype in ("float32", "float16", "bfloat16"):
        key, data = page(7 if dtype == "float32" else 8 if dtype == "float16" else 9, dtype)
        assert tier.put(key, data)
        assert (tmp_path / f"{key.hex()}.page").read_bytes() == data
        assert tier.get(key) == data
    assert not list(tmp_path.glob("*.tmp"))


def test_disk_cap_holds_under_a_spill_storm(tmp_path):
    size = len(page(0)[1])
    cap = 10 * size + size // 2
    tier = DiskTier(tmp_path, cap, IDENTITY)
    for i in range(60):
        tier.put(*page(i))
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("*.page"))
        assert on_disk <= cap and on_disk == tier.used_bytes
    assert len(tier) == 10 and tier.stats.evictions == 50


def test_restart_rebuilds_the_index_sweeps_temporaries_and_ignores_other_models(tmp_path):
    tier = DiskTier(tmp_path, 1 << 30, IDENTITY)
    mine = [page(i) for i in range(3)]
    for key, data in mine:
        tier.put(key, data)
    other_key = (99).to_bytes(16, "little")
    other = page_codec.encode(other_key, {**IDENTITY, "weights": "other"}, kv_block("float32"))
    (tmp_path / f"{other_key.hex()}.page").write_bytes(other)
    newer_key = (98).to_bytes(16, "little")  # a later format version's page: not ours to judge either
    newer = bytearray(page_codec.encode(newer_key, IDENTITY, kv_block("float32")))
    newer[4:6] = (page_codec.VERSION + 1).to_bytes(2, "little")
    (tmp_path / f"{newer_key.hex()}.page").write_bytes(newer)
    (tmp_path / f"{(5).to_bytes(16, 'little').hex()}.tmp").write_bytes(mine[0][1][:100])  # a cut-short write
    empty = tmp_path / f"{(6).to_bytes(16, 'little').hex()}.page"  # renamed, its data never reached the disk
    empty.write_bytes(b"")

    again = DiskTier(tmp_path, 1 << 30, IDENTITY)
    assert len(again) == 3 and again.used_bytes == sum(len(d) for _, d in mine)
    assert again.stats.bad_pages == {"truncated": 1} and (tmp_path / "quarantine" / empty.name).exists()
    assert (tmp_path / f"{newer_key.hex()}.page").exists()
    assert [again.get(k) for k, _ in mine] == [d for _, d in mine]
    assert again.contains([other_key]) == [False] and again.get(other_key) is None
    assert not list(tmp_path.glob("*.tmp"))
    assert (tmp_path / f"{other_key.hex()}.page").exists()  # another model's page is left alone


@pytest.mark.parametrize("kind, reason", [
    ("flipped_payload_byte", "checksum"), ("truncated", "truncated"), ("zero_length", "truncated"),
])
def test_a_damaged_page_is_a_miss_counted_and_quarantined(tmp_path, kind, reason):
    tier = DiskTier(tmp_path, 1 << 30, IDENTITY)
    offload = KVOffload([tier], IDENTITY)
    good_key, good = page(0)
    key, data = page(1)
    tier.put(good_key, good)
    tier.put(key, data)
    path = tmp_path / f"{key.hex()}.page"
    path.write_bytes(damage(data, kind))
    # the damaged page is a hole (recomputed); the pages around it are restored
    after_key, after = page(2)
    tier.put(after_key, after)
    assert offload.load_blocks([good_key, key, after_key]) == [kv_block("float32", seed=0).tobytes(), None,
                                                               kv_block("float32", seed=2).tobytes()]
    assert tier.stats.bad_pages == {reason: 1}
    assert not path.exists() and (tmp_path / "quarantine" / path.name).exists()
    assert tier.contains([key]) == [False] and tier.used_bytes == len(good) + len(after)


def test_an_unwritable_disk_turns_the_tier_off_without_raising(tmp_path, caplog):
    if os.geteuid() == 0:
        directory = "/proc/pagoda-cannot-write-here"  # root ignores permission bits; /proc refuses anyone
    else:
        directory = tmp_path / "ro"
        directory.mkdir()
        directory.chmod(0o500)
    tier = DiskTier(directory, 1 << 30, IDENTITY)
    key, data = page(1)
    assert tier.put(key, data) is False
    assert tier.get(key) is None and tier.enabled is False
    assert "is off" in caplog.text


def test_build_tiers_orders_fastest_first(tmp_path):
    tiers = build_tiers(IDENTITY, host_bytes=1 << 20, disk_bytes=1 << 20, directory=tmp_path)
    assert [t.name for t in tiers] == ["host", "disk"]
    assert build_tiers(IDENTITY) == []
    with pytest.raises(ValueError, match="kv_cache_dir"):
        build_tiers(IDENTITY, disk_bytes=1)


SPILLER = """
import sys
from cache_service import page_codec
from cache_service.tiers import DiskTier
from tests.cache_service.test_page_codec import IDENTITY, kv_block
tier = DiskTier(sys.argv[1], 1 << 30, IDENTITY)
print("ready", flush=True)
for i in range(50):
    key = i.to_bytes(16, "little")
    tier.put(key, page_codec.encode(key, IDENTITY, kv_block("float32", seed=i)))
print("done", flush=True)
"""


@pytest.mark.parametrize("kill_after_s", [0.02, 0.05, 0.1, 0.2])
def test_sigkill_during_50_spill_writes_never_leaves_a_wrong_valid_page(tmp_path, kill_after_s):
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", SPILLER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(kill_after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = DiskTier(tmp_path, 1 << 30, IDENTITY)
    for i in range(50):
        key = i.to_bytes(16, "little")
        data = tier.get(key)
        if data is not None:  # a visible page is whole (decode raises on a torn one) and exactly this key's
            assert page_codec.decode(data, IDENTITY, key) == kv_block("float32", seed=i).tobytes()
    assert not list(tmp_path.glob("*.tmp"))
