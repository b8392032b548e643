"""A long-tailed document mix by a seeded rule (the ``--dynamic-ulysses`` benchmark and tests).

The rule: ``n`` documents; document ``i`` is ``longest`` tokens long when ``i % whole_every ==
whole_every - 1`` (a few documents of a whole sample), else ``round(exp(N(ln median, sigma)))``
clipped to ``[8, longest]`` (log-normal: most short, a tail of long ones), drawn from
``random.Random(seed)``.  Text: letters and spaces from the same generator (byte-level tokens, one
token a character); the preprocessor adds each document's end-of-document token.  Write it with
:func:`write_jsonl`, then ``ulysses-mcore preprocess --input FILE.jsonl --output-prefix PREFIX``.
"""

from __future__ import annotations

import json
import math
import random
from typing import List

ALPHABET = "abcdefghijklmnopqrstuvwxyz     "


def long_tailed_lengths(
    n: int, *, seed: int = 1, median: int = 200, sigma: float = 1.0, longest: int = 4096, whole_every: int = 25
) -> List[int]:
    """The documents' lengths in characters (tokens before the end-of-document token)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if whole_every and i % whole_every == whole_every - 1:
            out.append(longest)
        else:
            out.append(min(longest, max(8, round(math.exp(rng.gauss(math.log(median), sigma))))))
    return out


def write_jsonl(path: str, lengths: List[int], *, seed: int = 1) -> int:
    """One ``{"text": ...}`` line per document of ``lengths``; returns the characters written."""
    rng = random.Random(seed + 1)
    total = 0
    with open(path, "w") as f:
        for n in lengths:
            f.write(json.dumps({"text": "".join(rng.choice(ALPHABET) for _ in range(n))}) + "\n")
            total += n
    return total


__all__ = ["long_tailed_lengths", "write_jsonl"]
