"""The usage log: one JSON line per request that ended, appended by the TenantLedger (its only
writer), so that it can be summed per tenant (`pagoda usage FILE`) and replayed when the ledger
restarts (the budgets' rolling windows survive it).

    {"time": 1796200000.12, "tenant": "team-a", "request_id": "...", "replica": "...",
     "prompt_tokens": 12, "cached_tokens": 0, "output_tokens": 16, "media_items": 0,
     "compute_units": 76.0, "outcome": "ok"}
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Iterator

SUMMED = ("prompt_tokens", "cached_tokens", "output_tokens", "media_items", "compute_units")


class UsageLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # O_APPEND: every write lands at the end, whatever else has the file open.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def append(self, record: dict) -> None:
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


def read_usage(path: str | Path) -> Iterator[dict]:
    """The records of a usage log, oldest first. A last line cut short by a crash is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def sum_by_tenant(records) -> dict[str, dict]:
    """Tenant -> {"requests": N, and the sum of each of SUMMED}; an open server's tenant is ""."""
    totals: dict[str, dict] = defaultdict(lambda: {"requests": 0, **{key: 0 for key in SUMMED}})
    for record in records:
        total = totals[record.get("tenant") or ""]
        total["requests"] += 1
        for key in SUMMED:
            total[key] += record.get(key, 0)
    return dict(totals)
