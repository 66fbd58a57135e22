"""build_app: the Serve application, from a config dict.

    colocated (default):  Ingress -> LLMServer (prefill and decode in one engine)
    disaggregated:        Ingress -> DecodeServer -> PrefillServer   (KV: object store, layer by layer)
    engine_in_ingress:    Ingress (its own LLMServer in its process; no LLMServer deployment)
    multimodal models, engine.encoder: deployment:
                          Ingress -> EncoderServer (media -> embeddings), then -> LLMServer ...
    tenants' ledger:      a TenantLedger deployment where the Ingress may have several replicas;
                          otherwise the one Ingress replica's own (no TenantLedger deployment)

    serve run cluster.serve.app:build_app model=/path/to/model
    serve run serve_config.yaml          # the same builder, args from the YAML
    pagoda serve [--tp N | --disaggregated --prefill-tp N --decode-tp M]

Each server deployment's engine is a TP group of `tensor_parallel_size` worker actors when > 1.
Deployment options (replicas, max_ongoing_requests, autoscaling, resources, request router) come
from the config, separately for each deployment, so prefill and decode scale apart.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve

from cluster.serve.circuit_breaker import CircuitBreakerConfig
from cluster.serve.in_process import InProcess
from cluster.serve.ingress import Ingress
from cluster.serve.ledger import TenantLedger
from cluster.serve.limits import InputLimits
from cluster.serve.generation import RequestDeadline
from cluster.serve.llm_server import LLMServer
from cluster.serve.tenants import load_keys_file

GRPC_SERVICERS = ["cluster.serve.grpc_servicer.add_inference_servicer", "cluster.serve.grpc_servicer.add_health_servicer"]
# Ray Serve's own router: the replica whose past prompts share the longest prefix with this one,
# unless queue lengths differ by more than the threshold; then power-of-two-choices by load.
# It is the class ray.serve.llm.request_router re-exports; that package's __init__ needs vLLM or
# SGLang installed, so the router is named by the module that defines it.
PREFIX_AFFINITY_ROUTER = {  # Serve's, with its helper actor on the head (cluster/serve/routing.py)
    "request_router_class": "cluster.serve.routing.HeadNodePrefixAffinityRouter",
    "request_router_kwargs": {"imbalanced_threshold": 4},
}


# A server replica answers many streams at once (its engine batches them); a lost TP worker gets
# its replica replaced within seconds. The ingress only relays, so it reserves no CPU.
SERVER_DEFAULTS = {"max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 1}, "health_check_period_s": 2}
INGRESS_DEFAULTS = {"max_ongoing_requests": 1024, "ray_actor_options": {"num_cpus": 0}}
ENCODER_DEFAULTS = {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 1}}
# The ledger is one replica by design (the tenants' state in one place); each ingress replica keeps
# one long poll open on it, and each request makes two short calls. With one ingress replica the
# ledger lives in that replica instead.
LEDGER_OPTIONS = {"num_replicas": 1, "max_ongoing_requests": 100_000, "ray_actor_options": {"num_cpus": 0}}


class DeploymentOptions(BaseModel):
    """The options of `serve.deployment` that a Pagoda deployment takes from the config (Serve
    checks their values when it deploys; `autoscaling_config` is checked here, first)."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int | str | None = Field(None, description='a count, or "auto" with autoscaling_config')
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    autoscaling_config: dict[str, Any] | None = None
    ray_actor_options: dict[str, Any] | None = None
    placement_group_bundles: list[dict[str, float]] | None = None
    placement_group_strategy: str | None = None
    max_replicas_per_node: int | None = None
    health_check_period_s: float | None = None
    health_check_timeout_s: float | None = None
    graceful_shutdown_wait_loop_s: float | None = None
    graceful_shutdown_timeout_s: float | None = Field(None, description="default: the app's drain_timeout_s")
    request_router_config: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _autoscaling_config_is_serves(self):
        if self.autoscaling_config is not None:
            from ray.serve.config import AutoscalingConfig

            unknown = set(self.autoscaling_config) - set(AutoscalingConfig.model_fields)
            if unknown:  # Serve itself would ignore a misspelt key
                raise ValueError(f"autoscaling_config: unknown option(s) {', '.join(sorted(unknown))}")
            AutoscalingConfig(**self.autoscaling_config)  # its own errors name the field
        return self

    def as_kwargs(self) -> dict:
        return self.model_dump(exclude_none=True)

    @property
    def max_replicas(self) -> int:
        """The most replicas this deployment can have: its count, or its autoscaling maximum."""
        if isinstance(self.num_replicas, int):
            return self.num_replicas
        return int((self.autoscaling_config or {}).get("max_replicas", 1))

    def autoscaled_by_engine(self, role: str, engine: dict) -> dict:
        """These options, with an autoscaling_config (if any) completed to scale on the engine's
        signals (cluster/serve/autoscaling.py): Pagoda's defaults under the config's own keys, and
        the policy's targets from the engine's batch limits unless the config names them."""
        kwargs = self.as_kwargs()
        if self.autoscaling_config is None:
            return kwargs
        from cluster.engine.config import EngineConfig
        from cluster.serve.autoscaling import POLICY_FUNCTION, SERVER_AUTOSCALING_DEFAULTS

        autoscaling = {**SERVER_AUTOSCALING_DEFAULTS, **self.autoscaling_config}
        policy = {"policy_function": POLICY_FUNCTION, **(autoscaling.get("policy") or {})}
        if policy.get("policy_function") == POLICY_FUNCTION:
            limits = EngineConfig(**engine)
            policy["policy_kwargs"] = {"role": role, "target_num_seqs": limits.max_num_seqs,
                                       "target_tokens_to_prefill": 4 * limits.max_num_batched_tokens,
                                       **policy.get("policy_kwargs", {})}
        kwargs["autoscaling_config"] = {**autoscaling, "policy": policy}
        return kwargs


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="HF model directory; default: the fetched default model")
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig options")
    max_waiting_requests: int = Field(256, ge=1, description="beyond this, new requests get 429 / RESOURCE_EXHAUSTED")
    limits: InputLimits = Field(default_factory=InputLimits, description="what one request may ask for")
    request_timeout_s: float | None = Field(600.0, gt=0, description="the longest server-side deadline of any request")
    request_deadline: RequestDeadline = Field(default_factory=RequestDeadline,
                                              description="a request's deadline from its size, when its client sets none")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM or a replica stop: how long requests in flight may finish")
    torch_threads: int | None = Field(None, description="torch threads of the engine (default: all CPUs of the node; a step of a "
                                                      "few decodes may take one fewer, leaving that core to the serving processes, "
                                                      "where that measures faster)")
    stream_interval: int | None = Field(None, ge=1, description="tokens of a stream per message after its first (as vLLM's; "
                                        "default: by load, 1 up to 15 running streams, then one more per 8, at most 4); "
                                        "the last token and errors go at once")
    llm_server: DeploymentOptions = Field(default_factory=lambda: DeploymentOptions(**SERVER_DEFAULTS))
    disaggregated: bool = Field(False, description="prefill on PrefillServer, decode on the LLMServer deployment")
    engine_in_ingress: bool = Field(False, description="each Ingress replica runs its own engine in its process (no "
                                    "LLMServer deployment; the Ingress deployment takes llm_server's options): one Ray "
                                    "call fewer per message, which a small node's engine step pays for "
                                    "(cluster/serve/in_process.py)")
    prefill_engine: dict[str, Any] = Field(default_factory=dict, description="EngineConfig options of the prefill side over `engine`")
    prefill_torch_threads: int | None = Field(None, description="torch threads of the prefill engine (default: torch_threads)")
    prefill_server: DeploymentOptions = Field(default_factory=lambda: DeploymentOptions(**SERVER_DEFAULTS))
    ingress: DeploymentOptions = Field(default_factory=lambda: DeploymentOptions(**INGRESS_DEFAULTS))
    encoder_server: DeploymentOptions = Field(default_factory=lambda: DeploymentOptions(**ENCODER_DEFAULTS),
                                              description="the EncoderServer deployment (engine.encoder: deployment)")
    front_door: bool = Field(False, description="`pagoda serve` puts HAProxy in front of the HTTP port; it refuses "
                             "generation requests with 429 while the ingress queue is full (cluster/serve/front_door.py)")
    front_door_dir: str | None = Field(None, description="set by `pagoda serve`: where the ingress tells the front door")
    api_keys_file: str | None = Field(None, description="tenants and their API keys (cluster/serve/tenants.py); "
                                      "none: the server is open to anyone who reaches it")
    cors_allowed_origins: list[str] = Field(default_factory=list, description="origins whose browser pages may call "
                                            "the HTTP API (CORS); none: CORS off")
    circuit_breaker: CircuitBreakerConfig = Field(default_factory=CircuitBreakerConfig,
                                                  description="per backend, in each ingress replica")
    usage_log: str | None = Field(None, description="append-only JSON lines, one per request that ended, on the "
                                  "ledger's node (with one Ingress replica, that replica's); `pagoda usage FILE` sums "
                                  "them per tenant; none: no log")

    @model_validator(mode="before")
    @classmethod
    def _deployment_options_over_the_defaults(cls, data):
        """A deployment's options in the config replace only the defaults they name."""
        if isinstance(data, dict):
            for name, defaults in (("llm_server", SERVER_DEFAULTS), ("prefill_server", SERVER_DEFAULTS),
                                   ("ingress", INGRESS_DEFAULTS), ("encoder_server", ENCODER_DEFAULTS)):
                if isinstance(data.get(name), dict):
                    data = {**data, name: {**defaults, **data[name]}}
        return data

    @model_validator(mode="after")
    def _one_ingress_behind_the_front_door(self):
        if self.front_door and self.ingress_options.max_replicas != 1:
            raise ValueError("front_door: needs exactly one Ingress replica (it mirrors that replica's queue)")
        return self

    @model_validator(mode="after")
    def _engine_in_ingress_has_one_engine(self):
        if self.engine_in_ingress and self.disaggregated:
            raise ValueError("engine_in_ingress: not with disaggregated (the prefill and decode engines are "
                             "deployments of their own)")
        return self

    @property
    def ingress_options(self) -> DeploymentOptions:
        """The Ingress deployment's options: with engine_in_ingress its replicas are the engines,
        so llm_server's options (replicas, autoscaling, resources) over the ingress's."""
        if not self.engine_in_ingress:
            return self.ingress
        return DeploymentOptions(**{**self.ingress.as_kwargs(), **self.llm_server.as_kwargs()})


