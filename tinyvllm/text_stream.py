"""Turning generated token ids into streamed text, with stop strings.

A stop string may arrive split over several tokens, so text that could still grow into one is held back
until it either completes the stop string (generation ends there, the stop string cut off) or cannot.
"""

from __future__ import annotations

from tinyvllm.tokenizer import IncrementalDetokenizer

# What a decode shows for bytes that are not (yet) a whole UTF-8 character.
INCOMPLETE = "\ufffd"


class TextStream:
    """Feeds token ids through an incremental detokenizer and watches for stop strings."""

    def __init__(self, tokenizer, prompt_ids, stop: list[str], skip_special_tokens: bool = True,
                 final_only: bool = False):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self._stop = list(stop)
        self.final_only = final_only  # the engine reports the request once, when it finishes
        # NOTE: when only the final text is wanted and no stop string has to be watched, the ids are
        # decoded once at the end instead of once per token: that is most of an engine step's host time
        # at large batch sizes.
        self._deferred = final_only and not self._stop
        self._pending = ""
        self.text = ""          # everything released so far
        self.stopped = False    # a stop string was found

    def push(self, token_id: int, check_stop: bool = True) -> str:
        """The text that is now safe to show after `token_id` (may be ""; always "" when deferred).
        check_stop False (the engine, before min_tokens): stop strings are not looked for in this piece."""
        if self._deferred:
            self._detok.append(token_id)
            return ""
        return self._release(self._detok.push(token_id), final=False, check_stop=check_stop)

    def advance(self, token_id: int, reason: str | None, check_stop: bool = True) -> tuple[str, str | None]:
        """One generated token: the text it releases, and why generation ends with it, or None. `reason` is the
        engine's own (a stop token or the length); a stop string found now makes it "stop". A stop token adds no
        text; at the end, whatever was held back is released (finish)."""
        new_text = "" if reason == "stop" else self.push(token_id, check_stop)
        if reason is None and self.stopped:
            reason = "stop"
        if reason is not None:
            new_text += self.finish()
        return new_text, reason

    def finish(self) -> str:
        """Whatever was held back, at the end of generation, less an incomplete UTF-8 character at its end.

        A generation cut short (max_tokens, a stop token) may end inside a multi-byte character, which the
        decode shows as U+FFFD. As while streaming (text ending in U+FFFD is held until it does not), that
        tail is never released: the text ends at the last whole character; the token ids keep every token.
        NOTE: the decoded text cannot tell an incomplete character from invalid bytes or a real U+FFFD, so
        any U+FFFD run at the very end is dropped (vLLM never releases such a tail either).
        """
        return self._release(self._detok.flush().rstrip(INCOMPLETE), final=True)

    def _release(self, piece: str, final: bool, check_stop: bool = True) -> str:
        if not self._stop:  # nothing is held back (every token of a stream without stop strings comes here)
            self.text += piece
            return piece
        if self.stopped:
            return ""
        self._pending += piece
        for stop in self._stop if check_stop else ():
            at = self._pending.find(stop)
            if at >= 0:
                self._pending = self._pending[:at]
                self.stopped = True
        hold = 0 if self.stopped or final or not check_stop else self._partial_stop_length()
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self.text += out
        return out

    def _partial_stop_length(self) -> int:
        """Length of the longest end of the pending text that is the beginning of a stop string."""
        if not self._stop:
            return 0
        for n in range(min(len(self._pending), max(map(len, self._stop), default=1) - 1), 0, -1):
            tail = self._pending[-n:]
            if any(stop.startswith(tail) for stop in self._stop):
                return n
        return 0
