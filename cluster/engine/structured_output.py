"""Structured output: generation held to a JSON schema (or any JSON object) by xgrammar.

    add_request: the request's StructuredOutput -> a grammar compiled once per distinct spec
                 (cached) -> a GrammarMatcher per candidate (Request.grammar)
    each step:   the matchers of the requests that sample fill one shared token bitmask, a row
                 each (SamplingRow.allowed_tokens); the sampler applies them to the logits in one
                 batched call before it samples
    each token:  the matcher accepts it; once the grammar is complete the request stops ("stop")

A spec xgrammar cannot compile is the client's error (InvalidRequestError naming the field).
JSON is generated compact (no free whitespace between tokens): a small model given the choice
otherwise fills its budget with newlines.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache

from cluster.engine.errors import InvalidRequestError

KINDS = ("json_object", "json_schema")
XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ", re.MULTILINE)  # "[02:10:47] /project/cpp/x.cc:5088: "


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must be: any JSON object, or JSON valid under `json_schema` (its text)."""

    kind: str
    json_schema: str | None = None
    field: str = "response_format"  # where the client gave it, for errors

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.field}.type", f"must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if (self.kind == "json_schema") != (self.json_schema is not None):
            raise InvalidRequestError(f"{self.field}.json_schema", "a json_schema needs its schema (and only it has one)")


def _client_message(error: Exception) -> str:
    """xgrammar's message without the time and C++ source location it starts with."""
    return XGRAMMAR_LOCATION.sub("", str(error)).strip()


class Grammars:
    """Compiled grammars of one tokenizer and vocabulary, and the matchers built from them."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.compile = lru_cache(maxsize=cache_size)(self._compile)
        self._batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))

    def _compile(self, spec: StructuredOutput):
        try:
            schema = json.loads(spec.json_schema) if spec.kind == "json_schema" else {"type": "object"}
            return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        except (ValueError, RuntimeError) as e:  # bad JSON, or what xgrammar cannot compile
            raise InvalidRequestError(f"{spec.field}.json_schema",
                                      f"cannot be compiled to a grammar: {_client_message(e)}") from None

    def matcher(self, spec: StructuredOutput):
        return self._xgr.GrammarMatcher(self.compile(spec))

    def bitmasks(self, matchers: list):
        """One row per matcher: the tokens it allows next, as xgrammar's packed bitmask, filled by
        xgrammar's threads (the model is idle meanwhile: the engine fills before it executes)."""
        bitmask = self._xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return bitmask