def check_app_args(args: dict) -> tuple[AppConfig, dict | None, dict]:
    """Validates the app args before anything is deployed: every option, and that each engine's
    tensor-parallel size splits the model's heads (a replica that cannot start would otherwise be
    retried by Serve until a timeout). Returns (config, prefill engine or None, decode engine)."""
    from cluster.engine.config import EngineConfig
    from model.config import ModelConfig
    from model.tp_layout import head_shard

    config = parse_app_config(args)
    if config.api_keys_file:
        load_keys_file(config.api_keys_file)  # a missing or malformed file fails here, naming it
    model = config.model
    if model is None:
        from cluster.model_fetch import fetch_default_model

        model = str(fetch_default_model())
    prefill = {"model": model, **config.engine, **config.prefill_engine, "kv_role": "prefill"} if config.disaggregated else None
    decode = {"model": model, **config.engine, **({"kv_role": "decode"} if config.disaggregated else {})}
    model_config = ModelConfig.from_dir(model)
    for engine in filter(None, (prefill, decode)):
        tp = EngineConfig(**engine).tensor_parallel_size  # unknown or bad options raise here
        head_shard(model_config.num_attention_heads, model_config.num_key_value_heads, tp, 0)
    return config, prefill, decode


def build_app(args: dict | None = None):
    config, prefill_engine, decode_engine = check_app_args(args or {})
    common = dict(max_waiting_requests=config.max_waiting_requests, request_timeout_s=config.request_timeout_s,
                  request_deadline=config.request_deadline.model_dump(), torch_threads=config.torch_threads,
                  stream_interval=config.stream_interval)
    prefill_server = None
    # Serve waits this long for a stopping replica's requests (then LLMServer.shutdown ends the
    # rest with an error); the ingress a little longer, so it can still relay that error.
    drain = {"graceful_shutdown_timeout_s": config.drain_timeout_s}
    if config.disaggregated:
        prefill_options = {**drain, **config.prefill_server.autoscaled_by_engine("prefill", prefill_engine)}
        prefill_options.setdefault("request_router_config", PREFIX_AFFINITY_ROUTER)
        prefill_server = serve.deployment(LLMServer, name="PrefillServer", **prefill_options).bind(
            engine_config=prefill_engine,
            **{**common, "torch_threads": config.prefill_torch_threads or config.torch_threads})
    if config.engine_in_ingress:  # the Ingress replicas are the engines: they drain and scale as servers do
        llm_server = InProcess(LLMServer, {"engine_config": decode_engine, **common})
        ingress_options = {**drain, **config.ingress_options.autoscaled_by_engine("decode", decode_engine)}
    else:
        ingress_options = {"graceful_shutdown_timeout_s": config.drain_timeout_s + 10, **config.ingress.as_kwargs()}
        decode_options = {**drain, **config.llm_server.autoscaled_by_engine("decode", decode_engine)}
        if config.disaggregated:  # unless the config names another router
            decode_options.setdefault("request_router_config", PREFIX_AFFINITY_ROUTER)
        llm_server = serve.deployment(LLMServer, name="LLMServer", **decode_options).bind(
            engine_config=decode_engine, prefill_server=prefill_server, **common)
    tenants = load_keys_file(config.api_keys_file) if config.api_keys_file else None
    ledger_args = {"tenants": tenants, "usage_log": config.usage_log}
    if config.ingress_options.max_replicas == 1:  # the one Ingress replica keeps the ledger (in_process.py)
        ledger = InProcess(TenantLedger, ledger_args)
    else:
        ledger = serve.deployment(TenantLedger, name="TenantLedger", **LEDGER_OPTIONS).bind(**ledger_args)
    ingress_cls = serve.ingress()(Ingress)  # the HTTP app: Ingress.__serve_build_asgi_app__
    return serve.deployment(ingress_cls, name="Ingress", **ingress_options).bind(
        llm_server, ledger, limits=config.limits.model_dump(), max_pending_requests=max_pending_requests(config),
        front_door_dir=config.front_door_dir, encoder_server=encoder_server(config, decode_engine), tenants=tenants,
        circuit_breaker=config.circuit_breaker.model_dump(), cors_allowed_origins=config.cors_allowed_origins)


