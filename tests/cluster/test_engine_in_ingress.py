"""engine_in_ingress: each Ingress replica runs its own engine and calls it in process
(cluster/serve/in_process.py). The handle's streams behave as Serve's (a cancel from another task
ends the generator's cleanup, the reader sees RequestCancelledError), the app has no LLMServer
deployment and its Ingress takes the server's options, and over the real server it answers as the
offline engine does, shows its engine in `status`, and frees every block of streams dropped
mid-way."""

from __future__ import annotations

import asyncio

import pytest
import requests
from pydantic import ValidationError
from ray.serve.exceptions import RequestCancelledError

from cluster.serve.app import build_app, max_pending_requests, parse_app_config
from cluster.serve.autoscaling import POLICY_FUNCTION
from cluster.serve.in_process import InProcess, LocalHandle
from cluster.serve.placement import app_demands
from tests.served_apps import deployed
from tests.parity_prompts import CHAT_QUESTIONS
from tests.cluster.test_serving import GREEDY, chat_request, collect, engine_stats, wait_idle
from tests.cluster.test_serving import offline_answers  # noqa: F401 - a fixture


class Counting:
    """A toy server: a stream of numbers that records how it ended."""

    def __init__(self):
        self.ended: list[str] = []

    async def numbers(self, count: int):
        try:
            for i in range(count):
                await asyncio.sleep(0.01)
                yield i
            self.ended.append("done")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        except GeneratorExit:
            self.ended.append("closed")
            raise

    def plain(self, x):
        return x + 1

    async def awaited(self, x):
        return x * 2


async def reading(stream, got: list) -> asyncio.Task:
    """A task reading `stream` into `got`, once it has read a few numbers."""
    async def read():
        async for i in stream:
            got.append(i)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.05)
    return reader


def test_a_local_handle_calls_and_streams_as_a_deployment_handle_does():
    async def main():
        server = Counting()
        handle = LocalHandle(server)
        assert await handle.plain.remote(1) == 2 and await handle.awaited.remote(3) == 6
        assert [i async for i in handle.options(stream=True).numbers.remote(3)] == [0, 1, 2]
        assert server.ended == ["done"]

    asyncio.run(main())


def test_a_cancel_from_another_task_ends_the_generator_and_the_reader():
    async def main():
        server = Counting()
        stream = LocalHandle(server).options(stream=True).numbers.remote(1000)
        got = []
        reader = await reading(stream, got)
        stream.cancel()  # while the reader waits for the next number
        with pytest.raises(RequestCancelledError):
            await reader
        assert server.ended == ["cancelled"] and 0 < len(got) < 1000

    asyncio.run(main())


def test_a_cancel_between_messages_closes_the_generator():
    async def main():
        server = Counting()
        stream = LocalHandle(server).options(stream=True).numbers.remote(1000)
        assert await stream.__anext__() == 0
        stream.cancel()  # the reader holds a message, the generator waits at its yield
        with pytest.raises(RequestCancelledError):
            await stream.__anext__()
        assert server.ended == ["closed"]

    asyncio.run(main())


def test_a_cancelled_reader_cancels_the_generator():
    async def main():
        server = Counting()
        stream = LocalHandle(server).options(stream=True).numbers.remote(1000)
        reader = await reading(stream, [])
        reader.cancel()  # a client gone: Serve cancels the request's task
        with pytest.raises(asyncio.CancelledError):
            await reader
        await asyncio.sleep(0)
        assert server.ended == ["cancelled"]

    asyncio.run(main())


def test_the_ingress_takes_the_servers_options_and_there_is_no_llm_server(model_dir):
    args = {"model": model_dir, "engine_in_ingress": True, "max_waiting_requests": 7,
            "llm_server": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}}
    config = parse_app_config(args)
    assert config.ingress_options.ray_actor_options == {"num_cpus": 1}  # the server's, not the ingress's 0
    assert max_pending_requests(config) == 7  # one engine per ingress replica
    ingress = build_app(args)._bound_deployment
    assert ingress.name == "Ingress"
    server, ledger = ingress.init_args
    assert isinstance(server, InProcess) and server.kwargs["engine_config"]["model"] == model_dir
    assert ledger._bound_deployment.name == "TenantLedger"  # up to 3 replicas share it; no LLMServer deployment
    autoscaling = ingress._deployment_config.autoscaling_config
    assert autoscaling.policy.policy_function == POLICY_FUNCTION
    assert autoscaling.policy.policy_kwargs["role"] == "decode" and autoscaling.max_replicas == 3
    demands = app_demands(config, None, {"model": model_dir, "tensor_parallel_size": 2})
    assert [d.what for d in demands] == ["Ingress replica 1", "Ingress replica 1: 2 TP ranks"]


def test_engine_in_ingress_is_refused_with_disaggregated_prefill():
    with pytest.raises(ValidationError, match="engine_in_ingress: not with disaggregated"):
        parse_app_config({"engine_in_ingress": True, "disaggregated": True})


@pytest.fixture(scope="module")
def one_process_app(server, model_dir):
    with deployed({**server, "model_dir": model_dir}, "one-process", "/one-process", engine_in_ingress=True,
                  engine={"num_blocks": 256, "max_num_seqs": 8}) as app:
        yield app


def test_it_answers_as_the_offline_engine_over_http_and_grpc(one_process_app, offline_answers, server):
    from ray import serve

    assert set(serve.status().applications["one-process"].deployments) == {"Ingress"}  # its engine and ledger in it
    text, token_ids, _ = collect(one_process_app["stub"].Generate(
        chat_request(CHAT_QUESTIONS[0]), metadata=one_process_app["metadata"]))
    assert text == offline_answers[0].text and token_ids == offline_answers[0].token_ids
    chat = requests.post(f"{one_process_app['http']}/v1/chat/completions", timeout=300, json={
        "model": server["model"], "messages": [{"role": "user", "content": CHAT_QUESTIONS[1]}], **GREEDY}).json()
    assert chat["choices"][0]["message"]["content"] == offline_answers[1].text
    status = requests.get(f"{one_process_app['http']}/v1/pagoda/status", timeout=60).json()
    [group] = status["groups"]
    assert group["deployment"] == "Ingress" and group["role"] == "colocated" and len(group["ranks"]) == 1


def test_dropped_streams_free_every_block(one_process_app):
    total = engine_stats(one_process_app)["kv_blocks_total"]
    for i in range(4):
        with requests.post(f"{one_process_app['http']}/v1/completions", stream=True, timeout=60, json={
                "prompt": f"Essay number {i}:", "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 3 + i:
                    break  # closing the response drops the connection
    # A lost abort would decode 4,000 tokens (over 16 s even at 4 ms a token); aborts take < 0.2 s.
    now = wait_idle(one_process_app, timeout_s=10.0)
    assert now["num_streams"] == 0 and now["kv_blocks_free"] == total
