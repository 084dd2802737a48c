"""Random prompts for the prefix-sharing probe: token ids, or words where ids are refused.

Token ids are the default (nothing but A's warm-up can put them in a cache).
A text-only front end (sglang-router 0.3.2) refuses a token-id prompt with
HTTP 422; on that first answer the source switches to random words, sized
from one sample's `usage.prompt_tokens`, so a fleet behind such a router
still gets a verdict. A refusal it cannot size stays an error (inconclusive).
"""

from __future__ import annotations

import random
from typing import Any

from kvfence.audit.client import ProbeClient, ProbeResponse
from kvfence.audit.prompts import random_words

Pieces = list[Any]  # a prompt: token ids, or words in text mode
TOKEN_IDS_REFUSED = 422
TEXT_MARGIN = 0.9  # text prompts aim under the token budget: a word's count varies
SAMPLE_WORDS = 64


class RandomPrompts:
    def __init__(self, rng: random.Random, token_range: tuple[int, int]) -> None:
        self.rng = rng
        self.token_range = token_range
        self.tokens_per_word: float | None = None  # set when prompts are text
        self.decided = False

    def like(self, other: RandomPrompts) -> RandomPrompts:
        """This source in `other`'s mode (ids or text, already decided)."""
        self.tokens_per_word, self.decided = other.tokens_per_word, other.decided
        return self

    def make(self, n: int) -> Pieces:
        """`n` random tokens: ids, or words that come to about that many tokens."""
        if self.tokens_per_word is None:
            lo, hi = self.token_range
            return [self.rng.randrange(lo, hi) for _ in range(n)]
        k = max(1, int(n * TEXT_MARGIN / self.tokens_per_word))
        return random_words(self.rng, k).split()

    def payload(self, pieces: Pieces) -> str | list[int]:
        return " ".join(pieces) if self.tokens_per_word is not None else pieces

    def refused(self, first: ProbeResponse, client: ProbeClient) -> bool:
        """On the first answer only: ids refused, so switch to text (True: send it again)."""
        if self.decided:
            return False
        self.decided = True
        if first.status != TOKEN_IDS_REFUSED or self.tokens_per_word is not None:
            return False
        return self.to_text(client)

    def to_text(self, client: ProbeClient) -> bool:
        """Switch to words (a text-only route), sized from one sample; False: unsizeable."""
        self.decided = True
        if self.tokens_per_word is not None:
            return True
        r = client.completion(random_words(self.rng, SAMPLE_WORDS), max_tokens=1)
        if not r.ok or r.prompt_tokens is None or r.prompt_tokens < 1:
            return False
        self.tokens_per_word = r.prompt_tokens / SAMPLE_WORDS
        return True

    def described(self) -> str:
        if self.tokens_per_word is None:
            return "random token ids"
        return (
            f"random words, {self.tokens_per_word:.2f} tokens per word (usage.prompt_tokens): "
            f"the target refused token ids (HTTP {TOKEN_IDS_REFUSED})"
        )
