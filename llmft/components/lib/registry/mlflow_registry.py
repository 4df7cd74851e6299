"""Register a promoted adapter in the MLflow Model Registry.

One call, :func:`register_adapter`, does what the `register-in-mlflow` step needs:

1. an MLflow run (in the pipeline's experiment) with the training parameters,
   the evaluation metrics and the adapter folder as artifacts;
2. a registered model version whose source is that artifact folder, tagged with
   its lineage (pipeline run id, dataset hash, base model) and the form it is served in
   (``llmft.served_form`` lora or merged, ``llmft.serving_reason``; the merged model's
   export manifest is logged with the run, its weights are not);
3. the alias ``champion`` on the best version by the run's ``promote_metric`` (lowest eval perplexity by
   default, else the highest task score, e.g. ``heldout.contains``, tagged ``llmft.eval.<metric>``; the new
   one only when it beats every other version; :func:`update_champion` is safe when runs register
   concurrently). The promote step's reason is tagged ``llmft.promotion_reason``.

The registration run is a child of the pipeline run's parent run (``pipeline-<KFP run id>``,
llmft/components/lib/registry/lineage.py), beside the trainer's run and the evaluate step's. The version is
created from the run that trained the adapter: the adapter is logged there as an MLflow Model of the
transformers flavour with a PEFT adaptor (llmft/components/lib/registry/mlflow_model.py), loadable with
``mlflow.transformers.load_model("models:/<name>/<version>")``, and ``create_model_version`` gets
``source=models:/<model_id>`` and the training run's id. Without a training run in this tracking server (the
trainer could not reach it) the model is logged from the registration run instead. A full fine-tune is not
an adapter: its promoted folder is logged under the registration run's ``adapter/`` artifacts and the version's
source is that folder, as before.

The version and the run also carry links (:attr:`Registration.links`): ``llmft.promoted_path``
(the promoted adapter on the volume, which the next run's evaluate step answers with as the
previous champion) and, when the evaluate step compared the adapters in Langfuse,
``llmft.langfuse.*`` (the training trace, the dataset and the new adapter's dataset run;
``version_link_tags`` below).

Idempotent on retry: the run and the version carry the tag
``llmft.registration_key = <pipeline run id>/<task>``. A retried task finds them and
reuses them instead of creating a second run or version.

The tracking server comes from the environment (``MLFLOW_TRACKING_URI`` and, where the
server needs them, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``/``TOKEN``), which the
pipeline fills from a Kubernetes Secret: credentials are never parameters.

A dead server fails fast: :func:`llmft.trainer.mlflow_settings.prepare_mlflow` checks it once
(a few seconds) and raises TransientError (exit 200), and caps MLflow's own retries, so the
KFP retry policy is the one place a dead server is retried.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.metrics import PERPLEXITY, lower_is_better, task_scores
from llmft.components.lib.registry.lineage import PARENT_TAG, pipeline_parent_run
from llmft.components.lib.registry.lineage import experiment_id as _experiment_id
from llmft.components.lib.registry.mlflow_model import is_adapter, log_adapter_model
from llmft.trainer.errors import ConfigError
from llmft.trainer.mlflow_settings import prepare_mlflow, redact_credentials, tracking_uri_without_credentials

CHAMPION_ALIAS = "champion"
KEY_TAG = "llmft.registration_key"
PERPLEXITY_TAG = "llmft.eval_perplexity"
WITHDRAWN_TAG = "llmft.withdrawn"
"""A version carrying this tag (any value: the reason) never becomes the champion: how to roll back."""
CHAMPION_ATTEMPTS = 5
"""Rounds of set-then-check of the champion alias (each round: one search, one alias read, at most one set)."""
LINEAGE_PREFIX = "llmft."
ADAPTER_ARTIFACT_PATH = "adapter"
MAX_PARAM_CHARS = 6000  # MLflow's param value limit is 6000 characters

METRIC_TAG_PREFIX = "llmft.eval."
"""Prefix of the version tags holding its task metrics (``llmft.eval.heldout.contains``)."""
PROMOTE_METRIC_TAG = "llmft.promote_metric"
"""The metric the version was promoted on; ``llmft.promotion_reason`` says why."""
PROMOTION_REASON_TAG = "llmft.promotion_reason"
PROMOTED_PATH_TAG = "llmft.promoted_path"
"""The model-version tag naming the promoted adapter's directory."""
LINK_TAG_PREFIX = "llmft.langfuse."
"""Prefix of the model-version tags that lead to Langfuse."""
EVAL_SET_TAG_PREFIX = "llmft.eval_set."
"""Prefix of the version tags saying what each metric was scored on (``llmft.eval_set.heldout``:
:func:`eval_set_identity`); the champion is chosen only among versions scored alike on the promote metric."""


