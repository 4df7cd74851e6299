"""Issue 34.5: the trainer's Katib lines begin with an RFC 3339 time. Katib's StdOut collector takes a
line's first word as the metric's timestamp and records the zero time for a line without one
(kubeflow/katib v0.19.0 pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go
89-99, mirrored here by collector_timestamp, a test's
mirror of upstream: llmft never reads a timestamp back); medianstop takes a trial's first
start_step metrics "ordered by time" (pkg/earlystopping/v1beta1/medianstop/service.py 208-212)."""

from __future__ import annotations

import datetime
import re

from llmft.katib.metrics import parse_metric_lines
from llmft.trainer.evaluate import katib_lines

ZERO_TIME = "0001-01-01T00:00:00Z"
"""The timestamp Katib's collector records for a metric line that does not begin with one (Go's
``time.Time{}.UTC().Format(time.RFC3339)``)."""
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})")


def collector_timestamp(line: str) -> str:
    """The timestamp Katib's collector gives the metrics of ``line``: its first word (up to the first
    space) when that parses as RFC 3339, else :data:`ZERO_TIME` (kubeflow/katib v0.19.0
    pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go 89-99)."""
    first, space, _ = line.partition(" ")
    return first if space and _RFC3339.fullmatch(first) else ZERO_TIME


def test_every_eval_line_carries_the_time_the_collector_reads():
    earlier = datetime.datetime.now(datetime.UTC)
    later = earlier + datetime.timedelta(seconds=90)
    text = katib_lines({"eval_loss": 1.25, "perplexity": 3.49}, earlier) + "\n"
    text += katib_lines({"eval_loss": 1.5, "perplexity": 4.48}, later)
    lines = text.splitlines()
    stamps = [collector_timestamp(line) for line in lines]
    assert ZERO_TIME not in stamps
    parsed = [datetime.datetime.fromisoformat(s.replace("Z", "+00:00")) for s in stamps]
    assert parsed == [earlier, earlier, later, later]  # microseconds kept: two evals a second apart stay ordered
    assert parse_metric_lines(text, ["eval_loss", "perplexity"]) == [
        ("eval_loss", 1.25), ("perplexity", 3.49), ("eval_loss", 1.5), ("perplexity", 4.48),
    ]  # fmt: skip


def test_the_collector_mirror_records_the_zero_time_without_a_leading_time():
    assert collector_timestamp("eval_loss=1.25") == ZERO_TIME  # what the trainer printed before
    assert collector_timestamp("step 3 eval_loss=1.25") == ZERO_TIME
    assert collector_timestamp("2026-01-02T03:04:05+02:00 eval_loss=1") == "2026-01-02T03:04:05+02:00"
