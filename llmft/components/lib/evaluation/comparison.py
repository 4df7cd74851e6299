"""Adapters compared side by side in Langfuse, and the links between Langfuse and MLflow.

Only when Langfuse is configured (LANGFUSE_PUBLIC_KEY/SECRET_KEY, from the Secret named by
``langfuse_secret``); otherwise the evaluate and register steps do exactly what they did before.

:func:`compare_in_langfuse` (the evaluate step, after the perplexity of every checkpoint):

1. the models: the base model, the previous champion when there is one (MLflow's ``champion``
   alias -> the version's promoted adapter on the volume, tag ``llmft.promoted_path``; skipped
   with the reason when MLflow is not configured or does not answer, when the adapter is gone or
   was trained on another base model) and the new adapter (the best checkpoint);
2. a fixed prompt set from the validation split, answered greedily by each (llmft/components/lib/
   generations.py);
3. in Langfuse: the dataset ``llmft/<model name>`` holds the prompts as items (ids fixed by the
   prompt, so every run of the model answers the same items), and each model's answers are one
   dataset run (the SDK's experiment runner), named ``<run id>/<model>``, with the item scores
   ``exact_match``, ``contains`` and ``token_f1`` (lib/evaluation/scoring.py, the evaluate step's own scorer) and
   the run scores ``perplexity`` and ``eval_loss`` (the validation split), their means, and for the base and
   the new adapter every task metric the evaluate step computed (``heldout.contains``, an lm-eval task's
   ``acc``). Langfuse's dataset view then lists the runs side by side, item by item;
4. the training trace gets an event naming the comparison.

The result is the ``langfuse`` section of evaluation.json; :func:`registry.mlflow_registry.version_link_tags`
turns it into
the MLflow model version's tags and :func:`record_registration` (the register step) writes the
MLflow version into the training trace.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import task_scores
from llmft.components.lib.evaluation import generations as gen
from llmft.components.lib.evaluation.checkpoints import adapter_dir
from llmft.components.lib.evaluation.promote import promoted_destination
from llmft.components.lib.evaluation.scoring import METRICS, score_answer
from llmft.components.lib.registry.mlflow_registry import PROMOTED_PATH_TAG, champion_version, version_perplexity
from llmft.trainer import langfuse_sink
from llmft.trainer.data.loader import dataset_info
from llmft.trainer.io import is_complete
from llmft.trainer.mlflow_settings import prepare_mlflow, tracking_uri_without_credentials


def dataset_name(model_name: str) -> str:
    return f"llmft/{model_name}"


# ----------------------------------------------------------------------------- the previous champion


def previous_champion(
    model_name: str, tracking_uri: str, *, data_root: str, base_model: str, run_id: str
) -> tuple[dict | None, str]:
    """``({version, adapter, perplexity}, "")`` for the current champion's adapter, or ``(None, why not)``."""

    uri = tracking_uri_without_credentials(tracking_uri or None)  # credentials go to MLFLOW_TRACKING_PASSWORD
    if not uri:
        return None, "no MLflow tracking server (MLFLOW_TRACKING_URI) to ask for a champion"

    if reason := prepare_mlflow(uri, required=False):
        return None, reason
    try:
        from mlflow import MlflowClient  # heavy: mlflow

        version = champion_version(MlflowClient(tracking_uri=uri), model_name)
    except Exception as exc:  # noqa: BLE001 - the comparison goes on without a champion
        return None, f"cannot read the champion of {model_name} from MLflow: {type(exc).__name__}: {exc}"
    if version is None:
        return None, f"{model_name} has no champion yet"
    return _champion_adapter(version, version_perplexity(version), model_name, data_root, base_model, run_id)


def _champion_adapter(version, perplexity, model_name, data_root, base_model, run_id) -> tuple[dict | None, str]:

    tags, label = version.tags or {}, f"champion v{version.version}"
    if tags.get("llmft.pipeline_run_id") == run_id:
        return None, f"{label} is this run's own adapter"
    if tags.get("llmft.base_model", base_model) != base_model:
        return None, f"{label} was trained on {tags['llmft.base_model']}, not {base_model}"
    path = tags.get(PROMOTED_PATH_TAG)
    if not path and tags.get("llmft.pipeline_run_id"):
        path = str(promoted_destination(data_root, model_name, tags["llmft.pipeline_run_id"]))
    adapter = adapter_dir(Path(path)) if path and is_complete(path) else None
    if adapter is None:
        return None, f"{label}: no complete adapter at {path or '(no promoted path recorded)'}"
    return {"version": str(version.version), "adapter": str(adapter), "perplexity": perplexity}, ""


