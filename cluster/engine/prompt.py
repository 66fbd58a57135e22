"""PromptEncoder: text or chat messages -> token ids exactly as HF makes them, and the checks a
prompt must pass. The engine uses it, and so does the ingress, which tokenizes before it queues.

A prompt is checked once: `check` returns a CheckedPrompt, which the engine takes as it is (the
ingress of a server checks; the engine checks only ids that come unchecked, as offline callers'
may).

Text that cannot fit is refused before it is tokenized: no token of the vocabulary is longer than
`longest_token_chars` characters, so a text longer than that times the context is too long
whatever its tokens are (a 1 MB body costs a length check, not seconds of tokenizing)."""

from __future__ import annotations

import json

from cluster.engine.errors import InvalidRequestError
from cluster.engine.sampling_params import is_valid_unicode

CHAT_ROLES = ("system", "user", "assistant", "tool")


class CheckedPrompt(list):
    """Token ids that passed `PromptEncoder.check`: tokens of the model, and `room` more fit the
    context after them."""

    def __init__(self, token_ids, room: int):
        super().__init__(token_ids)
        self.room = room

    def __reduce__(self):  # it crosses Ray (ingress -> model server) pickled
        return type(self), (list(self), self.room)

    def has_room_for(self, max_tokens: int | None) -> bool:
        return max_tokens is None or max_tokens <= self.room


class PromptEncoder:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        longest_token_chars = max(map(len, tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = max_model_len * longest_token_chars

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
               tools: list[dict] | None = None) -> CheckedPrompt:
        """`tokenize`, then `check`."""
        return self.check(self.tokenize(prompt, messages, tools))

    def tokenize(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                 tools: list[dict] | None = None) -> list[int]:
        """`tokenizer(prompt)` for raw text, the chat template with a generation prompt for
        messages (and `tools`, for a template that reads them), or token ids as given. Text too
        long for the context is refused before it is tokenized."""
        if messages is not None:
            check_messages(messages)
            self._check_length("messages", sum(len(m["content"]) for m in messages))
            try:
                encoded = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
            except Exception as e:  # a template may raise on roles or orders it does not allow
                raise InvalidRequestError("messages", f"the chat template rejected them: {e}") from None
            token_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
        elif isinstance(prompt, str):
            check_prompt_text(prompt)
            self._check_length("prompt", len(prompt))
            token_ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, list):
            token_ids = prompt
        else:
            raise InvalidRequestError("prompt", "give a prompt string, token ids or messages")
        return token_ids

    def _check_length(self, field: str, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                field, f"has {num_chars} characters, more than a context of {self.max_model_len} tokens can hold")

    def check(self, token_ids: list[int], max_tokens: int | None = None) -> CheckedPrompt:
        """The ids are tokens of this model and fit the context with room for max_tokens more
        (None: at least one)."""
        if not token_ids:
            raise InvalidRequestError("prompt", "encodes to no tokens")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError("prompt_token_ids", f"must be integers in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(token_ids)} tokens; the context holds {self.max_model_len} "
                "including at least one generated token",
            )
        if max_tokens is not None and len(token_ids) + max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}: "
                f"{len(token_ids) + max_tokens} tokens do not fit the context of {self.max_model_len}",
            )
        return CheckedPrompt(token_ids, self.max_model_len - len(token_ids))


def check_prompt_text(prompt: str) -> None:
    """What a prompt string must be, whatever the model (its length is the model's to check)."""
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    if not is_valid_unicode(prompt):
        raise InvalidRequestError("prompt", "is not valid Unicode (it holds a lone surrogate)")


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string")
        if not is_valid_unicode(message["content"]):
            raise InvalidRequestError(f"messages[{i}].content", "is not valid Unicode (it holds a lone surrogate)")


def read_prompt_records(lines) -> list[dict]:
    """A prompts file (JSONL): each line {"prompt": "..."} or {"messages": [...]}, other keys kept.
    Raises ValueError naming the line."""
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts file line {number}: not JSON ({e})") from None
        if not isinstance(record, dict) or not ({"prompt", "messages"} & record.keys()):
            raise ValueError(f'prompts file line {number}: needs "prompt" or "messages"')
        records.append(record)
    if not records:
        raise ValueError("the prompts file has no prompts")
    return records
