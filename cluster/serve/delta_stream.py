"""DeltaStream: one request's deltas on their way from the engine thread to the caller's event
loop, with what its latency metrics need."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class DeltaStream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None
    num_unfinished: int  # candidates still to finish (engine thread only)
    arrival: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    held: list = field(default_factory=list)  # deltas kept back for the next message (stream_interval)

    def put(self, *items) -> bool:
        """Hand the held deltas and these items to the caller's event loop in one callback (the
        caller then takes them as one message); False when that loop is gone."""
        items, self.held = [*self.held, *items], []
        try:
            self.loop.call_soon_threadsafe(_put_all, self.queue, items)
            return True
        except RuntimeError:  # the loop was closed: nobody will read this stream again
            return False


def _put_all(queue_: asyncio.Queue, items: list) -> None:
    for item in items:
        queue_.put_nowait(item)


STREAMS_PER_EXTRA_TOKEN = 8  # by load: one more token per message for every 8 streams running...
MAX_STREAM_INTERVAL = 4  # ...up to 4 (a step of 64 streams takes ~0.4 s here: 1.6 s between messages)


def stream_interval(num_running: int) -> int:
    """Tokens per message by load: one each up to 15 streams, 4 from 32 (served on 2 cores, 32
    streams: TPOT 306 -> 217 ms, output 95 -> 133 tok/s; docs/benchmarks-log.md), so a few streams
    see every token at once and many streams do not drown the serving path in messages."""
    return max(1, min(MAX_STREAM_INTERVAL, num_running // STREAMS_PER_EXTRA_TOKEN))