# ----------------------------------------------------------------------------- answers


def _answers(evaluator, model_path: str, adapter: str | None, prompts, tokenizer, *, end_of_turn, max_new_tokens, val):
    """Answers of one model, plus its perplexity on ``val = (tokenized dir, split)`` when given. The
    evaluator keeps the base loaded: base, champion and new adapter share one load of it."""
    with evaluator.applied(model_path, adapter) as model:
        answers = gen.generate_answers(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens, end_of_turn=end_of_turn
        )
        return answers, None if val is None else evaluator.score(model, val[0], split=val[1])


# ----------------------------------------------------------------------------- the comparison


def compare_in_langfuse(evaluation: dict, **kwargs: Any) -> dict | None:
    """Generate, record and link (see the module docstring). None when Langfuse is not configured;
    ``{"error": ...}`` when it failed: the comparison never fails the evaluation it comes after."""
    if not langfuse_sink.configured():
        return None
    try:
        return _compare(evaluation, **kwargs)
    except Exception as exc:  # noqa: BLE001 - perplexity and promotion do not depend on it
        message = f"{type(exc).__name__}: {exc}"
        print(f"[llmft] warning: langfuse: the adapter comparison was not recorded: {message}", flush=True)
        return {"error": message}


def _compare(
    evaluation: dict,
    *,
    run_dir: str,
    base_model: str,
    prepared_dir: str,
    tokenized_dir: str,
    model_name: str,
    run_id: str,
    tracking_uri: str = "",
    data_root: str = "/data",
    size: int | None = None,
    max_new_tokens: int | None = None,
    evaluator=None,
) -> dict:
    """``size``, ``max_new_tokens``: generations.PROMPT_SET_SIZE and MAX_NEW_TOKENS unless given;
    ``evaluator``: the evaluate step's :class:`~llmft.trainer.evaluate.PerplexityEvaluator`, whose
    loaded base the comparison reuses (a new one otherwise)."""
    from llmft.trainer.evaluate import PerplexityEvaluator  # heavy: torch

    split, max_new_tokens = evaluation["split"], max_new_tokens or gen.MAX_NEW_TOKENS
    prompts = gen.prompt_set(prepared_dir, size or gen.PROMPT_SET_SIZE, split=split)
    if not prompts:
        return {"note": f"{prepared_dir}: no conversation in the {split} split to answer"}
    manifest = dataset_info(tokenized_dir)
    tokenizer = gen.generation_tokenizer(base_model, manifest)
    best = next(c for c in evaluation["checkpoints"] if c["name"] == evaluation["best"])
    adapter = adapter_dir(Path(best["path"]))
    # label -> (model, adapter, known metrics)
    models: dict[str, tuple[str, str | None, dict | None]] = {"base": (base_model, None, evaluation["base"])}
    champion, note = previous_champion(
        model_name, tracking_uri, data_root=data_root, base_model=base_model, run_id=run_id
    )
    if champion is not None:
        models[f"champion-v{champion['version']}"] = (base_model, champion["adapter"], None)
    models[best["name"]] = (base_model, str(adapter), best) if adapter else (best["path"], None, best)
    answers, scores, evaluator = {}, {}, evaluator or PerplexityEvaluator()
    for label, (model_path, adapter_path, known) in models.items():
        answers[label], measured = _answers(
            evaluator, model_path, adapter_path, prompts, tokenizer, end_of_turn=manifest.get("end_of_turn"),
            max_new_tokens=max_new_tokens, val=None if known else (tokenized_dir, split),
        )  # fmt: skip
        scores[label] = {k: float(v) for k, v in (known or measured).items() if k in ("eval_loss", "perplexity")}
        scores[label] |= task_scores(known or {})  # the evaluate step's tasks: base against adapter
        print(f"langfuse comparison: {label} answered {len(prompts)} prompts", flush=True)
    gate = evaluation.get("gate") or {}
    if gate:  # the promote gate's verdict on the new adapter's run, each guard's value beside it
        scores[best["name"]]["gate_promoted"] = float(bool(gate.get("promoted")))
        scores[best["name"]] |= {f"guard_{g['metric']}_held": float(bool(g["held"])) for g in gate.get("guards", [])}
    record = langfuse_sink.read_run_record(run_dir)
    section = record_runs(
        prompts, answers, scores, model_name=model_name, run_id=run_id, base_model=base_model, training=record
    )
    section.update(new=best["name"], champion=champion, champion_note=note or None, prompts=len(prompts))
    section["gate_reason"] = gate.get("reason")
    return section


