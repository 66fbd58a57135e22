"""The parity oracle's own rule: only a divergence at a near-tie is accepted."""

import pytest

from tests.hf_reference import Reference, compare


def test_equal_outputs_are_equal():
    assert compare([1, 2, 3], Reference([1, 2, 3], [0.5, 0.5, 0.5])) == "equal"


def test_divergence_at_a_near_tie_is_accepted_and_what_follows_is_ignored():
    assert compare([1, 9, 9, 9], Reference([1, 2, 3], [0.5, 5e-4, 0.5])) == "near-tie"


def test_divergence_at_a_clear_winner_fails():
    with pytest.raises(AssertionError, match="diverged at output token 1"):
        compare([1, 9, 3], Reference([1, 2, 3], [0.5, 2e-3, 0.5]))


def test_stopping_early_or_late_fails():
    with pytest.raises(AssertionError, match="lengths differ"):
        compare([1, 2], Reference([1, 2, 3], [0.5, 0.5, 0.5]))
