"""How many torch threads a light step (a few decodes, nothing to prefill) runs on, chosen by
measuring both choices as the server runs.

Served on a small node, the engine shares its cores with the processes that carry each token to
the client (the Ingress replica, HAProxy). Leaving one core to them keeps the engine's own threads from being
descheduled mid-step (an OpenMP thread that loses its core stalls its partners at every barrier);
keeping every core makes the step itself shorter. Which wins depends on the host: on one 2-core VM,
one stream's TPOT was 25.8 ms with one thread fewer and 27.7 ms with both, and on the same VM a
day later 15.9-17.1 ms against 14.7-15.1 (docs/benchmarks-log.md). So the server times its light steps
on each count, mostly runs the faster one and keeps trying the other now and then.
"""

from __future__ import annotations

import statistics
from collections import deque

EXPLORE_EVERY = 16  # one light step in this many runs on the count not chosen
WINDOW = 8  # each count's last step times; their median is its estimate
FIRST_SAMPLES = 4  # steps each count takes in turn before the faster is chosen


class LightStepThreads:
    """One step that came out slow (the first token's response written beside it, a burst of the
    cluster's own work) does not decide: each count is judged by the median of its last WINDOW
    steps. A running mean seeded by one such step could keep a server on one thread (1.6x slower a
    step here) for hundreds of steps; one served stream's TPOT was one thread's in a turn of three
    (docs/benchmarks-log.md)."""

    def __init__(self, threads: int):
        self.choices = (max(1, threads - 1), threads)
        self.recent: dict[int, deque[float]] = {choice: deque(maxlen=WINDOW) for choice in self.choices}
        self._num_steps = 0

    def pick(self) -> int:
        """The count for the next light step: each in turn for FIRST_SAMPLES steps, then the faster
        (the slower one every EXPLORE_EVERY-th step, so a change in the host's load is noticed)."""
        still_timing = [c for c in self.choices if len(self.recent[c]) < FIRST_SAMPLES]
        if still_timing:
            return min(still_timing, key=lambda c: len(self.recent[c]))
        self._num_steps += 1
        faster, slower = sorted(self.choices, key=lambda c: statistics.median(self.recent[c]))
        return slower if self._num_steps % EXPLORE_EVERY == 0 else faster

    def record(self, threads: int, seconds: float) -> None:
        self.recent[threads].append(seconds)
