"""Exact and near-duplicate lookup over prompt texts, and the filter for degenerate written prompts.

Two texts are compared after `normalize` (the benchmarks' fixed wrappers removed, Unicode NFKC,
lower case, every run of non-word characters one space): equal normalised texts are exact
duplicates; otherwise their word shingles (every run of `n` consecutive words; a text of fewer
than `n` words is one shingle) give the Jaccard similarity |A ∩ B| / |A ∪ B|, and at or above a
threshold they are near-duplicates. `ShingleIndex` keeps an inverted index (shingle -> texts that
hold it), so a lookup costs the postings of the query's own shingles, not a pass over the corpus:
thousands of prompts against the ~3.3k benchmark turns take seconds in pure Python.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

from drelay.data.benchmarks import HUMANEVAL_HEADER, MATH_SUFFIX

_NON_WORD = re.compile(r"[\W_]+")


def _words(text: str) -> str:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).lower()).strip()


# Fixed text every prompt of a set shares; left in, it would make any two maths prompts look alike.
WRAPPERS = tuple(_words(w) for w in (MATH_SUFFIX, HUMANEVAL_HEADER))


def normalize(text: str) -> str:
    text = f" {_words(text)} "
    for wrapper in WRAPPERS:
        text = text.replace(f" {wrapper} ", " ")
    return text.strip()


def shingles(normalized: str, n: int) -> frozenset[str]:
    """The word n-grams of a normalised text (the whole text when it has fewer than n words)."""
    words = normalized.split()
    if len(words) <= n:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i: i + n]) for i in range(len(words) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


@dataclass(frozen=True)
class Match:
    key: str  # the indexed text's key (e.g. a benchmark sample id)
    similarity: float  # Jaccard of the shingle sets; 1.0 for an exact (normalised) match
    exact: bool


class ShingleIndex:
    """Texts under keys, for exact and near-duplicate lookups (see the module docstring).

    A shingle held by more than `common` texts ("how many", "write a") is not used to find candidates
    (its postings would make every lookup touch most of the corpus); it still counts in the exact
    Jaccard of each candidate found through the query's rarer shingles. A query made only of common
    shingles is looked up through all of them."""

    def __init__(self, shingle_words: int, common: int = 256):
        self.n, self.common = shingle_words, common
        self._exact: dict[str, str] = {}  # normalised text -> key of the first text that had it
        self._postings: dict[str, list[int]] = {}  # shingle -> indexes into _keys
        self._keys: list[str] = []
        self._shingles: list[frozenset[str]] = []

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, text: str) -> None:
        norm = normalize(text)
        self._exact.setdefault(norm, key)
        grams = shingles(norm, self.n)
        index = len(self._keys)
        self._keys.append(key)
        self._shingles.append(grams)
        for gram in grams:
            self._postings.setdefault(gram, []).append(index)

    def find(self, text: str, threshold: float) -> Match | None:
        """The exact match of `text`, else its most similar indexed text when the Jaccard similarity
        is >= threshold, else None."""
        norm = normalize(text)
        if norm in self._exact:
            return Match(self._exact[norm], 1.0, True)
        grams = shingles(norm, self.n)
        postings = [self._postings[g] for g in grams if g in self._postings]
        rare = [p for p in postings if len(p) <= self.common] or postings
        n_common = len(postings) - len(rare)  # shared shingles a candidate may have beyond its rare count
        shared: Counter[int] = Counter()
        for p in rare:
            shared.update(p)
        # J >= t needs |A ∩ B| >= t |A| (as |B| >= |A ∩ B|), and |A ∩ B| <= rare count + n_common
        least = threshold * len(grams) - n_common
        best, best_index = threshold, -1
        for index in [i for i, count in shared.items() if count >= least]:
            other, count = self._shingles[index], shared[index]
            bound = count + n_common  # |A ∩ B| can be no larger
            if bound / (len(grams) + len(other) - bound) < best:
                continue
            inter = len(grams & other) if n_common else count
            similarity = inter / (len(grams) + len(other) - inter)
            if similarity > best or (similarity == best and (best_index < 0 or index < best_index)):
                best, best_index = similarity, index
        return Match(self._keys[best_index], best, False) if best_index >= 0 else None


# ---- degenerate written prompts --------------------------------------------------------------

MIN_WORDS = 4  # "Help me." is not a request worth distilling
MAX_REPEATED_TRIGRAMS = 0.3  # share of word 3-grams that repeat an earlier one (loops, stutter)
MIN_LETTER_SHARE = 0.5  # letters among the non-space characters (code requests stay well above)
CONTROL_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|user|>", "<|assistant|>", "\ufffd")
# A written request must look like its domain (a small target drifts off the system line's topic).
DOMAIN_WORDS = {
    "code": re.compile(r"\b(code|coding|program\w*|function|script|python|java\w*|c\+\+|c#|sql|html|css|rust|go|"
                       r"bash|algorithm|class|method|api|regex|array|list|string|loop|debug\w*|compile\w*|"
                       r"software|bug|variable|query|database)\b", re.IGNORECASE),
    "math": re.compile(r"\d|\b(how many|how much|calculate|solve|equation|sum|product|probability|percent\w*|"
                       r"area|volume|number|average|ratio|fraction)\b", re.IGNORECASE),
}


def degenerate_reason(text: str, domain: str = "") -> str | None:
    """Why a written prompt is unusable ("non_text", "too_short", "repetitive", "off_domain"), or None.
    ("unfinished", a request cut at the token budget, is decided by the writer, which knows.)"""
    if any(marker in text for marker in CONTROL_MARKERS):
        return "non_text"
    visible = [c for c in text if not c.isspace()]
    if sum(c.isalpha() for c in visible) < MIN_LETTER_SHARE * len(visible):
        return "non_text"
    words = normalize(text).split()
    if len(words) < MIN_WORDS:
        return "too_short"
    trigrams = [tuple(words[i: i + 3]) for i in range(len(words) - 2)]
    if len(trigrams) >= 8 and 1 - len(set(trigrams)) / len(trigrams) > MAX_REPEATED_TRIGRAMS:
        return "repetitive"
    if domain in DOMAIN_WORDS and not DOMAIN_WORDS[domain].search(text):
        return "off_domain"
    return None
