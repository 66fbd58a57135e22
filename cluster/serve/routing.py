"""The prefix-affinity router of Pagoda's disaggregated deployments: Ray Serve's own
PrefixCacheAffinityRouter (the replica whose past prompts share the longest prefix, unless queue
lengths differ by more than a threshold), with its prefix-tree actor on the head node.

Why: the router creates that detached actor from whichever process first routes (a decode replica,
for its handle to the prefill deployment) with Ray's default actor resources, which need a CPU to
schedule; it lands on a worker node, and an alive actor keeps that node from ever being idle, so
Ray's autoscaler could never remove it (seen on the simulated cluster: benchmarks/autoscaling_ramp.py
--disaggregated). Created here first, same name and namespace, with no CPU and affinity to the head;
the router then finds it (get_if_exists) and Serve's controller still cleans it up on shutdown.
The affinity is hard: Ray places a task or actor that asks for no resources on a random node when
its node affinity is soft (ray-project/ray#25360 fixed only the hard case), which is what put one of
the two tree actors of a disaggregated app on a worker.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter


class HeadNodePrefixAffinityRouter(PrefixCacheAffinityRouter):
    def initialize_state(self, *args, tree_actor=None, **kwargs):
        super().initialize_state(*args, tree_actor=tree_actor or _tree_actor_on_head(self._deployment_id), **kwargs)


def _tree_actor_on_head(deployment_id):
    import ray
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTreeActor
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
    parts = [SERVE_NAMESPACE, *([deployment_id.app_name, deployment_id.name] if deployment_id else [])]
    actor = PrefixTreeActor.options(
        name="LlmPrefixTreeActor", namespace="::".join(p for p in parts if p), get_if_exists=True,
        lifetime="detached", num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False),
    ).remote()
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller._register_shutdown_cleanup_actor.remote(actor))  # as the router does for its own
    return actor
