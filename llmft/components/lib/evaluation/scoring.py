"""The one scorer of a generated answer against its references: evaluation.json, the report, the run summary and
Langfuse's item scores all read these functions (docs/evaluation.md, "Metrics", says the same in words).

* :func:`normalize_answer` is the SQuAD v1.1 normaliser (the official ``evaluate-v1.1.py``, as shipped in
  huggingface/evaluate ``metrics/squad/compute_score.py``: lowercase, delete ``string.punctuation``, remove the
  articles a/an/the, collapse whitespace) with two Unicode extensions that change nothing on ASCII text: the text
  is NFKC-normalised first (NFC and NFD forms of "café", full-width digits and ligatures compare equal), and every
  character of a Unicode punctuation category (``P*``: « » “ ” ¿ 、 。) is deleted as well. Combining marks are
  letters' parts, not punctuation: 'हिन्दी' keeps them.
* :func:`exact_match` and :func:`token_f1` are SQuAD's ``exact_match_score`` and ``f1_score`` (F1 over the
  multiset of normalised tokens; 0 when no token is shared, so an empty answer or reference scores 0).
* :func:`contains` is 1 when the normalised reference appears in the normalised answer as whole words (a
  contiguous run of its tokens): "It has 14 days" does not contain "4", "plump" does not contain "plum".
* Several references per question: each metric is the maximum over them (SQuAD's
  ``metric_max_over_ground_truths``).
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Sequence

METRICS = ("exact_match", "contains", "token_f1")
"""Every answer score, in the order the tables show them."""
_ASCII_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def _is_punctuation(char: str) -> bool:
    return char in _ASCII_PUNCTUATION or unicodedata.category(char).startswith("P")


def normalize_answer(text: str) -> str:
    """NFKC, lowercase, punctuation deleted, articles removed, whitespace collapsed (SQuAD v1.1 + Unicode)."""
    lowered = unicodedata.normalize("NFKC", text).lower()
    kept = "".join(char for char in lowered if not _is_punctuation(char))
    return " ".join(_ARTICLES.sub(" ", kept).split())


def exact_match(answer: str, reference: str) -> float:
    return float(normalize_answer(answer) == normalize_answer(reference))


def token_f1(answer: str, reference: str) -> float:
    """SQuAD's token F1: overlap of the two multisets of normalised tokens."""
    got, want = normalize_answer(answer).split(), normalize_answer(reference).split()
    common = sum((Counter(got) & Counter(want)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


def contains(answer: str, reference: str) -> float:
    """1.0 when the reference's normalised tokens appear, in order and adjacent, among the answer's."""
    got, want = normalize_answer(answer).split(), normalize_answer(reference).split()
    if not want:
        return 0.0
    width = len(want)
    return float(any(got[i : i + width] == want for i in range(len(got) - width + 1)))


_SCORERS = {"exact_match": exact_match, "contains": contains, "token_f1": token_f1}


def score_answer(answer: str, references: str | Sequence[str]) -> dict[str, float]:
    """Every metric of one answer: the maximum over its references (one string is one reference)."""
    refs = [references] if isinstance(references, str) else list(references)
    if not refs:
        raise ValueError("score_answer needs at least one reference")
    return {name: max(score(answer, ref) for ref in refs) for name, score in _SCORERS.items()}


def mean_scores(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over the answers (empty without answers)."""
    return {m: sum(r[m] for r in rows) / len(rows) for m in METRICS} if rows else {}


def scorable(reference: str) -> bool:
    """False for a reference that normalises to nothing (only punctuation and articles): no answer can match it,
    so the plan refuses it in a questions file."""
    return bool(normalize_answer(reference))
