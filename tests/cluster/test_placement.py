"""The fit check: what an app asks of a fixed-size cluster, and what does not fit, by name."""

import pytest

from cluster.serve.app import parse_app_config
from cluster.serve.placement import AppDoesNotFitError, Demand, app_demands, check_fit, check_fit_on_new_node, unplaced

ENGINE = {"model": "m"}


def disaggregated(prefill_tp=2, **args):
    config = parse_app_config({"disaggregated": True, **args})
    return config, {**ENGINE, "tensor_parallel_size": prefill_tp}, ENGINE


def test_the_readmes_disaggregated_shape_needs_three_cpus():
    config, prefill, decode = disaggregated()
    demands = app_demands(config, prefill, decode)
    assert [(d.what, d.bundles) for d in demands] == [
        ("Ingress replica 1", ({},)),
        ("PrefillServer replica 1", ({"CPU": 1.0},)),
        ("PrefillServer replica 1: 2 TP ranks", ({"CPU": 0.5}, {"CPU": 0.5})),
        ("LLMServer replica 1", ({"CPU": 1.0},)),
    ]
    assert unplaced(demands, [{"CPU": 3.0}]) == []
    assert [d.what for d in unplaced(demands, [{"CPU": 2.0}])] == ["PrefillServer replica 1: 2 TP ranks"]


def test_a_shape_that_does_not_fit_is_refused_naming_the_resources_and_the_way_out():
    with pytest.raises(AppDoesNotFitError) as refused:
        check_fit(*disaggregated(), nodes=[{"CPU": 2.0, "memory": 1e9}])
    message = str(refused.value)
    assert "PrefillServer replica 1: 2 TP ranks cannot be placed" in message
    assert "It needs CPU 3 (the cluster has 2)" in message
    assert "--num-cpus N" in message and "fewer TP ranks" in message
    check_fit(*disaggregated(), nodes=[{"CPU": 3.0}])  # fits: no error


def test_a_new_local_node_is_checked_before_it_starts_where_no_gpu_is_asked_for():
    with pytest.raises(AppDoesNotFitError, match="It needs CPU 3"):
        check_fit_on_new_node(*disaggregated(), num_cpus=2)
    check_fit_on_new_node(*disaggregated(), num_cpus=3)
    config = parse_app_config({"llm_server": {"ray_actor_options": {"num_cpus": 8}}})
    gpu_ranks = {**ENGINE, "tensor_parallel_size": 2, "device": "cuda"}
    check_fit_on_new_node(config, None, gpu_ranks, num_cpus=2)  # left to the started cluster


def test_replicas_autoscaled_start_at_their_initial_count():
    config = parse_app_config({"llm_server": {"autoscaling_config": {"min_replicas": 2, "max_replicas": 6},
                                              "ray_actor_options": {"num_cpus": 1, "resources": {"nvme": 1}}}})
    demands = app_demands(config, None, ENGINE)
    assert [(d.what, d.bundles) for d in demands][1:] == [
        ("LLMServer replica 1", ({"CPU": 1.0, "nvme": 1.0},)), ("LLMServer replica 2", ({"CPU": 1.0, "nvme": 1.0},))]
    assert [d.what for d in unplaced(demands, [{"CPU": 4.0, "nvme": 1.0}])] == ["LLMServer replica 2"]


def test_placement_strategies_of_tp_ranks():
    ranks = ({"CPU": 0.5}, {"CPU": 0.5})
    two_nodes = [{"CPU": 0.5}, {"CPU": 0.5}]
    assert unplaced([Demand("spread", ranks, "STRICT_SPREAD")], two_nodes) == []
    assert unplaced([Demand("spread", ranks, "STRICT_SPREAD")], [{"CPU": 4.0}]) != []
    assert unplaced([Demand("pack", ranks, "STRICT_PACK")], two_nodes) != []
    assert unplaced([Demand("pack", ranks, "PACK")], two_nodes) == []  # PACK may still use two nodes


def test_gpu_ranks_need_a_gpu_each():
    config = parse_app_config({"llm_server": {"ray_actor_options": {"num_cpus": 1}}})
    demands = app_demands(config, None, {**ENGINE, "tensor_parallel_size": 2, "device": "cuda"})
    assert demands[-1].bundles == ({"CPU": 0.5, "GPU": 1.0},) * 2
    assert [d.what for d in unplaced(demands, [{"CPU": 8.0, "GPU": 1.0}])] == ["LLMServer replica 1: 2 TP ranks"]
    assert unplaced(demands, [{"CPU": 8.0, "GPU": 2.0}]) == []
