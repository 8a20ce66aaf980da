"""Committed token ids -> text, piece by piece: `specdec run`'s stream and `specdec serve`'s replies.

With stop strings (the server's case) the text is cut before the first one, as OpenAI's API leaves a stop
sequence out of the returned text while specdec's engine stops at the token that completes it (`specdec run`
prints that token and passes no stop strings here); while streaming, the last characters that could still
begin one are held back until they cannot.

Streaming decodes incrementally, as vLLM's detokenizer does: each step decodes only the ids after a prefix
offset (a few tokens of left context, so a tokenizer that merges spaces or bytes across tokens decodes them as
in the whole text) and appends what that window adds beyond its known part. A window whose text ends in an
incomplete UTF-8 sequence (U+FFFD) waits for the next ids. The cost per step is the window's, not the reply's.
A finished reply (`full`) decodes every id once, as `SpeculativeDecoder.generate` does for its text.
"""

from __future__ import annotations

from typing import Any


class StreamingText:
    def __init__(self, tokenizer: Any, stops: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops = [s for s in stops or [] if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters that may begin a stop string
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids before this are never decoded again
        self.read_offset = 0  # ids before this are in self.text
        self.text = ""  # the decoded reply so far
        self.sent = 0  # characters already given to the client
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _cut(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _emit(self, upto: str) -> str:
        if len(upto) <= self.sent:
            return ""
        new, self.sent = upto[self.sent:], len(upto)
        return new

    def _extend(self, final: bool) -> None:
        """Decode the ids after the prefix offset; append what they add beyond the part already read."""
        known = self._decode(self.ids[self.prefix_offset: self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.text += window[len(known):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def push(self, ids: list[int]) -> str:
        """New text after these ids ("" when nothing can be sent yet)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._extend(final=False)
        cut = self._cut(self.text)
        if cut is not None:
            self.stopped = True
            return self._emit(self.text[:cut])
        return self._emit(self.text[: max(0, len(self.text) - self.hold)])

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        if self.stopped:
            return ""
        self.stopped = True
        self._extend(final=True)
        cut = self._cut(self.text)
        return self._emit(self.text if cut is None else self.text[:cut])

    def full(self, ids: list[int]) -> str:
        """The whole text of a finished generation (non-streaming replies): one decode of every id."""
        text = self._decode(list(ids))
        cut = self._cut(text)
        return text if cut is None else text[:cut]
