"""Langfuse as the place where adapters are compared: the evaluate and register components (their
real KFP functions) on a run of the tiny model, with the real Langfuse SDK talking to a recording
fake server (tests/langfuse_fake.py) and a real MLflow registry (SQLite), whose champion is an
earlier adapter promoted on the same volume."""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import signal

import pytest
import yaml
from kfp import dsl
from langfuse_fake import FakeLangfuse
from plan_helpers import make_plan

from llmft.components.lib.contracts.schema import write_plan
from llmft.components.lib.evaluation.comparison import compare_in_langfuse, dataset_name
from llmft.components.lib.evaluation.promote import promoted_destination
from llmft.components.lib.registry.mlflow_registry import (
    PROMOTED_PATH_TAG,
    Lineage,
    register_adapter,
    registration_from_run,
)

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-chat"
RUN_ID = "run-b"
PROMPTS = 6


def conversations(n: int = 96) -> list[dict]:
    """Short-answer sums (exact match is scored) and long-answer explanations (it is not)."""
    rng, rows = random.Random(5), []
    for i in range(n):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        if i % 2:
            answer = f"The sum of {a} and {b} is {a + b}, because adding {b} to {a} counts {b} steps past {a}."
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": f"Explain {a}+{b}"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
        else:
            rows.append(
                {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
            )
    return rows


def train(overrides: list[str]) -> int:
    from llmft.trainer.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return main(overrides)
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def langfuse():
    with FakeLangfuse() as server:
        yield server


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_model_dir, langfuse):
    """A volume with a prepared + tokenized dataset, this run's checkpoints (trained with Langfuse on),
    and the previous champion: an adapter promoted by run-a, registered in MLflow with the alias."""
    from llmft.trainer.data.prepare import prepare_dataset
    from llmft.trainer.data.tokenize import tokenize_dataset

    root = tmp_path_factory.mktemp("volume")
    env = langfuse.env()
    patch = pytest.MonkeyPatch()
    for key, value in env.items():
        patch.setenv(key, value)
    plan = make_plan(
        run_id=RUN_ID,
        base_model=str(tiny_model_dir),
        volume_path=str(root),
        mlflow_tracking_uri=f"sqlite:///{root / 'mlflow.db'}",
        mlflow_model_name=MODEL_NAME,
    )
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    prepare_dataset(str(raw), plan.data.prepared_dir, val_fraction=0.25, seed=1)
    tokenized = root / "tokenized" / "k"
    tokenize_dataset(plan.data.prepared_dir, str(tiny_model_dir), tokenized, max_length=128, pack=True, num_proc=1)
    run_dir = plan.trainer.run_dir
    common = [f"model.name_or_path={tiny_model_dir}", f"data={tokenized}", "lora.r=4", "lora.alpha=8", "optim.lr=5e-3"]
    common += ["batch.global_sequences=4", "batch.micro_sequences=2", "observe.progress_bar=false", "seed=3"]
    assert train([*common, f"output_dir={run_dir}", "max_steps=4", "save_every=2", "eval_every=2"]) == 0

    previous = promoted_destination(str(root), MODEL_NAME, "run-a")  # run-a's adapter: this run's step-2 weights
    shutil.copytree(f"{run_dir}/checkpoints/step-2", previous)
    lineage = Lineage(pipeline_run_id="run-a", task="register-model", dataset_hash="h", base_model=str(tiny_model_dir))
    earlier = {
        "base": {"eval_loss": 9.0, "perplexity": 1e4},
        "checkpoints": [{"name": "step-2", "step": 2, "eval_loss": 9.0, "perplexity": 1e4}],
    }
    reg = registration_from_run(
        promoted_dir=previous, evaluation=earlier, training_manifest={}, model_name=MODEL_NAME,
        experiment="llmft", lineage=lineage,
    )  # fmt: skip
    champion = register_adapter(reg, tracking_uri=plan.registry.tracking_uri)
    assert champion["is_champion"] and champion["version"] == "1"
    yield {"root": root, "plan": plan, "tokenized": tokenized, "run_dir": run_dir, "previous": previous}
    patch.undo()


def artifact(kind, root, name: str, **metadata):
    made = kind(uri=str(root / "artifacts" / name), metadata=metadata)
    return made


