"""Bad evaluation inputs (issue 45's probe): each is one line naming the file (and line), exit 1 (DataError or
ConfigError), never an internal error, and nothing runs for seconds before it."""

from __future__ import annotations

import json
import os

import pytest

from llmft.components.lib.evaluation.lm_eval_tasks import task_config
from llmft.components.lib.evaluation.promote import read_evaluation
from llmft.components.lib.evaluation.questions import read_questions
from llmft.components.lib.evaluation.task_eval import parse_tasks
from llmft.trainer.errors import LlmftError

GOOD_ROW = '{"question": "Capital of Velmora?", "answer": "Quillport"}\n'


def _one_line(exc: LlmftError, *needles: str) -> None:
    message = str(exc)
    assert "\n" not in message and exc.exit_code == 1, message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ("Quelle est la capitale? é".encode("latin-1"), ["q.jsonl:1: not UTF-8 text"]),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00binary", ["q.jsonl:1: not UTF-8 text"]),
        (GOOD_ROW.encode("utf-16"), ["q.jsonl:1: UTF-16 text (byte order mark)"]),
        (GOOD_ROW.encode("utf-16-le"), ["q.jsonl:1: not UTF-8 text"]),
        (("[" * 100_000 + "]" * 100_000 + "\n").encode(), ["q.jsonl:1: the row is nested too deep"]),
        (b'{"question": "Q?", "answer": "A", "answer": "B"}\n', ["q.jsonl:1: key `answer` written twice"]),
        (b'{"question": "Q?", "answer": "!!!"}\n', ["q.jsonl:1: field `answer` '!!!' is only punctuation"]),
        (b'{"question": "Q?", "answer": []}\n', ["q.jsonl:1: field `answer` must be a non-empty string or a list"]),
        (json.dumps({"question": "Velmora " * 131072, "answer": "x"}).encode(),
         ["q.jsonl:1: field `question` is 1,048,576 characters", "raise finetune_max_length"]),
    ],
)  # fmt: skip
def test_a_bad_questions_file_is_one_line_naming_file_and_line(tmp_path, content, needles):
    path = tmp_path / "q.jsonl"
    path.write_bytes(content)
    with pytest.raises(LlmftError) as caught:
        read_questions(path, 16, max_length=2048)
    _one_line(caught.value, *needles)


def test_several_references_are_read_and_a_question_within_the_context_is_kept(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "' + "word " * 3000 + '", "answer": ["Quillport", "the port of Quill"]}\n')
    (question,) = read_questions(path, 16, max_length=2048)  # 15,000 characters <= 2048 x 8
    assert question.references == ("Quillport", "the port of Quill")
    with pytest.raises(LlmftError, match="more than the run's context"):
        read_questions(path, 16, max_length=1024)


def test_a_linked_fifo_or_folder_questions_file_is_named_for_what_it_is(tmp_path):
    real = tmp_path / "real.jsonl"
    real.write_text(GOOD_ROW)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    with pytest.raises(LlmftError) as caught:
        read_questions(link, 16)
    _one_line(caught.value, "link.jsonl: promote_eval_questions is a symlink", "give the file itself")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(LlmftError) as caught:
        read_questions(fifo, 16)  # never blocks on the FIFO
    _one_line(caught.value, "fifo.jsonl: promote_eval_questions is a FIFO", "not a regular file")
    with pytest.raises(LlmftError) as caught:
        read_questions(tmp_path, 16)
    _one_line(caught.value, "promote_eval_questions is a directory")
    with pytest.raises(LlmftError, match="not found"):
        read_questions(tmp_path / "missing.jsonl", 16)


def test_a_100_kb_eval_tasks_value_is_not_echoed_whole():
    with pytest.raises(LlmftError) as caught:
        parse_tasks("x" * 100_000)
    assert len(str(caught.value)) < 300 and "100,000 characters" in str(caught.value)


TASK = (
    "task: t\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: t.jsonl\noutput_type: multiple_choice\n"
    "doc_to_text: '{{question}}'\ndoc_to_choice: choices\ndoc_to_target: answer\n"
)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (TASK + "metric_list: [\n", "t.yaml: not valid YAML"),
        (TASK + "process_docs: !function utils.process_docs\n", "t.yaml: a `!function` tag runs Python code"),
        (TASK.encode("utf-8") + b"# caf\xe9\n", "t.yaml, line 10: the lm-eval task file is not UTF-8 text"),
        (TASK + "deep: " + "[" * 100 + "]" * 100 + "\n", "t.yaml, line 10: nested deeper than 64 levels"),
    ],
)  # fmt: skip
def test_a_bad_task_file_is_one_line_naming_it(tmp_path, text, needle):
    (tmp_path / "t.yaml").write_bytes(text if isinstance(text, bytes) else text.encode())
    (tmp_path / "t.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n')
    with pytest.raises(LlmftError) as caught:
        task_config("t", tmp_path)
    _one_line(caught.value, needle)
    with pytest.raises(LlmftError) as caught:  # the same file given by path, as a task from the volume
        task_config(str(tmp_path / "t.yaml"))
    _one_line(caught.value, needle)


def test_a_non_json_evaluation_is_one_line_in_promote(tmp_path):
    path = tmp_path / "evaluation.json"
    path.write_text('{"base": {"perplexity": 3.0}, "checkpoints": [')
    with pytest.raises(LlmftError) as caught:
        read_evaluation(path)
    _one_line(caught.value, f"{path}: not the JSON the evaluate step writes")


def test_a_truncated_weights_file_or_a_non_json_config_is_named(tmp_path):
    """The evaluate step's adapters and base go through the one check of damaged model files, before any load
    (llmft/trainer/model_dir.py check_model_files; the evaluator calls it for every adapter it applies)."""
    import torch
    from safetensors.torch import save_file

    from llmft.trainer.model_dir import check_model_files

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "notes.json").write_text("not JSON, and no loader reads it")  # not ours to judge
    save_file({"w": torch.zeros(64, 64)}, str(adapter / "adapter_model.safetensors"))
    check_model_files(adapter, what="adapter")
    data = (adapter / "adapter_model.safetensors").read_bytes()
    (adapter / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LlmftError) as caught:
        check_model_files(adapter, what="adapter")
    _one_line(caught.value, f"adapter {adapter}: {adapter}/adapter_model.safetensors: truncated", "weights are damaged")
    (adapter / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(LlmftError) as caught:
        check_model_files(adapter, what="adapter")
    _one_line(caught.value, "adapter_config.json: not JSON", "train it again")