@dataclass(frozen=True)
class Lineage:
    """Where a model version came from; every field becomes an ``llmft.<name>`` tag."""

    pipeline_run_id: str
    """The KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER), identical across task retries."""
    task: str
    """The pipeline task that registers; with the run id it makes the idempotency key."""
    dataset_hash: str
    """Content hash of the tokenized data (the tokenize step's cache key)."""
    base_model: str
    """Hub id or path of the base model the adapter was trained on."""
    dataset: str = ""
    """The dataset source as given to the pipeline (hub id or path)."""
    checkpoint: str = ""
    """Name of the promoted checkpoint (e.g. step-40)."""

    @property
    def key(self) -> str:
        return f"{self.pipeline_run_id}/{self.task}"

    def tags(self) -> dict[str, str]:
        tags = {f"{LINEAGE_PREFIX}{name}": str(value) for name, value in self.__dict__.items() if value != ""}
        tags[KEY_TAG] = self.key
        return tags


@dataclass(frozen=True)
class Registration:
    """Everything needed to register one promoted adapter."""

    model_name: str
    """Registered model name in MLflow."""
    experiment: str
    """MLflow experiment holding the registration run."""
    adapter_dir: Path
    """Promoted adapter folder; logged under the run's ``adapter/`` artifacts."""
    perplexity: float
    """Eval perplexity of the promoted checkpoint (lower is better); decides the champion."""
    lineage: Lineage
    """Lineage tags of the version."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics logged on the run (eval_loss, base_perplexity, ...)."""
    params: dict[str, Any] = field(default_factory=dict)
    """Params logged on the run (flattened training config, data settings)."""
    extra_artifacts: tuple[Path, ...] = ()
    """Files logged at the run's artifact root (evaluation report, promotion decision)."""
    links: dict[str, str] = field(default_factory=dict)
    """Tags of the version and the run that point elsewhere: the promoted path, Langfuse."""
    tags: dict[str, str] = field(default_factory=dict)
    """More tags of the version and the run: the serving form (lib/serving/serving_form.py ``ServingForm.tags``)."""
    metric: str = PERPLEXITY
    """The promote_metric: the champion is the version best by it (contracts.metrics.lower_is_better says which way)."""
    scores: dict[str, float] = field(default_factory=dict)
    """Task metric -> the promoted checkpoint's value (``heldout.contains`` ...), tagged ``llmft.eval.<metric>``."""
    training_run_id: str = ""
    """The trainer's MLflow run (training_manifest.json ``mlflow_run_id``): the version is created from it."""
    training_manifest: dict[str, Any] = field(default_factory=dict)
    """What the trainer recorded (package versions, config): the MLflow Model's requirements and base dtype."""
    eval_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What each metric was scored on (evaluation.json ``eval_sets``), tagged ``llmft.eval_set.<task>``."""

    def metric_value(self) -> float:
        return float(self.perplexity) if self.metric == PERPLEXITY else float(self.scores[self.metric])

    def identity(self) -> str | None:
        """What the promote metric was scored on (None: not recorded, an older evaluation)."""
        found = self.eval_sets.get(eval_set_key(self.metric))
        return None if found is None else eval_set_identity(found)

    def score_tags(self) -> dict[str, str]:
        tags = {METRIC_TAG_PREFIX + name: repr(float(value)) for name, value in self.scores.items()}
        tags |= {EVAL_SET_TAG_PREFIX + key: eval_set_identity(found) for key, found in self.eval_sets.items()}
        return {**tags, PERPLEXITY_TAG: repr(float(self.perplexity)), PROMOTE_METRIC_TAG: self.metric}


def eval_set_key(metric: str) -> str:
    """The ``eval_sets`` entry a metric was scored on: ``perplexity``, or the task of ``<task>.<metric>``."""
    return PERPLEXITY if metric == PERPLEXITY else metric.partition(".")[0]


def eval_set_identity(found: Mapping[str, Any]) -> str:
    """One comparable string: the data's hash (16 hex digits), its size, and the task's version and lm-eval
    settings where it has them (``sha:1a2b...;n:16`` / ``sha:...;n:500;v:1.0;fewshot:-1;limit:500``)."""
    parts = [f"sha:{str(found.get('hash', ''))[:16]}", f"n:{found.get('size', 0)}"]
    for key, short in (("split", "split"), ("version", "v"), ("num_fewshot", "fewshot"), ("limit", "limit")):
        if key in found:
            parts.append(f"{short}:{found[key]}")
    return ";".join(parts)


def register_adapter(
    reg: Registration, *, client=None, tracking_uri: str | None = None, secret_name: str = ""
) -> dict[str, Any]:
    """Register ``reg`` and return the facts (version, run ids, model URI, alias decision, ``is_champion``).
    ``secret_name``: the Secret the plan mounts for MLflow (named in the error when no server is set)."""
    client = client or registry_client(tracking_uri, secret_name)
    _ensure_registered_model(client, reg.model_name)
    existing = find_version_by_key(client, reg.model_name, reg.lineage.key)
    reused = existing is not None
    if existing is not None:
        version = existing
        found = _find_run_by_key(client, _experiment_id(client, reg.experiment), reg.lineage.key)
        register_run = found.info.run_id if found is not None else version.run_id
    else:
        register_run, artifact_uri = _log_run(client, reg)
        version = _create_version(client, reg, register_run, artifact_uri)
    alias = update_champion(
        client, reg.model_name, str(version.version), reg.metric_value(), metric=reg.metric, identity=reg.identity()
    )
    return {
        "registered": True,
        "model_name": reg.model_name,
        "version": str(version.version),
        "run_id": register_run,
        "model_run_id": version.run_id,
        "model_uri": f"models:/{reg.model_name}/{version.version}",
        "source": version.source,
        "reused_existing_version": reused,
        "tracking_uri": _redacted_uri(client),
        **alias,
    }


def _create_version(client, reg: Registration, register_run: str, artifact_uri: str):
    """The model version: from the adapter logged as an MLflow Model of the training run (else of the registration
    run), or, a full fine-tune, from the registration run's ``adapter/`` folder."""
    tags = {**reg.lineage.tags(), **reg.links, **reg.tags, **reg.score_tags()}
    description = f"Adapter for {reg.lineage.base_model} from pipeline run {reg.lineage.pipeline_run_id}"
    if not is_adapter(reg.adapter_dir):
        source = f"{artifact_uri}/{ADAPTER_ARTIFACT_PATH}"
        return client.create_model_version(
            reg.model_name, source, run_id=register_run, tags=tags, description=description
        )
    model_run = reg.training_run_id if _run_exists(client, reg.training_run_id) else register_run
    experiment = client.get_run(model_run).info.experiment_id
    model_tags = {k: v for k, v in reg.lineage.tags().items()}
    model_id = log_adapter_model(
        client, experiment, model_run, reg.adapter_dir, reg.lineage.base_model, reg.training_manifest, model_tags,
        key=(KEY_TAG, reg.lineage.key),
    )  # fmt: skip
    with global_tracking_uri(client.tracking_uri):
        return client.create_model_version(
            reg.model_name,
            f"models:/{model_id}",
            run_id=model_run,
            tags=tags,
            description=description,
            model_id=model_id,
        )


