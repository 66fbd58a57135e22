"""Where an application's engines run: for every model-server replica, its role, its TP group's
ranks and the node and process of each (what `pagoda status --json` shows under "groups").

Serve names each replica actor "SERVE_REPLICA::<app>#<deployment>#<id>" in its namespace; this
asks each of them, inside its own process, for its LLMServer's `describe()`.
"""

from __future__ import annotations

import ray

SERVE_NAMESPACE = "serve"
# The deployments whose replicas may hold an engine (the Ingress's with engine_in_ingress)
MODEL_SERVERS = ("LLMServer", "PrefillServer", "Ingress")


def _describe_servable(_replica_actor) -> dict | None:
    from ray import serve

    return serve.get_replica_context().servable_object.describe()  # None: an Ingress without an engine


def describe_groups(app_name: str, timeout_s: float = 10.0) -> list[dict]:
    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    groups = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] != SERVE_NAMESPACE:
            continue
        parts = entry["name"].removeprefix("SERVE_REPLICA::").split("#")
        if len(parts) != 3 or parts[0] != app_name or parts[1] not in MODEL_SERVERS:
            continue
        try:
            actor = ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE)
            info = ray.get(actor.__ray_call__.remote(_describe_servable), timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - a replica starting or dying: say so, list the rest
            groups.append({"deployment": parts[1], "replica": parts[2], "error": type(e).__name__})
            continue
        if info is None:
            continue
        for rank in info["ranks"]:
            rank["node_ip"] = node_ips.get(rank["node_id"])
        groups.append({"deployment": parts[1], "replica": parts[2], **info})
    return sorted(groups, key=lambda g: (g["deployment"], g["replica"]))
