import torch

from model.sampler import SamplingRow, _filtered_probs, sample


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 0.0]])
    tokens, logprobs = sample(logits, [SamplingRow(0.0, num_logprobs=2), SamplingRow(0.0)])
    assert tokens == [1, 0]
    expected = torch.log_softmax(logits[0], -1)
    assert abs(logprobs[0].logprob - expected[1].item()) < 1e-6
    assert [t for t, _ in logprobs[0].top] == [1, 3]
    assert logprobs[1] is None


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    probs = _filtered_probs(logits, [SamplingRow(1.0, top_k=2), SamplingRow(1.0, top_p=0.8), SamplingRow(1.0, top_p=0.81)])
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    assert (probs[2] > 0).tolist() == [True, True, True, False]
    torch.testing.assert_close(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_seeded_rows_draw_the_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seeded = lambda: SamplingRow(1.0, generator=torch.Generator().manual_seed(7))  # noqa: E731
    alone = sample(logits[1:2], [seeded()])[0][0]
    in_batch = sample(logits, [SamplingRow(1.0), seeded(), SamplingRow(1.0)])[0][1]
    assert alone == in_batch
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    seq1 = [sample(logits, [SamplingRow(1.0, generator=g1)] * 3)[0] for _ in range(5)]
    seq2 = [sample(logits, [SamplingRow(1.0, generator=g2)] * 3)[0] for _ in range(5)]
    assert seq1 == seq2
    assert len({tuple(s) for s in seq1}) > 1  # the generator advances: draws are not all equal


def test_a_row_with_non_finite_numbers_gets_no_token_and_the_others_are_unchanged():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    rows = lambda: [SamplingRow(0.0, num_logprobs=1), SamplingRow(1.0, generator=torch.Generator().manual_seed(3)),  # noqa: E731
                    SamplingRow(0.7, generator=torch.Generator().manual_seed(4)), SamplingRow(0.0)]
    clean_tokens, clean_logprobs = sample(logits, rows())
    for bad in (float("nan"), float("inf"), float("-inf")):
        for victim in range(4):
            poisoned = logits.clone()
            poisoned[victim, 7] = bad
            tokens, logprobs = sample(poisoned, rows())
            assert tokens[victim] is None and logprobs[victim] is None
            assert [t for i, t in enumerate(tokens) if i != victim] == [t for i, t in enumerate(clean_tokens) if i != victim]
    assert clean_logprobs[0].token_id == clean_tokens[0]


def test_a_temperature_below_epsilon_is_greedy_not_an_overflow():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5]])
    for temperature in (1e-40, 5e-324, 1e-6):
        tokens, _ = sample(logits, [SamplingRow(temperature, generator=torch.Generator().manual_seed(0))])
        assert tokens == [1]
