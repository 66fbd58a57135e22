"""CancellationWatch: a tenant's cancel by id reaches the ingress replica that streams the request.

    DELETE /v1/pagoda/requests/{id} | Cancel(request_id)  (any ingress replica)
        -> TenantLedger.cancel -> the replica that admitted it, through its long poll
        -> that replica cancels the stream: the model server aborts the request, and the
           client's stream ends with RequestCancelledError (499 / CANCELLED)

One long poll of the ledger per replica, from its first request on; it is also the replica's
sign of life to the ledger."""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger("pagoda.ingress")


class CancellationWatch:
    def __init__(self, ledger, replica: str):
        self._ledger = ledger
        self._replica = replica
        # This replica's running requests by (tenant, request_id): their response streams.
        self._streams: dict[tuple[str, str], object] = {}
        self._cancelled: set[tuple[str, str]] = set()
        self._task: asyncio.Task | None = None
        self._poll = None  # the ledger call the task is waiting on

    def add(self, key: tuple[str, str], stream) -> None:
        self._streams[key] = stream
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._watch())

    def remove(self, key: tuple[str, str]) -> bool:
        """Forget a stream that ended; True when its tenant had cancelled it."""
        del self._streams[key]
        if key in self._cancelled:
            self._cancelled.discard(key)
            return True
        return False

    def was_cancelled(self, key: tuple[str, str]) -> bool:
        return key in self._cancelled

    async def _watch(self) -> None:
        while True:
            try:
                self._poll = self._ledger.next_cancellations.remote(self._replica)
                cancelled = await self._poll
            except Exception:  # noqa: BLE001 - the ledger restarting: ask again shortly
                logger.warning("cannot reach the tenant ledger; retrying", exc_info=True)
                await asyncio.sleep(1.0)
                continue
            for key in map(tuple, cancelled):
                stream = self._streams.get(key)
                if stream is not None:
                    self._cancelled.add(key)
                    stream.cancel()

    def stop(self) -> None:
        """The long poll is a request in flight at the ledger, and Serve stops a replica only once
        its requests end: left running, it would hold the ledger's stop (an app's delete, a
        redeploy, `pagoda serve`'s exit) up to the poll's timeout."""
        if self._task is not None:
            self._task.cancel()
        if self._poll is not None:
            self._poll.cancel()
