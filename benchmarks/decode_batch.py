"""A decode batch held in an engine for timing its steps (decode_step_profile, gpu_check).

A batch's prompts prefill within a budget of max_num_batched_tokens a step, and the first ones
decode while the later ones prefill: a request that may only make the timed steps' tokens has ended
before they run, and the "batch" timed is smaller than asked. Each request here may make as many
tokens as the batch's prefill can take steps, plus the steps the caller times.
"""

from __future__ import annotations

from contextlib import contextmanager

from cluster import SamplingParams


def blocks_per_request(batch: int, prompt_len: int, steps: int, chunk: int, block_size: int) -> int:
    """The most KV blocks a request of decoding_batch holds (for sizing a cache before the engine
    exists)."""
    return -(-(prompt_len + new_tokens(batch, batch * prompt_len, steps, chunk)) // block_size)


def new_tokens(batch: int, prompt_tokens: int, steps: int, chunk: int) -> int:
    """max_tokens of each request: a token for each step the batch's prefill can take (a step's
    budget of `chunk` tokens goes first to the requests already decoding, at most batch - 1, the
    rest to prompts), `steps` more, and one so that none ends on the last of them."""
    return -(-prompt_tokens // max(1, chunk - (batch - 1))) + steps + 1


@contextmanager
def decoding_batch(engine, prompts: list[list[int]], steps: int, tag: str):
    """Adds the prompts (greedy, ignore_eos) and runs their prefill; inside, every one decodes for
    at least `steps` more engine steps. On leaving, checks they all still decode, then aborts them."""
    chunk = engine.config.max_num_batched_tokens
    max_tokens = new_tokens(len(prompts), sum(map(len, prompts)), steps, chunk)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    try:
        while (stats := engine.stats()).num_waiting or stats.num_prefilling:
            engine.step()
        yield
        running = engine.stats().num_running
        assert running == len(prompts), f"{running} of the batch's {len(prompts)} requests still decoding"
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
