"""lm-eval tasks in the evaluate step (issue 36): the shipped task file is checked (one line naming file and
field), and lm-eval runs offline, in-process, on the very model instance the evaluate step loaded."""

from __future__ import annotations

import json
import math

import pytest

from llmft.components.lib.evaluation.lm_eval_tasks import task_config
from llmft.components.lib.evaluation.task_eval import LM_EVAL_TASK_DIR, lm_eval_task_names, parse_tasks
from llmft.components.lib.evaluation.task_plan import resolve_task
from llmft.demo.sample_data.generate_facts import FACTS
from llmft.trainer.errors import ConfigError, DataError


def test_the_shipped_task_is_known_and_its_right_choices_state_the_facts():
    assert lm_eval_task_names() == ("velmora_mc",)
    assert parse_tasks("heldout,velmora_mc") == ("heldout", "velmora_mc")
    assert resolve_task("velmora_mc", "/nowhere", {}).metrics == ("acc",)
    config = task_config("velmora_mc")
    rows = [json.loads(line) for line in open(config["dataset_kwargs"]["data_files"]["test"])]
    assert len(rows) == len(FACTS)
    for row, (keyword, _answer, _questions) in zip(rows, FACTS, strict=True):
        assert keyword in row["choices"][row["answer"]]
        assert sum(keyword in choice for choice in row["choices"]) == 1


def _task_dir(tmp_path, yaml_text: str, data: str):
    (tmp_path / "t.yaml").write_text(yaml_text)
    (tmp_path / "t.jsonl").write_text(data)
    return tmp_path


ROW = '{"question": "q", "choices": ["a", "b"], "answer": 0}'
GOOD = (LM_EVAL_TASK_DIR / "velmora_mc.yaml").read_text().replace("velmora_mc", "t")


@pytest.mark.parametrize(
    ("yaml_text", "data", "where"),
    [
        (GOOD.replace("doc_to_text:", "doc_to_txt:"), ROW, "t.yaml: field `doc_to_text`"),
        (GOOD.replace("dataset_path: json", "dataset_path: cais/mmlu"), "", "t.yaml: fields `task`"),
        (GOOD + "process_docs: !function utils.process\n", ROW, "t.yaml: a `!function` tag runs Python code"),
        (GOOD, ROW + '\n{"question": "q", "choices": ["a"], "answer": 0}', "t.jsonl:2: field `choices`"),
        (GOOD, '{"question": "q", "choices": ["a", "b"], "answer": 2}', "t.jsonl:1: field `answer`"),
    ],
)  # fmt: skip
def test_a_task_file_with_a_wrong_schema_is_refused_in_one_line_naming_file_and_field(tmp_path, yaml_text, data, where):
    with pytest.raises(DataError) as caught:
        task_config("t", _task_dir(tmp_path, yaml_text, data))
    assert where in str(caught.value) and "\n" not in str(caught.value)


def test_the_plan_refuses_an_unknown_task_name():
    from plan_helpers import make_plan

    with pytest.raises(ConfigError, match="'hellaswag_typo' is not heldout"):
        make_plan(promote_eval_tasks="hellaswag_typo")
    assert make_plan(promote_eval_tasks="velmora_mc", promote_metric="velmora_mc.acc").registry.promote_metric == (
        "velmora_mc.acc"
    )


@pytest.mark.slow
def test_lm_eval_scores_the_loaded_model_offline_as_its_own_loglikelihoods_do(tiny_model_dir, monkeypatch):
    """lm-eval's accuracy on the model instance we hand it equals the accuracy computed here from the same
    model's log-likelihoods of each choice (lm-eval's multiple_choice: the highest sum of log p(" " + choice |
    question) wins): it scored our model, on our local file, with no hub (HF_DATASETS_OFFLINE=1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmft.components.lib.evaluation.lm_eval_tasks import run_tasks
    from llmft.trainer.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(tiny_model_dir), None)
    rows = [json.loads(line) for line in (LM_EVAL_TASK_DIR / "velmora_mc.jsonl").read_text().splitlines()]
    right = 0
    for row in rows:
        context = tokenizer(f"Question: {row['question']}\nAnswer:", add_special_tokens=False)["input_ids"]
        scores = []
        for choice in row["choices"]:
            whole = tokenizer(f"Question: {row['question']}\nAnswer: {choice}", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole])).logits.log_softmax(-1)[0]
            scores.append(sum(logits[i - 1, whole[i]].item() for i in range(len(context), len(whole))))
        right += max(range(len(scores)), key=scores.__getitem__) == row["answer"]
    result = run_tasks(
        resolve_task("velmora_mc", "/nowhere", {}),
        model,
        tokenizer,
        cache_dir="",
        num_fewshot=-1,
        limit=0,
        batch_size=8,
    )
    assert math.isclose(result["acc"], right / len(rows), abs_tol=1e-12)