@contextlib.contextmanager
def global_tracking_uri(uri: str):
    """MLflow's process-wide tracking URI set to ``uri`` inside the block: a SQL registry store resolves a
    ``models:/<model_id>`` source with ``MlflowClient()`` on the global URI, not the calling client's (mlflow 3.17.2
    ``mlflow/store/model_registry/sqlalchemy_store.py`` 1018-1026, a TODO there), so a client on another URI
    (run-local's SQLite store) would look for the model elsewhere. The global URI and MLFLOW_TRACKING_URI (which
    ``set_tracking_uri`` also sets) are restored afterwards."""
    from mlflow.tracking import _tracking_service  # heavy: mlflow

    utils = _tracking_service.utils
    previous, variable = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    utils.set_tracking_uri(uri)
    try:
        yield
    finally:
        utils.set_tracking_uri(previous)  # type: ignore[arg-type]  # None: not set (MLflow unsets the variable)
        if variable is not None:
            os.environ["MLFLOW_TRACKING_URI"] = variable


def _run_exists(client, run_id: str) -> bool:
    if not run_id:
        return False
    from mlflow.exceptions import MlflowException  # heavy: mlflow

    try:
        client.get_run(run_id)
    except MlflowException:
        return False  # trained against another server, or the trainer logged nowhere
    return True


