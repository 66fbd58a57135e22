"""KV tiers through the real server: a document evicted from a replica's device memory comes back
from the shared cache service (two shards, host RAM) with the same answer; a second replica (of a
second application of the same model) finds the document there too; `pagoda status --json` shows
the tiers."""

import pytest

from tests.served_apps import answer, deployed, grpc_request, metric_value, scrape_until, status
from tests.parity_prompts import DOC, DOC_B

pytestmark = pytest.mark.ray  # make test only; apps of its own on the session cluster


def test_an_evicted_document_comes_back_from_the_cache_service_on_either_replica(serve_cluster, model_dir):
    doc = grpc_request({"prompt": DOC[:2400]}, max_tokens=8)
    others = [grpc_request({"prompt": DOC_B[i:i + 2400]}, max_tokens=8) for i in (0, 3000)]
    engine = {"num_blocks": 48, "max_num_batched_tokens": 256, "host_kv_bytes": 64 << 20, "kv_cache_service_shards": 2}
    server = {**serve_cluster, "model_dir": model_dir}
    try:
        with deployed(server, "pagoda-tiers", "/tiers", engine=engine) as app:
            first = answer(app, doc)
            for other in others:  # need every block: the document's go down to the service
                answer(app, other)
            again = answer(app, doc)
            (group,) = status(app)["groups"]
            with deployed(server, "pagoda-tiers-b", "/tiers-b", engine=engine) as second_app:
                elsewhere = answer(second_app, doc)
                (second,) = status(second_app)["groups"]
    finally:  # the service's actors are detached (they outlive replicas): end them with the test
        import ray

        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == "pagoda" and entry["name"].startswith("kv-cache-"):
                ray.kill(ray.get_actor(entry["name"], namespace="pagoda"))
    assert again == first == elsewhere and len(first) == 8
    tiers = group["kv_tiers"]
    assert tiers["restored_from"]["service"] >= 30 and tiers["spilled_blocks"] >= 30
    shards = tiers["tiers"]["service"]["shards"]
    assert len(shards) == 2 and all(shard["host"]["pages"] > 0 for shard in shards)
    assert group["stats"]["kv_blocks_free"] == group["stats"]["kv_blocks_total"]
    # the second replica computed none of the document's full blocks: the first one's pages served
    assert second["kv_tiers"]["restored_from"]["service"] == tiers["restored_from"]["service"]
    assert second["kv_tiers"]["spilled_blocks"] == 0 and second["replica_pid"] != group["replica_pid"]
    # and Prometheus has them: blocks spilled, restored from the service, prefetches by outcome
    restored = tiers["restored_from"]["service"]
    scrape_until(server["metrics"], lambda text: [] if (
        metric_value(text, "ray_pagoda_kv_restored_blocks_total", 'tier="service"') >= restored
        and metric_value(text, "ray_pagoda_kv_spilled_blocks_total") >= tiers["spilled_blocks"]
        and metric_value(text, "ray_pagoda_kv_prefetches_total") >= 1) else ["kv tier counters"])


def test_a_replica_stopped_by_serve_leaves_its_prefix_cache_for_the_next_one(serve_cluster, model_dir, tmp_path):
    """Nothing was evicted (device memory has room), so only the drain at a graceful stop puts
    the document on disk; the next replica on the same directory restores it."""
    doc = grpc_request({"prompt": DOC[:2400]}, max_tokens=8)
    engine = {"num_blocks": 256, "disk_kv_bytes": 256 << 20, "kv_cache_dir": str(tmp_path / "kv")}
    server = {**serve_cluster, "model_dir": model_dir}
    with deployed(server, "pagoda-drain", "/drain", engine=engine) as app:
        first = answer(app, doc)
        assert not list((tmp_path / "kv").glob("*.page"))
    num_pages = len(list((tmp_path / "kv").glob("*.page")))  # serve.delete stopped the replica
    assert num_pages >= 30
    with deployed(server, "pagoda-drain", "/drain", engine=engine) as app:
        again = answer(app, doc)
        (group,) = status(app)["groups"]
    assert again == first
    assert group["kv_tiers"]["restored_from"]["disk"] == num_pages  # the doc's full blocks, all of them
