"""Incremental detokenization with stop strings.

tokenizers' DecodeStream does the hard part: it buffers tokens until they form whole UTF-8
characters, so a delta never carries half a character, and it is seeded with the prompt so the first
output token decodes with the right leading space. On top of it: stop strings, which may span tokens.
While stop strings are set, the last `longest stop - 1` characters are held back, because they may
be the start of a stop string that the next token completes; text once sent is never taken back.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] = (),
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        self._stop = list(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._num_sent = 0
        self.stopped = False

    def add(self, token_id: int) -> None:
        if self.stopped:
            return
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return
        # A stop string must end in the new piece, so the search starts where one could begin.
        search_from = max(0, len(self.text) - self._holdback)
        self.text += piece
        hits = [at for stop in self._stop if (at := self.text.find(stop, search_from)) != -1]
        if hits:
            self.text = self.text[: min(hits)]  # the earliest stop string wins; it is not shown
            self.stopped = True

    def take_new_text(self, final: bool = False) -> str:
        end = len(self.text) if (final or self.stopped) else max(self._num_sent, len(self.text) - self._holdback)
        new = self.text[self._num_sent : end]
        self._num_sent = end
        return new