def update_champion(
    client, model_name: str, version: str, value: float, *, metric: str = PERPLEXITY, identity: str | None = None
) -> dict[str, Any]:
    """Move ``champion`` to the best version by ``metric`` among those scored like this one (``identity``:
    :func:`eval_set_identity` of what ``metric`` was scored on; :func:`best_version`) and verify it stayed there.

    Like with like: when the current champion was scored on another metric or another evaluation set (its
    ``llmft.eval_set.<task>`` tag differs, or it has no value of ``metric``), nothing is compared and the
    champion stays (:func:`unlike_champion` says why in one line); withdrawing it (tag ``llmft.withdrawn``) lets
    the versions scored alike compete.

    MLflow has no compare-and-set on aliases (``MlflowClient.set_registered_model_alias(name, alias,
    version)``, mlflow 3.17 ``mlflow/tracking/client.py`` 5549): two runs that read the champion, then
    each set it, race, and the slower one wins whatever its perplexity. So no writer compares against
    what it read: each sets the alias to the best of *all* like versions (a total order: best recorded
    value, then lowest version number; withdrawn versions excluded), then re-reads the alias and
    the versions and sets it again while they disagree. The versions only grow, every write is
    followed by its writer's check, so whatever the interleaving the alias ends on the best version.
    ``is_champion``: this version is the best at this writer's last check. A better version registered
    after that check takes the alias (its run deploys too, and the served model is whichever deploy step
    applies last): the single-writer rule for serving is docs/cluster-guide.md's, one run per model at a
    time (KFP recurring runs: max_concurrency=1)."""
    previous = champion_version(client, model_name)
    unlike = unlike_champion(previous, version, metric, identity)
    if unlike is not None:
        return _alias_facts(False, str(previous.version), str(previous.version), previous, unlike, metric, None)
    for _ in range(CHAMPION_ATTEMPTS):
        best = best_version(client, model_name, metric, identity)
        if best is None:  # no version carries the metric: this one, whatever it is, leads
            best = client.get_model_version(model_name, version)
        current = champion_version(client, model_name)
        if current is not None and str(current.version) == str(best.version):
            return _champion_facts(version, value, best, previous, metric)
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, str(best.version))
    raise RuntimeError(
        f"{model_name}: the {CHAMPION_ALIAS!r} alias kept changing under {CHAMPION_ATTEMPTS} attempts "
        "(registrations racing); re-run the register step"
    )


def unlike_champion(champion, version: str, metric: str, identity: str | None) -> str | None:
    """None when ``champion`` may be compared with the new version (none yet, itself, withdrawn, or scored alike on
    ``metric``); else the one line saying why not and what stays."""
    if champion is None or str(champion.version) == str(version) or WITHDRAWN_TAG in (champion.tags or {}):
        return None
    tags = champion.tags or {}
    theirs = tags.get(EVAL_SET_TAG_PREFIX + eval_set_key(metric))
    if version_metric(champion, metric) is None:
        why = f"it has no recorded {metric} (it was promoted on {tags.get(PROMOTE_METRIC_TAG, PERPLEXITY)})"
    elif identity is not None and theirs != identity:
        why = f"its {metric} was scored on {theirs or 'an unrecorded set'}, this version's on {identity}"
    else:
        return None
    return (
        f"not compared with champion v{champion.version}: {why}; unlike evaluations are never compared, so the "
        f"champion stays v{champion.version} (tag it {WITHDRAWN_TAG} to let versions scored alike compete)"
    )