def test_evaluate_compares_base_champion_and_new_adapter_and_register_links_both_ways(
    world, langfuse, tiny_model_dir, base_loads
):
    import torch
    from mlflow import MlflowClient

    from llmft.components.evaluate import evaluate_perplexity
    from llmft.components.lib.evaluation.generations import generate_answers, generation_tokenizer, prompt_set
    from llmft.components.register import register_model
    from llmft.components.serving_form import choose_serving_form
    from llmft.trainer.langfuse_sink import read_run_record

    root, plan = world["root"], world["plan"]
    plan_artifact = artifact(dsl.Artifact, root, "plan")
    write_plan(plan, plan_artifact.path)
    tokenized = artifact(dsl.Dataset, root, "tokenized", path=str(world["tokenized"]), cache_key="k")
    run = artifact(dsl.Model, root, "run", path=world["run_dir"])
    evaluation = artifact(dsl.Artifact, root, "evaluation")
    report, metrics = artifact(dsl.HTML, root, "report.html"), artifact(dsl.Metrics, root, "metrics")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            "llmft.components.lib.evaluation.generations.PROMPT_SET_SIZE", PROMPTS
        )  # the defaults: 16 and 128
        patch.setattr("llmft.components.lib.evaluation.generations.MAX_NEW_TOKENS", 8)
        evaluate_perplexity.python_func(
            plan=plan_artifact, tokenized=tokenized, run=run, evaluation=evaluation, report=report, metrics=metrics
        )
    assert base_loads == [str(tiny_model_dir)]  # base, every checkpoint, champion and new adapter: one load of the base
    result = json.loads((root / "artifacts" / "evaluation" / "evaluation.json").read_text())
    section = result["langfuse"]
    training = read_run_record(world["run_dir"])
    assert section["training"] == training and section["champion"]["version"] == "1"
    new = result["best"]
    assert set(section["runs"]) == {"base", "champion-v1", new}

    # the prompt set: the first validation conversations, as items of one dataset per registered model
    prompts = prompt_set(plan.data.prepared_dir, PROMPTS)
    items = langfuse.items_of(dataset_name(MODEL_NAME))
    assert [i["input"]["messages"] for i in items] == [p.messages for p in prompts]
    assert [i["expectedOutput"] for i in items] == [p.reference for p in prompts]

    # one dataset run per model: every item answered, the answer the model gives (greedy)
    runs = {}
    for span in langfuse.spans:
        if span.name == "experiment-item-run":
            runs.setdefault(span.attr("langfuse.experiment.name"), {})[span.attr("langfuse.experiment.item.id")] = span
    assert set(runs) == {f"{RUN_ID}/{label}" for label in section["runs"]}
    assert all(set(r) == {i["id"] for i in items} for r in runs.values())
    # the new adapter's answers, from a fresh load of the base (the step kept one base for all models)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model = PeftModel.from_pretrained(base, f"{world['run_dir']}/checkpoints/{new}").eval()
    manifest = json.loads((world["tokenized"] / "manifest.json").read_text())
    tokenizer = generation_tokenizer(str(tiny_model_dir), manifest)
    expected = generate_answers(model, tokenizer, prompts, max_new_tokens=8, end_of_turn=manifest["end_of_turn"])
    recorded = runs[f"{RUN_ID}/{new}"]
    assert [recorded[i["id"]].output for i in items] == expected

    # scores: exact match per item (the one scorer, every reference: scoring.py); perplexity and eval_loss per run
    item_scores = [s for s in langfuse.scores if s.get("name") == "exact_match" and s.get("traceId")]
    assert len(item_scores) == 3 * len(prompts)
    assert all(s["value"] in (0.0, 1.0) for s in item_scores)
    run_scores = {(s["datasetRunId"], s["name"]): s["value"] for s in langfuse.scores if s.get("datasetRunId")}
    checkpoints = {c["name"]: c for c in result["checkpoints"]}
    assert run_scores[(section["runs"]["base"]["id"], "perplexity")] == result["base"]["perplexity"]
    assert run_scores[(section["runs"][new]["id"], "perplexity")] == checkpoints[new]["perplexity"]
    # the champion (run-a's copy of step-2) is measured again, through another loading path: same number
    assert run_scores[(section["runs"]["champion-v1"]["id"], "eval_loss")] == checkpoints["step-2"]["eval_loss"]
    assert "Answers compared in Langfuse" in (root / "artifacts" / "report.html").read_text()

    # register: the version points at Langfuse, the training trace at the version
    promoted = promoted_destination(str(root), MODEL_NAME, RUN_ID)  # what promote copies: no optimizer state
    shutil.copytree(f"{world['run_dir']}/checkpoints/{new}", promoted, ignore=shutil.ignore_patterns("*.pt", "rng"))
    (root / "artifacts" / "run").mkdir(parents=True, exist_ok=True)
    shutil.copy(f"{world['run_dir']}/final/training_manifest.json", root / "artifacts" / "run")
    promoted_artifact = artifact(dsl.Model, root, "promoted", path=str(promoted), checkpoint=new)
    (root / "artifacts" / "promoted").mkdir(parents=True)
    registration = artifact(dsl.Artifact, root, "registration")
    serving = artifact(dsl.Artifact, root, "serving")
    choose_serving_form.python_func(plan=plan_artifact, promoted=promoted_artifact, serving=serving)
    register_model.python_func(
        plan=plan_artifact, promoted=promoted_artifact, evaluation=evaluation, run=run, tokenized=tokenized,
        serving=serving, task_name="register-model", registration=registration,
    )  # fmt: skip
    facts = json.loads((root / "artifacts" / "registration" / "registration.json").read_text())
    assert facts["langfuse_linked"] is True and facts["version"] == "2"
    tags = MlflowClient(plan.registry.tracking_uri).get_model_version(MODEL_NAME, "2").tags
    assert tags["llmft.langfuse.trace_id"] == training["trace_id"]
    assert tags["llmft.served_form"] == "lora" and facts["served_form"] == "lora"  # the serving-form step's
    assert tags["llmft.langfuse.dataset"] == dataset_name(MODEL_NAME)
    assert tags["llmft.langfuse.dataset_run"] == f"{RUN_ID}/{new}" and tags[PROMOTED_PATH_TAG] == str(promoted)
    (event,) = langfuse.wait_for(lambda f: [s for s in f.spans if s.name == "registered in MLflow"])
    assert event.trace_id == training["trace_id"]
    assert event.metadata["version"] == "2" and event.metadata["run_id"] == facts["run_id"]
    assert [s.name for s in langfuse.spans_of(training["trace_id"]) if s.name == "adapter comparison"]


