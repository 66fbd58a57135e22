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


def make_tenant_scheduler(policy: str, max_seqs: int):
    kv = KVCacheManager(64, BLOCK, "test-model")
    return Scheduler(kv, KVConnector(kv, offload=None, executor=None), 64, max_seqs, tenant_scheduling=policy)


def scheduled(plan) -> list[str]:
    return [s.request.request_id for s in plan.scheduled]


def test_a_tenants_burst_does_not_queue_ahead_of_another_tenant():
    """A's four requests arrived first; with fair shares B's one is admitted second, not fifth."""
    for policy, expected in (("fair", ["a0", "b0"]), ("fcfs", ["a0", "a1"])):
        scheduler = make_tenant_scheduler(policy, max_seqs=2)
        for i in range(4):
            scheduler.add(make_request(f"a{i}", 2, first_token=10 * i + 1, tenant="a"))
        scheduler.add(make_request("b0", 2, first_token=90, tenant="b"))
        assert scheduled(scheduler.schedule()) == expected, policy


def test_a_full_batch_gives_a_seat_to_a_tenant_below_its_share():
    scheduler = make_tenant_scheduler("fair", max_seqs=2)
    for i in range(3):
        scheduler.add(make_request(f"a{i}", 2, max_tokens=50, first_token=10 * i + 1, tenant="a"))
    run_step(scheduler, scheduler.schedule())
    run_step(scheduler, scheduler.schedule())  # a0 and a1 decode, a2 waits: one tenant, no preemption
    assert [r.request_id for r in scheduler.running] == ["a0", "a1"]
    scheduler.add(make_request("b0", 2, first_token=90, tenant="b"))
    plan = scheduler.schedule()
    assert [r.request_id for r in plan.preempted] == ["a1"]  # A's newest gives B its seat, at once
    assert scheduled(plan) == ["a0", "b0"]
    run_step(scheduler, plan)
    plan = scheduler.schedule()  # each at its share (1 of 2 seats): nobody else is preempted
    assert not plan.preempted and scheduled(plan) == ["a0", "b0"]


def test_seats_follow_the_tenants_weights():
    scheduler = make_tenant_scheduler("fair", max_seqs=4)
    for i in range(6):
        scheduler.add(make_request(f"a{i}", 2, max_tokens=50, first_token=10 * i + 1, tenant="a", weight=3))
        scheduler.add(make_request(f"b{i}", 2, max_tokens=50, first_token=10 * i + 5, tenant="b", weight=1))
    for _ in range(4):
        run_step(scheduler, scheduler.schedule())
    assert sorted(r.tenant for r in scheduler.running) == ["a", "a", "a", "b"]


def test_a_returning_tenant_gets_no_credit_for_its_idle_time():
    """B ran alone for a while, A was idle: when A comes back it starts level with B, not with
    the whole of B's past service as a head start."""
    scheduler = make_tenant_scheduler("fair", max_seqs=1)
    scheduler.add(make_request("b0", 8, max_tokens=2, tenant="b"))
    while scheduler.running or scheduler.waiting:
        run_step(scheduler, scheduler.schedule())
    scheduler.add(make_request("b1", 2, max_tokens=1, first_token=30, tenant="b"))
    for i in range(3):
        scheduler.add(make_request(f"a{i}", 2, max_tokens=1, first_token=40 + 10 * i, tenant="a"))
    order = []
    while scheduler.running or scheduler.waiting:
        plan = scheduler.schedule()
        order += scheduled(plan)
        run_step(scheduler, plan)
    assert order.index("b1") < order.index("a2")  # A's three do not all go before B's one