def is_champion(facts: Mapping[str, Any]) -> bool:
    """The register step's verdict in registration.json: only an explicit ``is_champion: true`` deploys
    under ``serving_deploy_policy=champion``; a missing key (an older or partial file) is not the champion."""
    return facts.get("is_champion") is True


def best_version(client, model_name: str, metric: str = PERPLEXITY, identity: str | None = None):
    """The version best by its recorded ``metric`` (the lowest perplexity, the highest task score; ties: the
    lowest version number) among those scored on ``identity`` (when given: tag ``llmft.eval_set.<task>``),
    skipping versions tagged :data:`WITHDRAWN_TAG`; None when no version qualifies."""
    sign = 1.0 if lower_is_better(metric) else -1.0
    tag = EVAL_SET_TAG_PREFIX + eval_set_key(metric)
    ranked = [
        (sign * value, int(v.version), v)
        for v in client.search_model_versions(f"name = '{_quote(model_name)}'")
        if WITHDRAWN_TAG not in (v.tags or {})
        and (identity is None or (v.tags or {}).get(tag) == identity)
        and (value := version_metric(v, metric)) is not None
    ]
    return min(ranked, key=lambda item: item[:2])[2] if ranked else None


def _champion_facts(version: str, value: float, best, previous, metric: str = PERPLEXITY) -> dict[str, Any]:
    before = None if previous is None else str(previous.version)
    before_value = None if previous is None else version_metric(previous, metric)
    if str(best.version) != version:
        theirs = version_metric(best, metric)
        why = f"{metric} {value:.4f} does not beat champion v{best.version} ({theirs:.4f}); this version lost"
        return _alias_facts(False, str(best.version), before, previous, why, metric, before_value)
    if before is None:
        why = "no champion yet"
    elif before == version:
        why = "this version is already the champion"
    elif before_value is None:
        why = f"champion v{before} has no recorded {metric}"
    else:
        why = f"{metric} {value:.4f} beats champion v{before} ({before_value:.4f})"
    return _alias_facts(True, version, before, previous, why, metric, before_value)


def champion_version(client, model_name: str):
    """The version the ``champion`` alias points at, or None when the alias is unset."""
    from mlflow.exceptions import MlflowException  # heavy: mlflow

    try:
        return client.get_model_version_by_alias(model_name, CHAMPION_ALIAS)
    except MlflowException as exc:
        if _error_code(exc) in {"RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"}:
            return None
        raise


def version_perplexity(version) -> float | None:
    """The eval perplexity recorded on a model version (tag), or None."""
    return version_metric(version, PERPLEXITY)


def version_metric(version, metric: str) -> float | None:
    """The value of ``metric`` recorded on a model version (tag ``llmft.eval_perplexity`` or
    ``llmft.eval.<metric>``), or None."""
    raw = (version.tags or {}).get(PERPLEXITY_TAG if metric == PERPLEXITY else METRIC_TAG_PREFIX + metric)
    if raw is None:
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def find_version_by_key(client, model_name: str, key: str):
    """The version registered earlier by the same pipeline run and task, if any."""
    versions = client.search_model_versions(f"name = '{_quote(model_name)}'")
    matches = [v for v in versions if (v.tags or {}).get(KEY_TAG) == key]
    return min(matches, key=lambda v: int(v.version)) if matches else None


def _alias_facts(
    is_champion: bool, champion: str, before: str | None, previous, why: str, metric: str, before_value
) -> dict[str, Any]:
    return {
        "alias": CHAMPION_ALIAS,
        "is_champion": is_champion,
        "champion_version": champion,
        "champion_metric": metric,
        "previous_champion_version": before,
        "previous_champion_perplexity": None if previous is None else version_perplexity(previous),
        "previous_champion_value": before_value,
        "alias_reason": why,
    }


