"""The one answer scorer (llmft/components/lib/evaluation/scoring.py) against the official SQuAD v1.1 script, run
itself (tests/reference/squad_v1_1_compute_score.py, verbatim from huggingface/evaluate v0.4.6), plus the
Unicode extensions, word-boundary `contains` and several references per question (issue 43 item 3)."""

from __future__ import annotations

import hashlib
import importlib.util
import math
from pathlib import Path

import pytest

from llmft.components.lib.evaluation.scoring import contains, normalize_answer, score_answer, token_f1

REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "squad_v1_1_compute_score.py"
UPSTREAM_BLOB = "e60acfd1044319e43a59ffe8db75e63b68785ba7"  # metrics/squad/compute_score.py at evaluate v0.4.6


def _squad():
    data = REFERENCE.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert blob == UPSTREAM_BLOB, f"{REFERENCE} is not the upstream file byte for byte"
    spec = importlib.util.spec_from_file_location("squad_v1_1_compute_score", REFERENCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (answer, references): the issue's crafted pairs and more; every one ASCII, where the Unicode extensions are inert
PAIRS = [
    ("the Eiffel Tower", ["Eiffel Tower"]),
    ("U.S.A.", ["USA"]),
    ("don't", ["dont"]),
    ("1,742", ["1742"]),
    ("It has 14 days", ["4"]),
    ("I don't know", ["no"]),
    ("plump", ["plum"]),
    ("Paris.", ["paris"]),
    ("The capital is Paris", ["Paris"]),
    ("Lyon", ["Paris"]),
    ("", ["Paris"]),
    ("Paris", [""]),
    ("", [""]),
    ("...", ["!!!"]),
    ("the the the", ["the"]),
    ("a cat and a dog", ["the cat", "a dog"]),
    ("cat cat cat", ["cat"]),
    ("cat", ["cat cat cat"]),
    ("red red blue", ["red blue blue"]),
    ("New York City", ["New York", "NYC", "the city of New York"]),
    ("  spaced   out\ttext\n", ["spaced out text"]),
    ("Mount Everest, 8,849 m", ["8849 m", "Everest"]),
    ("An apple a day", ["apple day"]),
    ("theatre", ["the atre"]),
    ("anthem", ["an them"]),
    ("$100", ["100"]),
    ("e-mail", ["email", "e mail"]),
    ("(b) the second one", ["b"]),
    ("Answer: 42", ["42"]),
    ("forty-two", ["forty two"]),
    ("The Quillport harbour", ["Quillport"]),
    ("the silver crown", ["The Silver Crown."]),
    ("THE SILVER CROWN", ["silver crown", "crown"]),
    ("C++ and C#", ["C", "c c"]),
    ("x_y", ["x y", "xy"]),
    ("Velmora's capital is Quillport", ["Quillport", "Velmoras capital"]),
]


def test_the_reference_file_is_upstreams_byte_for_byte():
    assert _squad().normalize_answer("The  U.S.A.!") == "usa"


@pytest.mark.parametrize(("answer", "references"), PAIRS)
def test_exact_match_and_token_f1_equal_the_squad_v1_1_script(answer, references):
    squad = _squad()
    ours = score_answer(answer, references)
    em = squad.metric_max_over_ground_truths(squad.exact_match_score, answer, references)
    f1 = squad.metric_max_over_ground_truths(squad.f1_score, answer, references)
    assert ours["exact_match"] == float(em)
    assert math.isclose(ours["token_f1"], f1, rel_tol=0.0, abs_tol=1e-15)  # the same float operations, in order
    assert all(normalize_answer(text) == squad.normalize_answer(text) for text in [answer, *references])


def test_at_least_30_pairs_and_the_issues_differences_are_gone():
    assert len(PAIRS) >= 30
    assert score_answer("the Eiffel Tower", "Eiffel Tower")["exact_match"] == 1.0
    assert score_answer("U.S.A.", "USA")["exact_match"] == 1.0 and score_answer("1,742", "1742")["exact_match"] == 1.0


def test_contains_matches_whole_words_only():
    assert contains("It has 14 days", "4") == 0.0
    assert contains("I don't know", "no") == 0.0
    assert contains("plump", "plum") == 0.0
    assert contains("The capital is Paris.", "paris") == 1.0
    assert contains("It is in New York City", "new york") == 1.0
    assert contains("York, New", "new york") == 0.0, "in order and adjacent"
    assert contains("14 days", "14") == 1.0


def test_several_references_take_the_best_of_each_metric():
    scores = score_answer("NYC", ["New York City", "nyc"])
    assert scores == {"exact_match": 1.0, "contains": 1.0, "token_f1": 1.0}
    mixed = score_answer("the big apple city", ["Big Apple", "apple city of dreams"])
    assert mixed["contains"] == 1.0 and mixed["exact_match"] == 0.0
    # token F1 per reference: "big apple city" vs "big apple": P 2/3 R 1 -> 0.8; vs "apple city of dreams": 0.571
    assert mixed["token_f1"] == pytest.approx(0.8, abs=1e-15)
    with pytest.raises(ValueError):
        score_answer("x", [])


def test_token_f1_counts_a_multiset_not_a_set():
    # "cat cat dog" vs "cat dog dog": common multiset {cat: 1, dog: 1} = 2; P = R = 2/3 -> F1 2/3 (a set would say 1)
    assert token_f1("cat cat dog", "cat dog dog") == pytest.approx(2 / 3, abs=1e-15)
    assert token_f1("cat cat cat", "cat") == pytest.approx(0.5, abs=1e-15)


def test_a_punctuation_only_reference_matches_nothing_but_an_equally_empty_answer():
    assert score_answer("Paris", "!!!") == {"exact_match": 0.0, "contains": 0.0, "token_f1": 0.0}
    assert score_answer("...", "!!!")["contains"] == 0.0 and score_answer("...", "!!!")["token_f1"] == 0.0
    assert score_answer("...", "!!!")["exact_match"] == 1.0, "SQuAD: both normalise to ''"


def test_unicode_text_is_normalised_not_mangled():
    assert normalize_answer("हिन्दी") == "हिन्दी", "combining marks are not punctuation"
    assert score_answer("cafe\u0301", "caf\u00e9")["exact_match"] == 1.0, "NFD and NFC compare equal"
    assert score_answer("«Paris»", "Paris")["exact_match"] == 1.0, "Unicode punctuation (Pi/Pf) is deleted"
    assert score_answer("\uff11\uff12", "12")["exact_match"] == 1.0, "full-width digits (NFKC)"
    assert normalize_answer("¿Qué?") == "qué"
