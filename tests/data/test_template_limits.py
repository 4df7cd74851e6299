"""A chat template that never ends, or writes without end, is one line naming it; a SIGTERM while it runs stays
a stop (issue 35 item 4)."""

from __future__ import annotations

import shutil
import signal
import threading

import pytest

from llmft.commands.data import _stop_cleanly_on_sigterm
from llmft.trainer.data import limits
from llmft.trainer.data.template_limits import TemplateTooSlow
from llmft.trainer.data.tokenize import tokenize_dataset
from llmft.trainer.errors import EXIT_PREEMPTED, DataError, SignalStop
from llmft.trainer.failures import describe_failure

NEVER_ENDS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
WRITES_10M = "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
SLOW_ON_ONE_ROW = (
    "{% for m in messages %}{% if 'two plus two' in m.content %}" + NEVER_ENDS + "{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture
def model_with_template(tiny_model_dir, tmp_path):
    def make(template: str):
        model = tmp_path / "model"
        shutil.copytree(tiny_model_dir, model)
        (model / "chat_template.jinja").write_text(template)
        return model

    return make


@pytest.fixture
def fast_bound(monkeypatch):
    monkeypatch.setattr(limits, "MAX_TEMPLATE_SECONDS", 0.5)


def tokenize(prepared, model, tmp_path, **kw):
    return tokenize_dataset(prepared, model, tmp_path / "out", max_length=256, num_proc=1, **kw)


def test_a_template_that_never_ends_is_one_line_naming_it(model_with_template, prepared_sample, tmp_path, fast_bound):
    with pytest.raises(TemplateTooSlow) as error:
        tokenize(prepared_sample, model_with_template(NEVER_ENDS), tmp_path)
    message = str(error.value)
    assert message.startswith("the tokenizer's chat template took more than 0.5 s") and "Fix the template" in message
    assert "\n" not in message and describe_failure(error.value)[0] == 1
    assert not (tmp_path / "out").exists()


def test_a_chat_template_file_is_named(model_with_template, prepared_sample, tmp_path, fast_bound):
    model = model_with_template("")
    (model / "chat_template.jinja").unlink()
    slow = tmp_path / "slow.jinja"
    slow.write_text(NEVER_ENDS)
    with pytest.raises(TemplateTooSlow, match=r"--chat-template \(fallback:slow.jinja\) took more than 0.5 s"):
        tokenize(prepared_sample, model, tmp_path, chat_template=str(slow))


def test_a_template_that_writes_without_end_is_stopped(model_with_template, prepared_sample, tmp_path):
    with pytest.raises(TemplateTooSlow, match=f"wrote more than {limits.MAX_PROBE_RENDER_CHARS:,} characters"):
        tokenize(prepared_sample, model_with_template(WRITES_10M), tmp_path)


def test_a_row_that_makes_the_template_loop_names_the_row(model_with_template, prepared_sample, tmp_path, fast_bound):
    assert "two plus two" in (prepared_sample / "train.jsonl").read_text() + (prepared_sample / "val.jsonl").read_text()
    with pytest.raises(TemplateTooSlow, match=r"the chat template took more than 0.5 s .*\(at \w+\.jsonl:\d+"):
        tokenize(prepared_sample, model_with_template(SLOW_ON_ONE_ROW), tmp_path)


def test_sigterm_during_the_template_check_is_a_stop_not_a_template_error(
    model_with_template, prepared_sample, tmp_path, monkeypatch
):
    monkeypatch.setattr(limits, "MAX_TEMPLATE_SECONDS", 60.0)
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGTERM,))
    try:
        _stop_cleanly_on_sigterm()
        model = model_with_template(NEVER_ENDS)
        timer.start()
        with pytest.raises(SignalStop) as stop:
            tokenize(prepared_sample, model, tmp_path)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
    code, message = describe_failure(stop.value)
    assert code == EXIT_PREEMPTED and message.startswith("stopped by SIGTERM; nothing was written")


def test_a_split_file_linked_elsewhere_is_not_tokenized(prepared_sample, tiny_model_dir, tmp_path):
    """Issue 35 (Low): a prepared train.jsonl that is a link to an outside file was followed and tokenized."""
    prepared = tmp_path / "prepared"
    shutil.copytree(prepared_sample, prepared)
    outside = tmp_path / "outside.jsonl"
    (prepared / "train.jsonl").rename(outside)
    (prepared / "train.jsonl").symlink_to(outside)
    with pytest.raises(DataError, match=r"train.jsonl: is a symlink; tokenize reads only the files") as error:
        tokenize(prepared, tiny_model_dir, tmp_path)
    assert str(outside) not in str(error.value) and not (tmp_path / "out").exists()