def _log_run(client, reg: Registration) -> tuple[str, str]:
    """Create (or on retry reuse) the registration run; log params, metrics, artifacts."""
    from mlflow.entities import Metric, Param, RunTag  # heavy: mlflow

    experiment_id = _experiment_id(client, reg.experiment)
    run = _find_run_by_key(client, experiment_id, reg.lineage.key)
    if run is None:
        parent = pipeline_parent_run(client, experiment_id, reg.lineage.pipeline_run_id)  # one tree per pipeline run
        run = client.create_run(
            experiment_id,
            tags={**reg.lineage.tags(), **reg.links, **reg.tags, PARENT_TAG: parent},
            run_name=f"register-{reg.lineage.pipeline_run_id}"[:250],
        )
    run_id = run.info.run_id
    params = [Param(k, _param_value(v)) for k, v in sorted(flatten(reg.params).items())]
    logged = run.data.params if run.data else {}
    params = [p for p in params if p.key not in logged]  # a retry must not re-log (immutable) params
    metrics = [Metric(k, float(v), _now_ms(), 0) for k, v in sorted(reg.metrics.items()) if _finite(v)]
    metrics.append(Metric("perplexity", float(reg.perplexity), _now_ms(), 0))
    metrics += [Metric(name, float(v), _now_ms(), 0) for name, v in sorted(reg.scores.items()) if _finite(v)]
    for start in range(0, len(params), 100):  # log_batch takes at most 100 params per call
        client.log_batch(run_id, params=params[start : start + 100])
    client.log_batch(run_id, metrics=metrics, tags=[RunTag("llmft.step", "register")])
    if not is_adapter(reg.adapter_dir):  # an adapter goes into the MLflow Model (_create_version), not twice
        client.log_artifacts(run_id, str(reg.adapter_dir), ADAPTER_ARTIFACT_PATH)
    for path in reg.extra_artifacts:
        if Path(path).is_file():
            client.log_artifact(run_id, str(path))
    client.set_terminated(run_id, "FINISHED")
    finished = client.get_run(run_id)
    if parent_run := (finished.data.tags or {}).get(PARENT_TAG):
        client.set_terminated(parent_run, "FINISHED")  # the parent's end time follows its last child
    return run_id, finished.info.artifact_uri


def _find_run_by_key(client, experiment_id: str, key: str):
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{_quote(key)}'", max_results=1)
    return runs[0] if runs else None


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException  # heavy: mlflow

    try:
        client.create_registered_model(name, description="LoRA adapters fine-tuned by kfp-llm-finetune")
    except MlflowException as exc:
        if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
            raise


def registry_client(tracking_uri: str | None, secret_name: str = ""):
    """An MlflowClient for ``tracking_uri`` (else MLFLOW_TRACKING_URI); ConfigError naming the fix when neither is set,
    TransientError when the server does not answer."""
    from mlflow import MlflowClient  # heavy: mlflow

    uri = tracking_uri_without_credentials(tracking_uri or None)  # credentials go to MLFLOW_TRACKING_PASSWORD
    if not uri:
        where = (
            f"the Secret `{secret_name}` (pipeline parameter mlflow_secret) mounts no MLFLOW_TRACKING_URI key: add "
            "the key to it, or set the pipeline parameter mlflow_tracking_uri"
            if secret_name
            else "the pipeline names no MLflow Secret: compile and run it with mlflow_secret=llmft-mlflow (a Secret "
            "with key MLFLOW_TRACKING_URI, plus MLFLOW_TRACKING_USERNAME/PASSWORD if the server needs them; "
            "deploy/secrets), or set mlflow_tracking_uri; for a local run export MLFLOW_TRACKING_URI"
        )
        raise ConfigError(
            f"MLFLOW_TRACKING_URI is not set: the register step needs an MLflow tracking server. Fix: {where}"
        )
    prepare_mlflow(uri)
    return MlflowClient(tracking_uri=uri)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"lora": {"r": 8}}`` -> ``{"lora.r": 8}`` (MLflow params are flat)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def _param_value(value: Any) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list | tuple) else str(value)
    return text[:MAX_PARAM_CHARS]


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _quote(text: str) -> str:
    return text.replace("'", "\\'")


