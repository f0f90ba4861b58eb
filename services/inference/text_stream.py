"""Turn generated token bytes into text pieces that are safe to stream.

Two things must not reach the client early: half of a multi-byte UTF-8
character, and the beginning of a stop sequence that may still complete. This
class holds both back and releases the rest as soon as it is final.
"""

from __future__ import annotations

import codecs


class TextStream:
    def __init__(self, stop: list[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""  # decoded text not yet released
        self.text = ""  # everything released so far
        self.stopped = False

    def _holdback(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:n]):
                    best = max(best, n)
                    break
        return best

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that can be released now ('' if none)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            return self._release(cut, stopped=True)
        return self._release(len(self._pending) - self._holdback())

    def finish(self) -> str:
        """End of generation: release whatever is held back."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(len(self._pending))

    def _release(self, upto: int, stopped: bool = False) -> str:
        out, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += out
        if stopped:
            self.stopped = True
            self._pending = ""
        return out
