from cache_service import KVCacheManager
from cluster.engine.kv_connector import KVConnector
from cluster.engine.request import FinishReason, RequestStatus
from cluster.engine.scheduler import Scheduler
from tests.cluster.factories import make_request

BLOCK = 4


def make_scheduler(num_blocks=16, budget=32, max_seqs=8):
    kv = KVCacheManager(num_blocks, BLOCK, "test-model")
    connector = KVConnector(kv, offload=None, executor=None)  # no tiers, no swap: nothing to move
    return Scheduler(kv, connector, budget, max_seqs), kv


def run_step(scheduler, plan, next_token=7):
    """What the engine does after the workers return: update, then append sampled tokens."""
    samplers = [s.request for s in plan.scheduled if s.samples]
    scheduler.update(plan)
    for request in samplers:
        request.append_output(next_token)
        if request.finish_reason:
            scheduler.finish(request, request.finish_reason)


def test_long_prompt_is_prefilled_in_chunks_beside_decodes():
    scheduler, _ = make_scheduler(budget=10)
    short, long = make_request("short", 3), make_request("long", 25)
    scheduler.add(short)
    scheduler.add(long)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in plan.scheduled] == [
        ("short", 3, True), ("long", 7, False)]
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("short", 1), ("long", 9)]
    run_step(scheduler, plan)
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in plan.scheduled] == [
        ("short", 1, True), ("long", 9, True)]


def test_max_num_seqs_caps_admission():
    scheduler, _ = make_scheduler(max_seqs=2)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", 2))
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == 1


def test_newest_request_is_preempted_when_blocks_run_out_and_resumes_later():
    scheduler, kv = make_scheduler(num_blocks=4, budget=64)
    old = make_request("old", 8, max_tokens=8)
    new = make_request("new", 7, max_tokens=8, first_token=50)  # no shared prefix
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler, scheduler.schedule())  # old: 2 blocks (9 tokens next), new: 2 blocks
    assert kv.num_free_blocks == 0
    plan = scheduler.schedule()  # old needs a third block for its 9th token: new must go
    assert [r.request_id for r in plan.preempted] == ["new"]
    assert [s.request.request_id for s in plan.scheduled] == ["old"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.waiting[0] is new
    while old.status != RequestStatus.FINISHED:
        run_step(scheduler, scheduler.schedule())
    while new.status != RequestStatus.FINISHED:
        run_step(scheduler, scheduler.schedule())
    assert new.num_output_tokens == 8 and new.num_preemptions == 1
    assert kv.num_free_blocks == 4


def test_repeated_prefix_skips_computed_blocks():
    scheduler, kv = make_scheduler()
    first = make_request("first", 13, max_tokens=1)
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule())
    assert first.finish_reason == FinishReason.LENGTH
    second = make_request("second", 13, max_tokens=1)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second.num_computed_tokens == 12 and plan.scheduled[0].num_new_tokens == 1
    assert kv.pool.stats.num_hit_tokens == 12 and kv.pool.stats.num_queried_tokens == 26


def test_finishing_waiting_and_running_requests_frees_everything():
    scheduler, kv = make_scheduler(max_seqs=1)
    running, waiting = make_request("a", 9), make_request("b", 9)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    scheduler.finish(running, FinishReason.ABORT)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert scheduler.num_unfinished == 0 and kv.num_free_blocks == 16