def record_runs(prompts, answers: dict, scores: dict, *, model_name, run_id, base_model, training) -> dict:
    """The dataset items and one dataset run per model (see the module docstring); the ``langfuse``
    section of evaluation.json."""
    from langfuse import Evaluation  # heavy: langfuse

    client = langfuse_sink.get_client()
    name = dataset_name(model_name)
    items = _upsert_items(client, name, prompts)
    trace_id = training.get("trace_id") if training else None

    references = {items[i].id: list(p.references) for i, p in enumerate(prompts)}

    def exact(*, output, item=None, expected_output=None, **_):
        """The one scorer (scoring.py), as evaluation.json scores the same answer: the best over its references."""
        refs = references.get(getattr(item, "id", None)) or [str(expected_output or "")]
        return [Evaluation(name=k, value=v) for k, v in score_answer(str(output or ""), refs).items()]

    runs = {}
    for label, outputs in answers.items():
        by_item = {items[i].id: out for i, out in enumerate(outputs)}
        run_scores = scores.get(label, {})

        def summary(*, item_results, _scores=run_scores, **_):
            means = {}
            for metric in METRICS:
                found = [e.value for r in item_results for e in r.evaluations if e.name == metric]
                means |= {metric: sum(found) / len(found)} if found else {}
            return [Evaluation(name=k, value=v) for k, v in {**_scores, **means}.items()]

        result = client.run_experiment(
            name=f"llmft {model_name}",
            run_name=f"{run_id}/{label}",
            description=f"{label} answers {len(items)} validation prompts (greedy); base model {base_model}",
            data=items,
            task=lambda *, item, _answers=by_item, **_: _answers[item.id],
            evaluators=[exact],
            run_evaluators=[summary],
            metadata={"model": label, "base_model": base_model, "run_id": run_id, "training_trace_id": trace_id or ""},
        )
        runs[label] = {
            "run_name": result.run_name,
            "id": getattr(result, "experiment_id", None) or getattr(result, "dataset_run_id", None),
            "url": getattr(result, "experiment_url", None) or getattr(result, "dataset_run_url", None),
            **run_scores,
        }
    section = {"dataset": name, "host": langfuse_sink.host(), "runs": runs, "training": training}
    if training:
        section["training_trace_url"] = _trace_url(client, training["trace_id"])
        langfuse_sink.add_to_run_trace(
            client, training, "adapter comparison", {"dataset": name, "runs": [r["run_name"] for r in runs.values()]}
        )
    client.flush()
    return section


def _upsert_items(client, name: str, prompts) -> list:
    """The prompts as items of dataset ``name``, in prompt order. Both calls upsert: the server's
    POST /api/public/v2/datasets upserts by (project, name) (web/src/pages/api/public/v2/datasets/
    index.ts), POST /api/public/dataset-items by item id."""
    client.create_dataset(name=name, description="Validation prompts that llmft answers with each adapter")
    for prompt in prompts:
        client.create_dataset_item(
            dataset_name=name,
            id=langfuse_sink.seeded_id(f"{name}/{prompt.id}"),
            input={"messages": prompt.messages},
            expected_output=prompt.reference,
            metadata={"prompt_id": prompt.id},
        )
    by_id = {item.id: item for item in client.get_dataset(name).items}
    return [by_id[langfuse_sink.seeded_id(f"{name}/{p.id}")] for p in prompts]


def _trace_url(client, trace_id: str) -> str | None:
    try:
        return client.get_trace_url(trace_id=trace_id)
    except Exception:  # noqa: BLE001 - a link is a convenience
        return None


# ----------------------------------------------------------------------------- the links


def record_registration(facts: dict, evaluation: dict, tracking_uri: str = "") -> bool:
    """The register step: the MLflow run and model version, as an event in the training trace.
    False (and nothing sent) without Langfuse or a comparison; never raises."""
    training = (evaluation.get("langfuse") or {}).get("training")
    if not (langfuse_sink.configured() and training):
        return False
    metadata = {k: facts.get(k) for k in ("model_name", "version", "run_id", "is_champion", "alias_reason", "source")}
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")) and "@" not in uri:  # never a URI with credentials in it
        metadata["mlflow_version_url"] = f"{uri.rstrip('/')}/#/models/{facts['model_name']}/versions/{facts['version']}"
    try:
        client = langfuse_sink.get_client()
        langfuse_sink.add_to_run_trace(client, training, "registered in MLflow", metadata)
        client.flush()
        return True
    except Exception as exc:  # noqa: BLE001 - the registration itself is done
        print(f"[llmft] warning: langfuse: the MLflow link was not recorded: {exc}", flush=True)
        return False
