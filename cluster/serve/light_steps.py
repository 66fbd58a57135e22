"""How many torch threads a light step (a few decodes, nothing to prefill) runs on, chosen by
measuring both choices as the server runs.

Served on a small node, the engine shares its cores with the processes that carry each token to
the client (the Ingress replica, HAProxy). Leaving one core to them keeps the engine's own threads from being
descheduled mid-step (an OpenMP thread that loses its core stalls its partners at every barrier);
keeping every core makes the step itself shorter. Which wins depends on the host: on one 2-core VM,
one stream's TPOT was 25.8 ms with one thread fewer and 27.7 ms with both, and on the same VM a
day later 15.9-17.1 ms against 14.7-15.1 (docs/benchmarks.md). So the server times its light steps
on each count, mostly runs the faster one and keeps trying the other now and then.
"""

from __future__ import annotations

EXPLORE_EVERY = 16  # one light step in this many runs on the count not chosen
SMOOTHING = 0.1  # weight of a new step time in each count's running average


class LightStepThreads:
    def __init__(self, threads: int):
        self.choices = (max(1, threads - 1), threads)
        self.mean_s: dict[int, float | None] = dict.fromkeys(self.choices)
        self._num_steps = 0

    def pick(self) -> int:
        """The count for the next light step: each once first, then the faster (the slower one
        every EXPLORE_EVERY-th step, so a change in the host's load is noticed)."""
        for choice in self.choices:
            if self.mean_s[choice] is None:
                return choice
        self._num_steps += 1
        faster, slower = sorted(self.choices, key=lambda c: self.mean_s[c])
        return slower if self._num_steps % EXPLORE_EVERY == 0 else faster

    def record(self, threads: int, seconds: float) -> None:
        mean = self.mean_s[threads]
        self.mean_s[threads] = seconds if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * seconds
