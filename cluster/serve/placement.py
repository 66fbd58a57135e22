"""Does an application's shape fit a fixed-size Ray cluster? Checked before deploying.

Serve retries a replica that cannot be placed until a timeout, and a TP group waits for its
placement group: on a cluster that cannot grow, a shape that does not fit would hang for minutes
and end in a traceback. So `pagoda serve` (whose local cluster has a fixed size) adds up what the
replicas it starts with ask for: each replica actor (`ray_actor_options`, or its
`placement_group_bundles`) and each rank of its TP group (a bundle of `TP_RANK_CPUS` CPUs, and a
GPU on CUDA), and places them on the nodes' resources first-fit, largest first. What does not fit
is named with the way out. Where an autoscaler can add nodes, pending resources are its signal
instead, and nothing is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.config import EngineConfig

TP_RANK_CPUS = 0.5  # cluster/executor/tp_group.py: cpus_per_worker


class AppDoesNotFitError(ValueError):
    pass


@dataclass(frozen=True)
class Demand:
    """Resources that one actor (or one placement group's bundles) needs on the cluster."""

    what: str
    bundles: tuple[dict[str, float], ...]
    strategy: str = "PACK"  # how the bundles may spread over nodes (Ray's placement strategies)

    def total(self, resource: str) -> float:
        return sum(b.get(resource, 0.0) for b in self.bundles)


def app_demands(config, prefill_engine: dict | None, decode_engine: dict) -> list[Demand]:
    """What the app asks for as it starts: every deployment's initial replicas, with their TP ranks."""
    if config.engine_in_ingress:
        deployments = [("Ingress", config.ingress_options, decode_engine)]
    else:
        deployments = [("Ingress", config.ingress, None), ("LLMServer", config.llm_server, decode_engine)]
    if prefill_engine is not None:
        deployments.insert(1, ("PrefillServer", config.prefill_server, prefill_engine))
    demands = []
    for name, options, engine in deployments:
        for replica in range(initial_replicas(options)):
            what = f"{name} replica {replica + 1}"
            demands.append(Demand(what, replica_bundles(options), options.placement_group_strategy or "PACK"))
            if engine is not None:
                engine_config = EngineConfig(**engine)
                if engine_config.tensor_parallel_size > 1:
                    gpu = {"GPU": 1.0} if engine_config.device.startswith("cuda") else {}
                    rank = {"CPU": TP_RANK_CPUS, **gpu}
                    demands.append(Demand(f"{what}: {engine_config.tensor_parallel_size} TP ranks",
                                          (rank,) * engine_config.tensor_parallel_size,
                                          engine_config.tp_placement_strategy))
    return demands


def initial_replicas(options) -> int:
    if isinstance(options.num_replicas, int):
        return options.num_replicas
    autoscaling = options.autoscaling_config or {}
    initial = autoscaling.get("initial_replicas")
    return int(initial if initial is not None else autoscaling.get("min_replicas", 1))


def replica_bundles(options) -> tuple[dict[str, float], ...]:
    if options.placement_group_bundles:
        return tuple(dict(b) for b in options.placement_group_bundles)
    actor = options.ray_actor_options or {}
    bundle = {"CPU": float(actor.get("num_cpus", 1)), "GPU": float(actor.get("num_gpus", 0)),
              **{k: float(v) for k, v in (actor.get("resources") or {}).items()}}
    if actor.get("memory"):
        bundle["memory"] = float(actor["memory"])
    return ({k: v for k, v in bundle.items() if v},)


def unplaced(demands: list[Demand], nodes: list[dict[str, float]]) -> list[Demand]:
    """The demands that do not fit the nodes' free resources, placed largest first on the first
    node (or nodes, as each one's strategy allows) with room."""
    free = [dict(node) for node in nodes]
    left = []
    def largest_bundle_first(d: Demand) -> tuple[float, float]:
        return min((-b.get("GPU", 0.0), -b.get("CPU", 0.0)) for b in d.bundles)

    for demand in sorted(demands, key=largest_bundle_first):
        trial = [dict(node) for node in free]
        if _place(demand, trial):
            free = trial
        else:
            left.append(demand)
    return left


def _place(demand: Demand, free: list[dict[str, float]]) -> bool:
    def fits(bundle, node):
        return all(node.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())

    def take(bundle, node):
        for k, v in bundle.items():
            node[k] = node.get(k, 0.0) - v

    if demand.strategy == "STRICT_PACK":  # every bundle on one node
        whole = {k: demand.total(k) for b in demand.bundles for k in b}
        for node in free:
            if fits(whole, node):
                take(whole, node)
                return True
        return False
    used: set[int] = set()
    for bundle in demand.bundles:
        candidates = [i for i, node in enumerate(free) if fits(bundle, node)
                      and not (demand.strategy == "STRICT_SPREAD" and i in used)]
        if not candidates:
            return False
        take(bundle, free[candidates[0]])
        used.add(candidates[0])
    return True


def check_fit(config, prefill_engine: dict | None, decode_engine: dict, nodes: list[dict[str, float]]) -> None:
    """Raises AppDoesNotFitError naming what does not fit, what the app needs and what the cluster has."""
    demands = app_demands(config, prefill_engine, decode_engine)
    left = unplaced(demands, nodes)
    if not left:
        return
    needs = {k: sum(d.total(k) for d in demands) for k in ("CPU", "GPU")}
    has = {k: sum(node.get(k, 0.0) for node in nodes) for k in ("CPU", "GPU")}
    shown = ", ".join(f"{k} {needs[k]:g} (the cluster has {has[k]:g})" for k in needs if needs[k])
    items = "; ".join(f"{d.what}: {' + '.join(_fmt(b) for b in d.bundles)}" for d in demands)
    raise AppDoesNotFitError(
        f"this shape does not fit the Ray cluster: {', '.join(d.what for d in left)} cannot be placed. "
        f"It needs {shown} [{items}]. Start the cluster with more logical CPUs (pagoda serve --num-cpus N: "
        f"scheduling slots, not cores), use fewer TP ranks or replicas, or lower a deployment's "
        f"ray_actor_options.num_cpus")


def check_fit_on_new_node(config, prefill_engine: dict | None, decode_engine: dict, num_cpus: float) -> None:
    """check_fit on the one node that a local cluster of `num_cpus` logical CPUs will have, before it
    starts: a shape that cannot fit is refused in a second, not after Ray's start-up. Only for a
    shape that asks for no GPU (the node's GPUs are Ray's to detect, once it runs)."""
    if not any(d.total("GPU") for d in app_demands(config, prefill_engine, decode_engine)):
        check_fit(config, prefill_engine, decode_engine, [{"CPU": float(num_cpus)}])


def _fmt(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k} {v:g}" for k, v in bundle.items()) + "}"


def cluster_nodes() -> list[dict[str, float]]:
    """Each alive node's resources (the cluster this process is connected to)."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]
