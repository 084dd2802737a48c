"""Random probe token ids inside the target's vocabulary.

The timing and noninterference probes draw token ids from a fixed range that suits real
vocabularies (tens of thousands of ids) and skips the low ids where tokenizers keep their
special tokens. A model with a smaller vocabulary than the range's top refuses ids past it
(kvfence answers 400 naming the id and the vocabulary), so the range is cut to what the
target states; a target that states nothing keeps the range.
"""

from __future__ import annotations

from kvfence.audit.base import Fact


def within_vocabulary(token_range: tuple[int, int], vocab: Fact) -> tuple[int, int]:
    """`token_range` ([low, high)) cut to [0, vocab): the top at the vocabulary, and the bottom
    lowered to half the vocabulary where the range would otherwise be empty or inverted."""
    size = vocab.as_int()
    low, high = token_range
    if size is None or size >= high:
        return token_range
    if size < 2:
        raise ValueError(f"the target states a vocabulary of {size} token(s) ({vocab.source})")
    return min(low, size // 2), size
