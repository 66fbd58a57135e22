"""The TenantLedger on its own (no Serve): admission under a tenant's limits, charges over the
rolling window, the usage log and its replay, cancellation reaching the replica that runs a request."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.serve.ledger import TenantLedger, RequestSize, Usage
from cluster.serve.tenants import TenantsFile
from cluster.serve.usage_log import read_usage, sum_by_tenant

KEY = "sk-0123456789abcdef"


def ledger(tmp_path, **limits) -> TenantLedger:
    tenants = TenantsFile.model_validate({
        "compute_units": {"prompt_token": 1, "output_token": 2, "media_item": 10},
        "tenants": {"a": {"keys": [KEY], **limits}, "b": {"keys": [KEY + "b"]}}})
    return TenantLedger(tenants, str(tmp_path / "usage.jsonl"))


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_budget_admits_until_exactly_its_units_are_spent(tmp_path):
    async def scenario():
        book = ledger(tmp_path, budget={"units": 40, "window_s": 3600})
        size = RequestSize(prompt_tokens=4, media_items=0, n=1, max_tokens=6)  # 4 + 12 = 16 units at most
        first = await book.admit("a", "r1", "ingress-1", size)
        assert first.max_tokens == 6 and first.units_limit is None
        second = await book.admit("a", "r2", "ingress-2", size)  # 16 reserved by r1: 24 left, enough
        assert second.max_tokens == 6
        third = await book.admit("a", "r3", "ingress-1", size)  # 8 left: lowered to 2 tokens (4 + 4)
        assert (third.max_tokens, third.units_limit) == (2, 8)
        assert (await book.admit("a", "r4", "ingress-1", size)).refusal == "quota"  # 0 left, all reserved
        assert await book.finish("a", "r1", Usage(4, 0, 6, 0), "ok") == 16
        assert await book.finish("a", "r2", Usage(4, 0, 1, 0), "error") == 6  # charged what it consumed
        assert await book.finish("a", "r3", Usage(4, 0, 2, 0), "ok") == 8
        refused = await book.admit("a", "r4", "ingress-1", size)  # 40 - 30 = 10 left: 4 + 2*3
        assert refused.max_tokens == 3
        await book.finish("a", "r4", Usage(4, 0, 3, 0), "ok")
        refused = await book.admit("a", "r5", "ingress-1", size)
        assert refused.refusal == "quota" and refused.retry_after_s > 3500
        assert "0 of its 40 compute units per 3600 s left" in refused.reason
        assert (await book.admit("b", "r5", "ingress-1", size)).max_tokens == 6  # b has no limits

    run(scenario())
    totals = sum_by_tenant(read_usage(tmp_path / "usage.jsonl"))
    assert totals["a"]["compute_units"] == 40 and totals["a"]["requests"] == 4


def test_the_window_survives_a_restart_of_the_ledger(tmp_path):
    async def scenario():
        book = ledger(tmp_path, budget={"units": 20, "window_s": 3600})
        await book.admit("a", "r1", "i", RequestSize(4, 0, 1, 8))
        await book.finish("a", "r1", Usage(4, 0, 8, 0), "ok")  # 20 units: all of it
        again = ledger(tmp_path, budget={"units": 20, "window_s": 3600})
        assert (await again.admit("a", "r2", "i", RequestSize(1, 0, 1, 1))).refusal == "quota"

    run(scenario())


def test_caps_and_concurrency(tmp_path):
    async def scenario():
        book = ledger(tmp_path, max_units_per_request=30, max_concurrent_requests=2)
        capped = await book.admit("a", "r1", "i", RequestSize(4, 1, n=2, max_tokens=None))  # 14 fixed, 4 per step
        assert (capped.max_tokens, capped.units_limit) == (4, 30)
        assert (await book.admit("a", "r1", "i", RequestSize(1, 0, 1, 1))).refusal == "duplicate"
        assert (await book.admit("b", "r1", "i", RequestSize(1, 0, 1, 1))).refusal is None  # ids are per tenant
        await book.admit("a", "r2", "i", RequestSize(1, 0, 1, 1))
        busy = await book.admit("a", "r3", "i", RequestSize(1, 0, 1, 1))
        assert busy.refusal == "quota" and "2 requests running" in busy.reason
        too_large = await book.admit("a", "r4", "i", RequestSize(29, 0, 1, 1))
        assert too_large.refusal == "too_large"

    run(scenario())


def test_a_cancel_reaches_the_replica_running_the_request_and_no_other_tenant(tmp_path):
    async def scenario():
        book = ledger(tmp_path)
        await book.admit("a", "job", "ingress-2", RequestSize(1, 0, 1, 1))
        assert [r["id"] for r in await book.requests("a")] == ["job"] and await book.requests("b") == []
        assert not await book.cancel("b", "job")
        waiting = asyncio.ensure_future(book.next_cancellations("ingress-2"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        assert await book.cancel("a", "job")
        assert await asyncio.wait_for(waiting, 1) == [("a", "job")]

    run(scenario())


def test_a_cut_last_line_of_the_log_is_skipped(tmp_path):
    path = tmp_path / "usage.jsonl"
    path.write_text(json.dumps({"tenant": "a", "compute_units": 3}) + "\n" + '{"tenant": "a", "comp')
    assert sum_by_tenant(read_usage(path)) == {"a": {"requests": 1, "prompt_tokens": 0, "cached_tokens": 0,
                                                     "output_tokens": 0, "media_items": 0, "compute_units": 3}}


@pytest.mark.parametrize("tenant", [None, "a"])
def test_an_open_server_or_unlimited_tenant_is_never_lowered(tmp_path, tenant):
    async def scenario():
        admission = await TenantLedger().admit(tenant, "r", "i", RequestSize(100, 2, 3, None))
        assert admission.max_tokens is None and admission.refusal is None

    run(scenario())
