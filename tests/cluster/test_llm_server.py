"""LLMServer as a plain class (no Serve): deadlines, overload and aborts in its engine thread."""

import asyncio

import pytest

from cluster import SamplingParams
from cluster.serve.errors import EngineOverloadedError, RequestTimeoutError
from cluster.serve.generation import GenerationRequest
from cluster.serve.llm_server import LLMServer

LONG = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def make_server(model_dir):
    servers = []

    def make(engine=None, **kwargs):
        server = LLMServer({"model": model_dir, "num_blocks": 128, **(engine or {})}, torch_threads=2, **kwargs)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.shutdown()


async def drain(server, request):
    return [delta async for delta in server.generate(request)]


def test_deadline_stops_the_request_and_frees_its_blocks(make_server):
    server = make_server(request_timeout_s=0.5)
    with pytest.raises(RequestTimeoutError):
        asyncio.run(drain(server, GenerationRequest("slow", [1, 2, 3, 4], LONG)))
    stats = server.stats()
    assert stats["num_running"] == 0 and stats["num_streams"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_without_a_client_deadline_a_request_gets_one_for_its_size(make_server):
    """2,000 tokens at 1 ms each + 1 s: stopped after ~3 s, far under the 600 s cap; a client's
    own deadline is kept as given."""
    import time

    server = make_server(request_timeout_s=600, request_deadline={"base_s": 1.0, "per_output_token_s": 0.001})
    started = time.monotonic()
    with pytest.raises(RequestTimeoutError):
        asyncio.run(drain(server, GenerationRequest("big", [1, 2, 3, 4], LONG)))
    assert time.monotonic() - started < 30
    short = GenerationRequest("short", [1, 2, 3, 4], SamplingParams(max_tokens=2, temperature=0), timeout_s=300)
    assert server._timeout(short) == 300 and server._timeout(GenerationRequest("c", [1], LONG, timeout_s=900)) == 600
    assert server._timeout(GenerationRequest("d", [1] * 10, SamplingParams(max_tokens=10, n=2))) == pytest.approx(1.22)


def test_a_caller_that_goes_away_aborts_its_request(make_server):
    server = make_server()

    async def take_three():
        stream = server.generate(GenerationRequest("gone", [5, 6, 7], LONG))
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # what a cancelled handle call does to the generator
        return got

    assert len(asyncio.run(take_three())) == 3
    for _ in range(50):  # the engine thread picks the abort up on its next turn
        stats = server.stats()
        if stats["num_running"] == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert stats["num_running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_beyond_the_waiting_cap_requests_are_refused_at_once(make_server):
    server = make_server(engine={"max_num_seqs": 1}, max_waiting_requests=2)

    async def scenario():
        streams, firsts = [], []
        for i in range(3):  # r0 runs (one sequence at a time), then r1 and r2 wait
            streams.append(server.generate(GenerationRequest(f"r{i}", [9, 10, 11 + i], LONG)))
            firsts.append(asyncio.ensure_future(streams[-1].__anext__()))
            while server.stats()["num_running"] + server.stats()["num_waiting"] < i + 1:
                await asyncio.sleep(0.01)
        assert server.stats()["num_waiting"] == 2
        with pytest.raises(EngineOverloadedError):
            await server.generate(GenerationRequest("r3", [1, 2], LONG)).__anext__()
        for future in firsts:
            future.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()

    asyncio.run(scenario())


def test_a_stream_that_falls_behind_gets_several_tokens_per_message(make_server):
    """A consumer slower than the engine gets the waiting steps' tokens merged into one delta each
    time it reads: fewer messages, every token in order (equal to a prompt consumer's tokens)."""
    import time

    server = make_server()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def consume(delay_s):
        deltas = []
        async for delta in server.generate(GenerationRequest(f"c{delay_s}", [5, 6, 7, 8], params)):
            deltas.append(delta)
            time.sleep(delay_s)  # blocks this loop: the engine thread keeps stepping meanwhile
        return deltas

    prompt, slow = asyncio.run(consume(0.0)), asyncio.run(consume(0.3))
    tokens = lambda deltas: [t for d in deltas for t in d.new_token_ids]  # noqa: E731
    assert len(tokens(prompt)) == 24 and tokens(slow) == tokens(prompt) and len(slow) < len(prompt)
    assert slow[-1].finish_reason == "length" and "".join(d.new_text for d in slow) == "".join(d.new_text for d in prompt)


def test_stream_interval_sends_the_first_token_alone_then_several_per_message(make_server):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    each, grouped = make_server(), make_server(stream_interval=4)
    one = asyncio.run(drain(each, GenerationRequest("each", [5, 6, 7, 8], params)))
    four = asyncio.run(drain(grouped, GenerationRequest("four", [5, 6, 7, 8], params)))
    tokens = lambda deltas: [t for d in deltas for t in d.new_token_ids]  # noqa: E731
    assert tokens(four) == tokens(one) and len(tokens(one)) == 24
    sizes = [len(d.new_token_ids) for d in four]
    assert sizes[0] == 1 and all(size >= 4 for size in sizes[1:-1]) and 1 <= sizes[-1]  # 1, 4, 4, ..., the rest
    assert len(four) <= 7 and four[-1].finish_reason == "length"


def test_a_preempted_stream_sends_what_it_holds(make_server):
    """Two requests outgrow 10 blocks: one is preempted and waits for the other. Its held tokens
    go out while it waits (a third message between its first token and its last), not with its end."""
    server = make_server(engine={"num_blocks": 10, "max_num_seqs": 2}, stream_interval=100_000)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def both():
        return await asyncio.gather(*(drain(server, GenerationRequest(f"p{i}", [5, 6, 7, 8 + i], params))
                                      for i in range(2)))

    first, second = asyncio.run(both())
    assert sorted([len(first), len(second)]) == [2, 3]  # the one that ran through: its first token, then the rest
    assert all(sum(len(d.new_token_ids) for d in deltas) == 100 for deltas in (first, second))
    assert server.stats()["num_preemptions"] >= 1


def test_by_load_one_token_per_message_for_a_few_streams_up_to_four_for_many():
    from cluster.serve.delta_stream import stream_interval

    assert [stream_interval(n) for n in (0, 1, 15, 16, 24, 31, 32, 64, 500)] == [1, 1, 1, 2, 3, 3, 4, 4, 4]


def test_held_tokens_reach_the_client_before_an_error(make_server):
    """A request that runs past its deadline while its stream holds tokens: they arrive, in order,
    then the error."""
    server = make_server(request_timeout_s=1.0, stream_interval=100_000)
    received = []

    async def consume():
        async for delta in server.generate(GenerationRequest("held", [1, 2, 3, 4], LONG)):
            received.append(delta)

    with pytest.raises(RequestTimeoutError):
        asyncio.run(consume())
    assert len(received) == 2 and len(received[0].new_token_ids) == 1 and len(received[1].new_token_ids) > 1
    stats = server.stats()
    assert stats["num_streams"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_coalesce_keeps_errors_and_other_candidates_apart():
    from cluster.engine.outputs import RequestDelta, coalesce

    def delta(index, token, finish=None):
        return RequestDelta("r", index, [token], str(token), [], finish, 3)

    error = RuntimeError("x")
    merged = coalesce([delta(0, 1), delta(0, 2), delta(1, 3), delta(1, 4, "stop"), delta(0, 5), error, delta(0, 6)])
    assert [(d.index, d.new_token_ids, d.new_text, d.finish_reason) if isinstance(d, RequestDelta) else d
            for d in merged] == [(0, [1, 2], "12", None), (1, [3, 4], "34", "stop"), (0, [5], "5", None), error,
                                 (0, [6], "6", None)]
