"""The oracle: HF transformers greedy decoding on the same model directory, with the gap between
its top-2 logits at every step so that a divergence can be told apart from a near-tie.

Its answers are kept on disk ($PAGODA_HOME/test-oracle), keyed by the weights' fingerprint, the
prompts, the length, and the versions of transformers and torch: the same question to the same
oracle gets the answer HF gave, without loading HF again."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

NEAR_TIE = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    out = hf_model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    gaps = []
    for logits in out.logits:
        top2 = logits[0].float().topk(2).values
        gaps.append((top2[0] - top2[1]).item())
    return Reference(tokens, gaps)


def cached_greedy(model_dir: str, load_hf_model: Callable[[], object], prompts: list[list[int]],
                  max_new_tokens: int) -> list[Reference]:
    """`hf_greedy` of each prompt, from the disk cache or computed (HF loaded only then) and kept."""

    def compute() -> list[Reference]:
        hf_model = load_hf_model()
        return [hf_greedy(hf_model, prompt, max_new_tokens) for prompt in prompts]

    return kept_on_disk(model_dir, [prompts, max_new_tokens], compute)


def kept_on_disk(model_dir: str, question: list, compute: Callable[[], list[Reference]]) -> list[Reference]:
    """HF's answers to `question` (anything whose repr names it) on the model in `model_dir`: from
    the disk cache, or `compute()`d and kept. The key holds the weights' fingerprint, the
    directory's other files (config, tokenizer, processor, template) and the versions of
    transformers and torch."""
    import transformers

    from cluster.model_fetch import pagoda_home
    from model.loader import weight_files, weights_fingerprint

    weights = {p.name for p in weight_files(model_dir)}
    others = [(p.name, p.read_bytes()) for p in sorted(Path(model_dir).iterdir())
              if p.is_file() and p.name not in weights and not p.name.startswith(".")]  # a dotfile: a cache
    key = repr([weights_fingerprint(model_dir), others, transformers.__version__, torch.__version__, question])
    path = pagoda_home() / "test-oracle" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        return [Reference(**answer) for answer in json.loads(path.read_text())]
    except (OSError, ValueError, TypeError):
        pass
    answers = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps([asdict(answer) for answer in answers]))
    partial.replace(path)  # whole or absent, whatever else runs at the same time
    return answers


def first_difference(ours: list[int], ref: Reference) -> int | None:
    """The first output token where ours and HF's differ (over their common length), or None."""
    return next((step for step, (a, b) in enumerate(zip(ours, ref.token_ids)) if a != b), None)


def compare(ours: list[int], ref: Reference) -> str:
    """'equal', or 'near-tie' when the first difference is at a step where HF's top-2 logits are
    within NEAR_TIE (what follows a near-tie is a different, equally valid continuation).
    Raises AssertionError on any other difference."""
    step = first_difference(ours, ref)
    if step is not None:
        assert ref.top2_gaps[step] < NEAR_TIE, (
            f"diverged at output token {step}: ours {ours[step]}, HF {ref.token_ids[step]}, "
            f"HF top-2 gap {ref.top2_gaps[step]:.2e}"
        )
        return "near-tie"
    assert len(ours) == len(ref.token_ids), f"lengths differ: ours {len(ours)}, HF {len(ref.token_ids)}"
    return "equal"


def check_all(outputs: list[list[int]], references: list[Reference]) -> list[str]:
    """Every output equals its reference; a near-tie is a legitimate divergence, but it must stay
    the exception (at most 2)."""
    verdicts = [compare(ours, ref) for ours, ref in zip(outputs, references, strict=True)]
    assert verdicts.count("near-tie") <= 2, verdicts
    return verdicts