def test_without_langfuse_the_evaluation_is_unchanged(monkeypatch, tmp_path):
    for name in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY"):
        monkeypatch.delenv(name, raising=False)
    evaluation = {"split": "val", "base": {}, "checkpoints": [], "best": "step-1"}
    assert compare_in_langfuse(evaluation, run_dir=str(tmp_path / "none")) is None  # returns before reading anything
    lineage = Lineage(pipeline_run_id="r", task="t", dataset_hash="h", base_model="m")
    ckpt = {"name": "step-1", "step": 1, "eval_loss": 1.0, "perplexity": 2.7}
    reg = registration_from_run(
        promoted_dir=tmp_path, evaluation={**evaluation, "base": ckpt, "checkpoints": [ckpt]}, training_manifest={},
        model_name="m", experiment="e", lineage=lineage,
    )  # fmt: skip
    assert reg.links == {PROMOTED_PATH_TAG: str(tmp_path)}


def test_the_compiled_pipeline_mounts_the_langfuse_secret_where_langfuse_is_used(tmp_path):
    from llmft.pipelines.llm_finetune import compile_pipeline

    path = compile_pipeline(str(tmp_path / "p.yaml"), defaults={"langfuse_secret": "llmft-langfuse"})
    _, platform = yaml.safe_load_all(open(path))
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    with_langfuse = {
        name.removeprefix("exec-")
        for name, executor in executors.items()
        if any(e["secretName"] == "llmft-langfuse" for e in executor.get("secretAsEnv", []))
    }
    assert with_langfuse == {"prepare-dataset", "evaluate-perplexity", "register-model"}
    # the tasks mount the compiled name, so no run may name another Secret (the training job would): no run
    # parameter, and the plan step gets the compiled name
    spec = next(yaml.safe_load_all(open(path)))
    assert "langfuse_secret" not in spec["root"]["inputDefinitions"]["parameters"]
    plan_inputs = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["plan-run"]["inputs"]["parameters"]
    assert plan_inputs["langfuse_secret"] == {"runtimeValue": {"constant": "llmft-langfuse"}}
