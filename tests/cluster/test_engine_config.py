"""EngineConfig refuses every bad option with an error that names it (the CLI and the Serve app
show that message before anything starts)."""

import pytest

from cluster.engine.config import EngineConfig


@pytest.mark.parametrize("options, field", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"host_kv_bytes": -1}, "host_kv_bytes"),
    ({"swap_space_bytes": -1}, "swap_space_bytes"),
    ({"disk_kv_bytes": 1 << 30}, "kv_cache_dir"),
    ({"preemption_mode": "drop"}, "preemption_mode"),
    ({"kv_page_codec": "zstd"}, "kv_page_codec"),
    ({"tp_collective": "mpi"}, "tp_collective"),
    ({"kv_role": "both"}, "kv_role"),
    ({"dtype": "float64"}, "dtype"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
])
def test_a_bad_option_is_refused_naming_it(options, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="unused", **options)


def test_the_defaults_are_valid():
    config = EngineConfig(model="unused")
    assert config.kv_page_codec == "shuffle-lz4" and config.preemption_mode == "recompute"
    assert config.kv_cache_dtype == "auto" and config.kv_dtype == "float32"


def test_the_kv_cache_dtype_is_the_models_unless_named():
    assert EngineConfig(model="unused", dtype="bfloat16").kv_dtype == "bfloat16"
    assert EngineConfig(model="unused", kv_cache_dtype="bfloat16").kv_dtype == "bfloat16"
