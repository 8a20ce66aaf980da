"""Committed token ids -> the text an OpenAI client receives, piece by piece.

OpenAI's API leaves a stop sequence out of the returned text, while specdec's engine stops at the token that
completes it (`specdec run` prints that token). So the text is cut before the first stop string, and while
streaming the last characters that could still begin one are held back until they cannot. Incomplete UTF-8
(a decoded text ending in U+FFFD) is held back too, as `specdec run` does.
"""

from __future__ import annotations

from typing import Any


class ClientText:
    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters that may begin a stop string
        self.ids: list[int] = []
        self.sent = 0  # characters already given to the client
        self.stopped = False

    def _cut(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _emit(self, upto: str) -> str:
        if len(upto) <= self.sent:
            return ""
        new, self.sent = upto[self.sent:], len(upto)
        return new

    def push(self, ids: list[int]) -> str:
        """New text after these ids ("" when nothing can be sent yet)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._cut(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._emit(text[: max(0, len(text) - self.hold)])

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        if self.stopped:
            return ""
        self.stopped = True
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._cut(text)
        return self._emit(text if cut is None else text[:cut])

    def full(self, ids: list[int]) -> str:
        """The whole text of a finished generation (non-streaming responses)."""
        return self.push(ids) + self.finish()
