"""Varied prompts for parity with HF: chat and raw, short and 2K+ tokens, with shared prefixes.
Long texts come from Python's own documentation topics, available offline everywhere."""

from pydoc_data.topics import topics


def long_document(chars: int, start: int = 0) -> str:
    """The documentation topics from the `start`th on, cut at `chars` characters."""
    names = sorted(topics)[start:]
    text, i = "", 0
    while len(text) < chars:
        text += topics[names[i]] + "\n"
        i += 1
    return text[:chars]


# Each just past 2,048 tokens as a parity prompt (2,141 as a chat, 2,220 as raw text): as long as
# the parity tests need and no longer, since every token of them is prefilled in several tests
DOC = long_document(9000)
DOC_B = long_document(9000, start=40)

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me three tips for learning Python.",
    "Explain what a hash table is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "List the planets of the solar system.",
]

RAW_PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\n\n# Compute the mean of a list\n",
]


def parity_prompts() -> list[dict]:
    prompts = [{"messages": [{"role": "user", "content": q}]} for q in CHAT_QUESTIONS]
    prompts += [{"prompt": p} for p in RAW_PROMPTS]
    prompts += [
        {"messages": [{"role": "user", "content": DOC + "\n\nSummarize the text above in one sentence."}]},
        {"messages": [{"role": "user", "content": DOC + "\n\nWhat is the first topic described above?"}]},
        {"prompt": DOC_B + "\nIn summary,"},
        {"prompt": DOC[:3000] + "\nThe most important point is"},
        {"messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name a prime number."},
            {"role": "assistant", "content": "7."},
            {"role": "user", "content": "Another one?"},
        ]},
        {"prompt": "Hello"},
    ]
    return prompts


def without_long_twins() -> list[int]:
    """Indices of every parity prompt but two of the three 2K-token documents: one long chat
    document and a 750-token one stay, so chunked prefill and multi-block KV still get crossed.
    For tests where each long prefill is costly; the parity tests of the engine run them all."""
    return [i for i, p in enumerate(parity_prompts())
            if not (p.get("prompt", "").startswith(DOC_B[:100]) or "first topic" in str(p))]
