"""The light-step thread count: each choice timed a few times, then the faster one by its recent
median, the other now and then."""

from cluster.serve.light_steps import EXPLORE_EVERY, FIRST_SAMPLES, LightStepThreads


def run(chooser, step_s: dict[int, float], steps: int) -> list[int]:
    picks = []
    for _ in range(steps):
        threads = chooser.pick()
        chooser.record(threads, step_s[threads])
        picks.append(threads)
    return picks


def test_both_counts_are_timed_then_the_faster_runs_and_the_slower_is_retried_now_and_then():
    chooser = LightStepThreads(2)
    first = 2 * FIRST_SAMPLES
    picks = run(chooser, {1: 0.020, 2: 0.015}, first + 4 * EXPLORE_EVERY)
    assert picks[:first] == [1, 2] * FIRST_SAMPLES  # each in turn
    assert picks[first:].count(1) == 4 and picks[first:].count(2) == 4 * EXPLORE_EVERY - 4
    assert run(LightStepThreads(2), {1: 0.015, 2: 0.020}, first + EXPLORE_EVERY)[first:].count(1) == EXPLORE_EVERY - 1


def test_one_slow_step_does_not_decide():
    """The first two-thread step ran beside the first token's response and took 20x its usual time."""
    chooser = LightStepThreads(2)
    chooser.record(2, 0.100)
    picks = run(chooser, {1: 0.008, 2: 0.005}, 2 * FIRST_SAMPLES + 32)
    assert picks[-32:].count(2) == 32 - 32 // EXPLORE_EVERY


def test_a_change_in_the_host_moves_the_choice():
    chooser = LightStepThreads(2)
    run(chooser, {1: 0.020, 2: 0.015}, 40)  # both cores faster at first
    picks = run(chooser, {1: 0.015, 2: 0.030}, 60 * EXPLORE_EVERY)  # then the second core is busy
    assert picks[-EXPLORE_EVERY:].count(1) == EXPLORE_EVERY - 1


def test_one_thread_has_nothing_to_choose():
    chooser = LightStepThreads(1)
    assert run(chooser, {1: 0.01}, 5) == [1] * 5
