"""The app's options: deployment options over Pagoda's defaults, Serve's own checks first, and the
autoscaling config completed to scale on the engine's signals."""

import pytest
from pydantic import ValidationError
from ray.serve.config import AutoscalingConfig

from cluster.serve.app import parse_app_config
from cluster.serve.autoscaling import POLICY_FUNCTION, LLMAutoscalingPolicy


def test_a_deployments_options_replace_only_the_defaults_they_name():
    config = parse_app_config({"llm_server": {"max_ongoing_requests": 8, "graceful_shutdown_wait_loop_s": 0.5,
                                              "health_check_timeout_s": 20, "max_replicas_per_node": 1}})
    assert config.llm_server.as_kwargs() == {
        "max_ongoing_requests": 8, "ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 2,
        "graceful_shutdown_wait_loop_s": 0.5, "health_check_timeout_s": 20, "max_replicas_per_node": 1}
    assert config.ingress.as_kwargs() == {"max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 0}}


@pytest.mark.parametrize("options, message", [
    ({"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}, "max_replicas (2) must be greater than"),
    ({"autoscaling_config": {"max_replica": 2}}, "max_replica"),
    ({"num_replica": 2}, "num_replica"),
])
def test_bad_deployment_options_are_refused_naming_them(options, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_app_config({"llm_server": options})


def test_autoscaling_servers_scale_on_their_engines_signals():
    config = parse_app_config({"llm_server": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3,
                                                                     "upscale_delay_s": 1}}})
    options = config.llm_server.autoscaled_by_engine("decode", {"model": "m", "max_num_seqs": 8})
    autoscaling = options["autoscaling_config"]
    assert autoscaling == {
        "look_back_period_s": 15.0, "upscale_delay_s": 1, "downscale_delay_s": 120.0,
        "min_replicas": 1, "max_replicas": 3,
        "policy": {"policy_function": POLICY_FUNCTION,
                   "policy_kwargs": {"role": "decode", "target_num_seqs": 8, "target_tokens_to_prefill": 2048}}}
    serve_config = AutoscalingConfig(**autoscaling)  # what Serve will do with it
    policy_class = serve_config.policy.get_policy()
    assert policy_class.__name__ == LLMAutoscalingPolicy.__name__
    assert policy_class(**serve_config.policy.policy_kwargs).target_num_seqs == 8


def test_the_configs_own_policy_targets_win_and_another_policy_is_left_alone():
    own = {"policy_function": POLICY_FUNCTION, "policy_kwargs": {"ttft_slo_s": 2.0, "target_num_seqs": 4}}
    config = parse_app_config({"prefill_server": {"autoscaling_config": {"max_replicas": 2, "policy": own}}})
    kwargs = config.prefill_server.autoscaled_by_engine("prefill", {"model": "m", "max_num_batched_tokens": 256})
    assert kwargs["autoscaling_config"]["policy"]["policy_kwargs"] == {
        "role": "prefill", "target_num_seqs": 4, "target_tokens_to_prefill": 1024, "ttft_slo_s": 2.0}
    serve_default = {"policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}
    config = parse_app_config({"llm_server": {"autoscaling_config": {"max_replicas": 2, "policy": serve_default}}})
    kwargs = config.llm_server.autoscaled_by_engine("decode", {"model": "m"})
    assert kwargs["autoscaling_config"]["policy"] == serve_default


def test_a_fixed_count_has_no_autoscaling():
    config = parse_app_config({"llm_server": {"num_replicas": 2}})
    assert "autoscaling_config" not in config.llm_server.autoscaled_by_engine("decode", {"model": "m"})


@pytest.mark.parametrize("ingress, in_process", [
    ({}, True),
    ({"num_replicas": 2}, False),
    ({"num_replicas": "auto", "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}, False),
])
def test_one_ingress_replica_keeps_the_ledger_several_share_a_deployment(model_dir, ingress, in_process):
    from cluster.serve.app import build_app
    from cluster.serve.in_process import InProcess
    from cluster.serve.ledger import TenantLedger

    _, ledger = build_app({"model": model_dir, "ingress": ingress, "usage_log": "/tmp/u.jsonl"})._bound_deployment.init_args
    if in_process:
        assert ledger == InProcess(TenantLedger, {"tenants": None, "usage_log": "/tmp/u.jsonl"})
    else:
        assert ledger._bound_deployment.name == "TenantLedger"
