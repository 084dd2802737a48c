"""Token-exact prompts for probes, built over HTTP only.

With `/tokenize` the prompt is sent as token ids cut from the middle of a
tokenized filler text (so no BOS/special token is repeated inside it) and
its length is exact by construction. Without it, a one-token filler word is
calibrated from `usage.prompt_tokens` (two short requests: slope and offset)
and the response's own `usage.prompt_tokens` confirms each accepted prompt.

Sentinels and filler words come from the audit's seeded RNG.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from kvfence.audit.client import ProbeClient

# Plain lowercase words: tenant B's text never contains a sentinel's capitals and digits.
WORDS = tuple(
    [
        "river",
        "stone",
        "cloud",
        "paper",
        "garden",
        "lamp",
        "window",
        "orange",
        "forest",
        "table",
        "winter",
        "candle",
        "bridge",
        "meadow",
        "silver",
        "harbor",
        "valley",
        "pencil",
        "mountain",
        "basket",
        "thunder",
        "ribbon",
        "island",
        "copper",
        "feather",
        "lantern",
        "marble",
        "orchard",
        "pepper",
        "saddle",
    ]
)


# Candidate filler units for text prompts, tried in order (one token each in most BPEs).
FILLER_UNITS = (" a", " the", " x", " 0", " river")


def random_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_sentinel(rng: random.Random) -> str:
    """A unique marker: 'KVF' + 3 groups of 4 capitals/digits (e.g. KVF-Q7ZP-3MXA-K9TD)."""
    alphabet = string.ascii_uppercase + string.digits
    groups = ["".join(rng.choice(alphabet) for _ in range(4)) for _ in range(3)]
    return "KVF-" + "-".join(groups)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A probe prompt. `tokens` is the intended length; `exact` says whether it is guaranteed."""

    payload: str | list[int]
    tokens: int
    text: str  # what the prompt says (for echo and leak checks); "" if unknown
    exact: bool


class PromptMaker:
    """Builds prompts of a chosen token length for one target (costs a few requests once)."""

    def __init__(self, client: ProbeClient, rng: random.Random, *, use_tokenize: bool) -> None:
        self.client = client
        self.rng = rng
        self.use_tokenize = use_tokenize
        self._filler_ids: list[int] | None = None
        self._calibration: tuple[int, int] | None = None  # (tokens per word, offset)
        self._word = " " + WORDS[0]

    # -- token ids via /tokenize -------------------------------------------------

    def content_ids(self, text: str) -> list[int] | None:
        """`text`'s token ids without any special prefix the tokenizer adds (e.g. BOS).

        Tokenizing `text` and `text + text`: a prefix token shows up once in
        both, so the doubled text is one shorter than twice the single one.
        """
        one = self.client.tokenize(text)
        two = self.client.tokenize(text + text)
        if not one or not two:
            return None
        extra = 2 * len(one) - len(two)
        return one[extra:] if 0 <= extra < len(one) else one

    def filler_ids(self) -> list[int] | None:
        if self._filler_ids is None and self.use_tokenize:
            self._filler_ids = self.content_ids(" " + random_words(self.rng, 120))
        return self._filler_ids

    def ids(self, n: int, head: str = "", repeat_head: bool = False) -> Prompt | None:
        """Exactly `n` token ids: `head`'s tokens (repeated to fill when asked) then filler."""
        filler = self.filler_ids()
        if filler is None:
            return None
        head_ids: list[int] = []
        if head:
            got = self.content_ids(" " + head)
            if not got:
                return None
            head_ids = got
        body: list[int] = head_ids[:n]
        while repeat_head and head_ids and len(body) < n:
            body.extend(head_ids[: n - len(body)])
        while len(body) < n:
            body.extend(filler[: n - len(body)])
        text = self.client.detokenize(body) or ""
        return Prompt(body, n, text, exact=True)

    # -- text calibrated from usage.prompt_tokens ----------------------------------

    def calibrate(self) -> tuple[int, int] | None:
        """(tokens per filler word, constant offset) from probes; None if nothing is linear.

        Tries a few filler units and keeps the first that costs exactly one
        token per repetition (then lengths are exact), else the cheapest.
        """
        if self._calibration is not None:
            return self._calibration
        best: tuple[int, int, str] | None = None
        for unit in FILLER_UNITS:
            counts = []
            for k in (8, 16):
                r = self.client.completion(unit.strip() + unit * (k - 1), max_tokens=1)
                if r.prompt_tokens is None:
                    break
                counts.append(r.prompt_tokens)
            if len(counts) < 2:
                continue
            per_word = (counts[1] - counts[0]) // 8
            if per_word < 1 or counts[1] - counts[0] != 8 * per_word:
                continue
            if best is None or per_word < best[0]:
                best = (per_word, counts[0] - 8 * per_word, unit)
            if per_word == 1:
                break
        if best is None:
            return None
        self._calibration = (best[0], best[1])
        self._word = best[2]
        return self._calibration

    def text(self, n: int, head: str = "", repeat_head: bool = False) -> Prompt | None:
        """A text prompt of about `n` tokens (exact when the calibration is one token per word)."""
        cal = self.calibrate()
        if cal is None:
            return None
        per_word, offset = cal
        head_tokens = 0
        if head:
            r = self.client.completion(head, max_tokens=1)
            if r.prompt_tokens is None:
                return None
            head_tokens = r.prompt_tokens - offset
        if repeat_head and head_tokens > 0:
            reps = max(1, (n - offset) // head_tokens)
            body = " ".join([head] * reps)
            return Prompt(body, offset + reps * head_tokens, body, exact=False)
        words = max(0, (n - offset - head_tokens) // per_word)
        body = (head + " " if head else "") + (self._word * words).strip()
        exact = per_word == 1
        return Prompt(body, offset + head_tokens + words * per_word, body, exact)

    def grow(self, p: Prompt, n_tokens: int) -> Prompt | None:
        """`p` with about `n_tokens` more filler tokens appended (calibrated text only)."""
        cal = self.calibrate()
        if cal is None or not isinstance(p.payload, str):
            return None
        words = max(1, -(-n_tokens // cal[0]))
        body = p.payload + self._word * words
        return Prompt(body, p.tokens + words * cal[0], body, exact=False)

    def make(self, n: int, head: str = "", repeat_head: bool = False) -> Prompt | None:
        """Token ids when the server tokenizes for us, else calibrated text; None if neither."""
        if self.use_tokenize:
            p = self.ids(n, head, repeat_head)
            if p is not None:
                return p
        return self.text(n, head, repeat_head)
