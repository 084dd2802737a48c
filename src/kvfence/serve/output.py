"""Turns the backend's token chunks into client text: detokenize, cut at stop strings, logprobs.

Stop strings are matched on the detokenized text, across chunk boundaries.
Text that could still be the start of a stop string is held back until it is
known not to be, so a client never receives part of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.engine.messages import TokenChunk
from kvfence.model.tokenizer import StreamingDetokenizer, Tokenizer
from kvfence.serve.responses import Piece, TokenLogprob


@dataclass(slots=True)
class OutputAssembler:
    tokenizer: Tokenizer
    stops: tuple[str, ...]
    want_logprobs: bool
    text: str = ""
    emitted: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stopped_by_string: bool = False
    _detok: StreamingDetokenizer | None = None
    _pending: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._detok = self.tokenizer.detokenizer()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, chunk: TokenChunk) -> Piece:
        """Consume one chunk; after a stop-string match the rest of the chunk is dropped."""
        assert self._detok is not None and not self.done
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        for i, token in enumerate(chunk.token_ids):
            self.completion_tokens += 1
            self.text += self._detok.push(token)
            if self.want_logprobs and i < len(chunk.logprobs):
                self._pending.append(self._logprob(chunk.logprobs[i]))
            if self._cut_at_stop():
                return self._emit()
        if chunk.finish_reason is not None:
            self.text += self._detok.flush()
            if not self._cut_at_stop():
                self.finish_reason = chunk.finish_reason
        return self._emit()

    def _cut_at_stop(self) -> bool:
        # Text before `emitted` was checked when it was emitted, and every held-back
        # character lies after it, so a match cannot start before `emitted`.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.finish_reason = "stop"
        self.stopped_by_string = True
        return True

    def _emit(self) -> Piece:
        hold = 0 if self.done else max((len(s) for s in self.stops), default=1) - 1
        end = max(self.emitted, len(self.text) - hold)
        start = self.emitted
        self.emitted = end
        entries, self._pending = tuple(self._pending), []
        return Piece(self.text[start:end], entries, self.finish_reason, start)

    def _logprob(self, entry: tuple[tuple[int, float], ...]) -> TokenLogprob:
        """The engine's convention: (sampled id, logprob) first, then the top alternatives."""
        (token, logprob), *top = entry
        return TokenLogprob(
            token=self._piece(token),
            logprob=logprob,
            top=tuple((self._piece(t), lp) for t, lp in top),
        )

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)