def encoder_server(config: AppConfig, engine: dict):
    """The EncoderServer deployment when the engine's encoder is one (and the model multimodal)."""
    from cluster.engine.config import EngineConfig
    from cluster.serve.encoder_server import EncoderServer
    from model.multimodal_spec import MultimodalSpec

    options = EngineConfig(**engine)
    if options.encoder != "deployment" or MultimodalSpec.from_dir(options.model) is None:
        return None
    return serve.deployment(EncoderServer, name="EncoderServer", **config.encoder_server.as_kwargs()).bind(
        model=options.model, dtype=options.dtype, device=options.device,
        embedding_cache_bytes=options.embedding_cache_bytes, torch_threads=config.torch_threads)


def parse_app_config(args: dict | None) -> AppConfig:
    """The app args as options, without touching the model (check_app_args does that too)."""
    return AppConfig.model_validate(_parse_cli_args(args or {}))


def max_pending_requests(config: AppConfig) -> int:
    """The ingress refuses at once what every server replica would refuse: their queues together."""
    return config.max_waiting_requests * (1 if config.engine_in_ingress else config.llm_server.max_replicas)


def _parse_cli_args(args: dict) -> dict:
    """`serve run ... key=value` passes strings; nested keys use dots (engine.max_num_seqs=32)."""
    import yaml

    parsed: dict = {}
    for key, value in args.items():
        value = yaml.safe_load(value) if isinstance(value, str) else value
        target = parsed
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target.setdefault(parent, {})
        target[leaf] = value
    return parsed
