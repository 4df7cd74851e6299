"""The collector's filter: what it reads from trainer-like lines, and how a trial's value is chosen."""

from __future__ import annotations

import re

import pytest

from llmft.katib.metrics import METRICS_FILTER, parse_metric_lines, reduce_metric, summarize

NAMES = ["eval_loss", "perplexity"]


@pytest.mark.parametrize(
    "line, expected",
    [
        ("eval_loss=1.2345", [("eval_loss", 1.2345)]),
        ("step 40: eval_loss=2.5e-01 perplexity=1.284", [("eval_loss", 0.25), ("perplexity", 1.284)]),
        ("eval_loss = 3", [("eval_loss", 3.0)]),
        ("eval_loss=-0.5", [("eval_loss", -0.5)]),
        ("eval_loss=1.5, perplexity=4.48", [("eval_loss", 1.5), ("perplexity", 4.48)]),
        ("train_eval_loss=9.0 eval_loss=1.0", [("eval_loss", 1.0)]),  # a longer name is another metric
        ("eval_loss=nan perplexity=inf", []),  # non-finite values are not values
        ("loss=2.0 lr=2e-4 tokens/s=1200", []),  # metrics not asked for
        ("[rank0] 12:00:01 eval_loss=0.75", [("eval_loss", 0.75)]),
    ],
)
def test_filter_reads_trainer_lines(line, expected):
    assert parse_metric_lines(line, NAMES) == expected


def test_filter_is_plain_re2():
    # RE2 (Go) has no lookarounds or backreferences; ASCII classes keep \\w/\\s/\\d differences out.
    assert not re.search(r"\(\?<?[=!]|\\[1-9]|\\[wsdb]", METRICS_FILTER)
    assert re.compile(METRICS_FILTER).groups == 2


def test_strategies_choose_the_trial_value():
    observations = parse_metric_lines("eval_loss=2.0\neval_loss=1.5\neval_loss=1.7 perplexity=5.5\n", NAMES)
    assert summarize(observations, {"eval_loss": "min", "perplexity": "min"}) == {"eval_loss": 1.5, "perplexity": 5.5}
    assert reduce_metric([2.0, 1.5, 1.7], "latest") == 1.7
    assert reduce_metric([2.0, 1.5, 1.7], "max") == 2.0
    assert reduce_metric([], "min") is None
    with pytest.raises(ValueError, match="unknown metric strategy"):
        reduce_metric([1.0], "median")
