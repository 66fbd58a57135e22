"""Turn a step's logits into tokens: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Greedy rows take the argmax. Random rows are filtered in one batched pass (one sort serves both
top-k and top-p) and then drawn one by one, each from its request's own torch.Generator, so a seeded
request draws the same numbers whatever else shares its batch. Logprobs are the log-softmax of the
raw logits, before temperature and filtering, as OpenAI and vLLM report them.

A row whose numbers went bad (a NaN or infinite logit, probabilities that cannot be drawn from)
gets no token: its request fails alone, and every other row is sampled as if it were not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Temperatures below this are greedy (as in vLLM): dividing logits by less overflows float32.
GREEDY_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    temperature: float  # below GREEDY_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    generator: torch.Generator | None = None
    num_logprobs: int | None = None  # None: not asked for
    # Structured output: the tokens allowed next, as xgrammar's packed bitmask (int32 words, a bit
    # per token); None: any token.
    allowed_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top: list[tuple[int, float]]  # the num_logprobs most likely tokens, most likely first


def is_greedy(row: SamplingRow) -> bool:
    return row.temperature < GREEDY_TEMPERATURE


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int | None], list[TokenLogprobs | None]]:
    """logits: [S, vocab] float32, one row per entry of `rows`. A row that cannot be sampled
    (non-finite numbers) gets None for its token and its logprobs."""
    if any(not is_greedy(row) or row.num_logprobs is not None for row in rows):
        logits = logits.cpu()  # seeded draws use CPU generators: the same tokens on every device
    # A NaN or infinity anywhere in a row makes its sum non-finite: one reduction instead of a
    # [rows, vocab] mask and a second pass over it (an order of magnitude faster on the CPU). Before
    # the grammars' -inf.
    good = torch.isfinite(logits.sum(dim=-1)).tolist()
    _allow_only(logits, rows)
    token_ids = logits.max(dim=-1).indices  # the first maximum, as argmax; faster on CPU
    random_rows = [i for i, row in enumerate(rows) if not is_greedy(row) and good[i]]
    if random_rows:
        index = torch.tensor(random_rows)
        probs = _filtered_probs(logits[index], [rows[i] for i in random_rows])
        drawable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        for j, i in enumerate(random_rows):
            if drawable[j]:
                token_ids[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
            else:
                good[i] = False
    token_list: list[int | None] = [t if ok else None for t, ok in zip(token_ids.tolist(), good)]
    return token_list, _logprobs(logits, token_list, rows)


def _allow_only(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """-inf for the tokens a row's grammar does not allow, every constrained row in one call."""
    constrained = [i for i, row in enumerate(rows) if row.allowed_tokens is not None]
    if not constrained:
        return
    import xgrammar

    bitmask = torch.stack([rows[i].allowed_tokens for i in constrained]).to(logits.device)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=constrained)


def _filtered_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    temperatures = torch.tensor([row.temperature for row in rows], dtype=logits.dtype)
    logits = logits / temperatures[:, None]
    top_ks = [row.top_k for row in rows]
    top_ps = [row.top_p for row in rows]
    if any(top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
        drop = torch.arange(vocab)[None, :] >= ks[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = before >= torch.tensor(top_ps, dtype=logits.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def _logprobs(logits: torch.Tensor, token_ids: list[int], rows: list[SamplingRow]) -> list[TokenLogprobs | None]:
    wanted = [i for i, row in enumerate(rows) if row.num_logprobs is not None and token_ids[i] is not None]
    result: list[TokenLogprobs | None] = [None] * len(rows)
    if not wanted:
        return result
    logprobs = torch.log_softmax(logits[torch.tensor(wanted)], dim=-1)
    max_k = max(rows[i].num_logprobs for i in wanted)
    top_values, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (None, None)
    for j, i in enumerate(wanted):
        k = rows[i].num_logprobs
        top = list(zip(top_ids[j, :k].tolist(), top_values[j, :k].tolist())) if k else []
        result[i] = TokenLogprobs(token_ids[i], logprobs[j, token_ids[i]].item(), top)
    return result