def _error_code(exc) -> str:
    return str(getattr(exc, "error_code", ""))


def _redacted_uri(client) -> str:
    uri = str(getattr(getattr(client, "_tracking_client", None), "tracking_uri", "") or "")
    return redact_credentials(uri)  # never echo credentials embedded in a URI


def _now_ms() -> int:

    return int(time.time() * 1000)


def registration_from_run(
    *,
    promoted_dir: str | Path,
    evaluation: dict[str, Any],
    training_manifest: dict[str, Any],
    model_name: str,
    experiment: str,
    lineage: Lineage,
    extra_artifacts: tuple[Path, ...] = (),
    tags: dict[str, str] | None = None,
    promotion: dict[str, Any] | None = None,
) -> Registration:
    """Assemble a :class:`Registration` from the files the earlier steps wrote (``tags``: more version tags;
    ``promotion``: promote's promotion.json, whose metric the champion follows and whose reason is tagged)."""

    promoted_dir = Path(promoted_dir)
    best = (
        next(c for c in evaluation["checkpoints"] if c["name"] == lineage.checkpoint)
        if lineage.checkpoint
        else min(evaluation["checkpoints"], key=lambda c: c["perplexity"])
    )
    base = evaluation["base"]
    metrics = {
        "eval_loss": best["eval_loss"],
        "base_eval_loss": base["eval_loss"],
        "base_perplexity": base["perplexity"],
        "step": best.get("step", 0),
        "improvement": 1.0 - best["perplexity"] / base["perplexity"] if base["perplexity"] else float("nan"),
    }
    for key in ("tokens_seen", "wall_time_s"):
        if _finite(training_manifest.get(key)):
            metrics[key] = float(training_manifest[key])
    metrics |= {f"base_{name}": value for name, value in task_scores(base).items()}
    promotion = promotion or {}
    if _finite(promotion.get("improvement")):
        metrics["promote_improvement"] = float(promotion["improvement"])
    for guard in promotion.get("guards") or []:  # the gate's guards: each value and whether it held
        if _finite(guard.get("value")):
            metrics[f"guard_{guard['metric']}"] = float(guard["value"])
        metrics[f"guard_{guard['metric']}_held"] = float(bool(guard.get("held")))
    gate = {PROMOTION_REASON_TAG: str(promotion["reason"])[:5000]} if promotion.get("reason") else {}
    params = {
        **training_manifest.get("config", {}),
        "dataset_source": lineage.dataset,
        "dataset_hash": lineage.dataset_hash,
        "base_model": lineage.base_model,
    }
    return Registration(
        model_name=model_name,
        experiment=experiment,
        adapter_dir=promoted_dir,
        perplexity=float(best["perplexity"]),
        lineage=lineage,
        metrics=metrics,
        params=params,
        extra_artifacts=extra_artifacts,
        links={PROMOTED_PATH_TAG: str(promoted_dir), **version_link_tags(evaluation)},
        tags={**(tags or {}), **gate},
        metric=str(promotion.get("metric") or PERPLEXITY),
        scores=task_scores(best),
        training_run_id=str(training_manifest.get("mlflow_run_id") or ""),
        training_manifest=training_manifest,
        eval_sets=dict(evaluation.get("eval_sets") or {}),
    )


def version_link_tags(evaluation: dict) -> dict[str, str]:
    """MLflow tags that lead from the model version to Langfuse (empty without a comparison)."""
    section = evaluation.get("langfuse") or {}
    tags: dict[str, str] = {}
    training = section.get("training") or {}
    new_run = (section.get("runs") or {}).get(section.get("new")) or {}
    for key, value in {
        "trace_id": training.get("trace_id"),
        "trace_url": section.get("training_trace_url"),
        "dataset": section.get("dataset"),
        "dataset_run": new_run.get("run_name"),
        "dataset_run_url": new_run.get("url"),
        "host": section.get("host"),
    }.items():
        if value:
            tags[LINK_TAG_PREFIX + key] = str(value)[:5000]
    return tags


_client = registry_client
