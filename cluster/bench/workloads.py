"""Benchmark workloads: lists of BenchRequest, reproducible from a seed.

    random   prompts of random tokens with given input/output lengths (as `vllm bench serve`)
    chat     multi-turn conversations; every turn resends the history with the model's answers
    docqa    long-document QA over Python's own documentation (pydoc_data), two questions per
             document, so a prefix cache can reuse each document
    file     a JSONL prompts file ({"prompt": ...} or {"messages": [...]}, optional "max_tokens")
    probe    the cross-talk probe: each request asks the model to copy a unique 6-digit code, few-shot;
             the answer must start with that code (SmolLM2-135M copies 64 of 64 alone)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "chat", "docqa", "file", "probe")

CHAT_OPENERS = [
    "Tell me about the history of tea.", "How do volcanoes form?", "Explain how a bicycle stays upright.",
    "What makes bread rise?", "Why is the sky blue?", "How do bees make honey?",
    "What is a black hole?", "How does a compass work?", "Why do leaves change colour in autumn?",
    "How are mountains formed?", "What is photosynthesis?", "How do airplanes fly?",
]
CHAT_FOLLOW_UPS = ["Can you say more about that?", "Why is that so?", "Give me an example.",
                   "Summarize that in one sentence.", "What is a common misconception about it?"]
DOC_QUESTIONS = ["What is this section of the Python documentation about? Answer briefly.",
                 "Name one rule this section states."]


@dataclass
class BenchRequest:
    prompt: str | None = None  # sent to /v1/completions (gRPC: prompt)
    messages: list[dict] | None = None  # sent to /v1/chat/completions (gRPC: messages)
    max_tokens: int = 128
    expected: str | None = None  # probe: the answer must start with this
    follow_ups: list[str] = field(default_factory=list)  # chat: later user turns, sent one by one


@dataclass
class WorkloadSpec:
    name: str = "random"
    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    turns: int = 3  # chat: user turns per conversation
    prompts_file: str | None = None
    seed: int = 0


def build(spec: WorkloadSpec, tokenizer) -> list[BenchRequest]:
    if spec.name not in WORKLOADS:
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}; got {spec.name!r}")
    if not 0 <= spec.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1); got {spec.range_ratio}")
    rng = random.Random(spec.seed)
    make = {"random": _random, "chat": _chat, "docqa": _docqa, "file": _file, "probe": _probe}[spec.name]
    return make(spec, tokenizer, rng)


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def _random(spec, tokenizer, rng) -> list[BenchRequest]:
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    requests = []
    for _ in range(spec.num_prompts):
        ids = rng.choices(vocab, k=_length(rng, spec.input_len, spec.range_ratio))
        requests.append(BenchRequest(prompt=tokenizer.decode(ids), max_tokens=_length(rng, spec.output_len, spec.range_ratio)))
    return requests


def _chat(spec, tokenizer, rng) -> list[BenchRequest]:
    return [
        BenchRequest(
            messages=[{"role": "user", "content": f"{CHAT_OPENERS[i % len(CHAT_OPENERS)]} (conversation {i})"}],
            max_tokens=_length(rng, spec.output_len, spec.range_ratio),
            follow_ups=rng.sample(CHAT_FOLLOW_UPS, k=min(spec.turns - 1, len(CHAT_FOLLOW_UPS))),
        )
        for i in range(spec.num_prompts)
    ]


def _docqa(spec, tokenizer, rng) -> list[BenchRequest]:
    from pydoc_data.topics import (
        topics,  # the stdlib's own docs: offline, a few hundred sections
    )

    sections = sorted(topics.values(), key=len, reverse=True)
    requests = []
    for i in range(spec.num_prompts):
        ids = tokenizer(sections[(i // 2) % len(sections)]).input_ids[: _length(rng, spec.input_len, spec.range_ratio)]
        document = tokenizer.decode(ids)
        question = DOC_QUESTIONS[i % 2]
        requests.append(BenchRequest(
            messages=[{"role": "user", "content": f"{document}\n\n{question}"}],
            max_tokens=_length(rng, spec.output_len, spec.range_ratio),
        ))
    return requests


def _file(spec, tokenizer, rng) -> list[BenchRequest]:
    from cluster.engine.prompt import read_prompt_records

    if not spec.prompts_file:
        raise ValueError("--workload file needs --prompts-file")
    with open(spec.prompts_file) as f:
        records = read_prompt_records(f)
    return [
        BenchRequest(prompt=r.get("prompt"), messages=r.get("messages"), max_tokens=int(r.get("max_tokens", spec.output_len)))
        for r in (records[i % len(records)] for i in range(spec.num_prompts))
    ]


def _probe(spec, tokenizer, rng) -> list[BenchRequest]:
    codes = rng.sample(range(100_000, 1_000_000), spec.num_prompts)
    return [
        BenchRequest(
            prompt=f"Code: 482913\nCopy: 482913\nCode: 770215\nCopy: 770215\nCode: {code}\nCopy:",
            max_tokens=8,  # one token per digit plus the leading space
            expected=f" {code}",
        )
        for code in codes
    ]
