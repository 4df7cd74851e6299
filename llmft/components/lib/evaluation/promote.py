"""Pick the best checkpoint by the promote metric and promote it to a stable location.

The `promote-best-checkpoint` step reads the evaluation written by the evaluate step
(:func:`llmft.components.lib.evaluation.checkpoints.evaluate_run`), and

* picks the best checkpoint by ``promote_metric`` (perplexity by default, or a task metric such as
  ``heldout.contains``; ties go to the lower perplexity, then the later step: contracts.metrics.best_of);
* refuses unless it beats the base model's value of that metric by ``margin`` (perplexity: below
  ``base * (1 - margin)``; a task score: above ``base + margin``), raising :class:`GateRefused` (a
  :class:`PromotionRefused` carrying the decision, which the promote step reports as ``not promoted``);
  an adapter whose perplexity fell but whose task score did not rise is refused under a task metric;
* copies the servable files of that checkpoint (adapter or full weights, tokenizer,
  manifest; never optimizer or RNG state) atomically to ``destination`` with a
  completion marker, and
* records the decision and why, as JSON, both inside the promoted folder and
  beside it (``<destination>.decision.json``), so a refused run leaves its reason on the PVC too.

The destination on the volume is ``<data_root>/models/<model name>/<run id>``
(:func:`promoted_destination`): both parameters must be single plain path components
and the resolved result must stay under ``<data_root>/models``, so a parameter such as
``mlflow_model_name=../runs`` is refused before anything is written. The copied files get
the umask-based mode (safetensors writes 0600), so a serving pod under another UID reads them.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llmft.components.lib.contracts.choices import NOT_PROMOTED, PROMOTED
from llmft.components.lib.contracts.metrics import PERPLEXITY, beats, best_of, lower_is_better, metric_value, threshold
from llmft.components.lib.contracts.volume_paths import check_path_component, path_under
from llmft.components.lib.serving.servability import require_vllm_servable
from llmft.trainer.errors import ConfigError, DataError, LlmftError
from llmft.trainer.hf_files import TOKENIZER_FILES
from llmft.trainer.io import TRAINING_MANIFEST, atomic_directory, atomic_write_json, is_complete
from llmft.trainer.safe_files import check_file, copy_file

DECISION_FILE = "promotion.json"
PROMOTED_KIND = "promoted-adapter"
MODELS_FOLDER = "models"
# Files a server needs; optimizer/scheduler/RNG/data-position state stays behind.
SERVABLE_PATTERNS = (
    "adapter_model.safetensors",
    "adapter_config.json",
    "model.safetensors",
    "model-*.safetensors",
    "model.safetensors.index.json",
    "config.json",
    "generation_config.json",
    *TOKENIZER_FILES,
    TRAINING_MANIFEST,
    "README.md",
)


class PromotionRefused(LlmftError):
    """Nothing may be promoted: the gate said no (:class:`GateRefused`), or the checkpoint cannot be (no COMPLETE
    marker, no weights, an adapter vLLM would refuse under serving_mode=lora, a margin out of range)."""


class GateRefused(PromotionRefused):
    """The gate's decision: no checkpoint beats the base model by the margin. Not a failure of the run: the promote
    step reports it as its decision ("not promoted: <reason>") and the pipeline skips register and deploy."""

    def __init__(self, message: str, decision: PromotionDecision):
        super().__init__(message)
        self.decision = decision


@dataclass(frozen=True)
class PromotionDecision:
    """The promote step's verdict; written as JSON next to the promoted files."""

    promoted: bool
    """True when the best checkpoint beat the base model by the margin."""
    checkpoint: str | None
    """Name of the best checkpoint (e.g. step-40), None when there was none."""
    checkpoint_path: str | None
    """Where the best checkpoint lives in the run directory."""
    step: int | None
    """Training step of the best checkpoint."""
    perplexity: float | None
    """Eval perplexity of the best checkpoint."""
    eval_loss: float | None
    """Eval loss of the best checkpoint."""
    base_perplexity: float
    """Eval perplexity of the base model on the same split."""
    margin: float
    """Required improvement over the base model: relative for perplexity (0.01 = 1%), absolute points for a
    task score (0.01 = one point)."""
    threshold: float
    """The best checkpoint's value of ``metric`` had to beat this value."""
    improvement: float | None
    """Over the base model: perplexity 1 - best / base; a task score best - base."""
    reason: str
    """Why it was, or was not, promoted, in one sentence."""
    destination: str | None = None
    """Stable location of the promoted copy (set after the copy)."""
    metric: str = PERPLEXITY
    """The promote_metric the gate and the choice of the best checkpoint followed."""
    value: float | None = None
    """The best checkpoint's value of ``metric``."""
    base_value: float | None = None
    """The base model's value of ``metric``."""
    guards: tuple[dict[str, Any], ...] = ()
    """Each guard metric of the chosen checkpoint: metric, tolerance, base, value, limit, held (promote_guards)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(
    evaluation: dict[str, Any], margin: float, metric: str = PERPLEXITY, guards: Sequence[tuple[str, float]] = ()
) -> PromotionDecision:
    """Choose the best checkpoint of ``evaluation`` by ``metric`` among those that keep every guard (no guard
    metric below the base's by more than its tolerance: :func:`guard_checks`) and decide whether it may be
    promoted: it must beat the base model's value of that metric by ``margin`` (contracts.metrics.threshold)."""
    if not 0.0 <= margin < 1.0:
        raise PromotionRefused(f"promote margin {margin} is out of range: use a fraction in [0, 1), e.g. 0.01 for 1%")
    base_ppl = float(evaluation["base"]["perplexity"])
    base_value = metric_value(evaluation["base"], metric)
    if base_value is None:
        raise PromotionRefused(
            f"promote_metric {metric!r} was not computed for the base model: the evaluate step ran other tasks "
            "(check promote_eval_tasks)"
        )
    limit = threshold(base_value, metric, margin)
    checkpoints = [c for c in evaluation.get("checkpoints", []) if metric_value(c, metric) is not None]
    if not checkpoints:
        return PromotionDecision(
            False, None, None, None, None, None, base_ppl, margin, limit, None,
            f"no complete checkpoint was evaluated on {metric}: nothing to promote",
            metric=metric, base_value=base_value,
        )  # fmt: skip
    checks = {c["name"]: guard_checks(evaluation["base"], c, guards) for c in checkpoints}
    keeping = [c for c in checkpoints if all(g["held"] for g in checks[c["name"]])]
    best = best_of(keeping or checkpoints, metric)
    value = float(metric_value(best, metric))  # type: ignore[arg-type]  # filtered above
    promoted = bool(keeping) and beats(value, base_value, metric, margin)
    reason = _reason(promoted, best["name"], metric, value, base_value, margin, limit)
    if not keeping:
        reason = _guard_reason(best["name"], checks[best["name"]])
    elif guards:
        reason += "; " + _guards_held(checks[best["name"]])
    return PromotionDecision(
        promoted, best["name"], best.get("path"), best.get("step"), best.get("perplexity"), best.get("eval_loss"),
        base_ppl, margin, limit, _improvement(value, base_value, metric), reason, metric=metric, value=value,
        base_value=base_value, guards=tuple(checks[best["name"]]),
    )  # fmt: skip


def guard_checks(base: dict[str, Any], candidate: dict[str, Any], guards: Sequence[tuple[str, float]]) -> list[dict]:
    """Each guard on one checkpoint: the base's value, the checkpoint's, the limit (a score: base - tolerance;
    a perplexity: base x (1 + tolerance)) and whether it held (a value missing on either side does not)."""
    out = []
    for metric, tolerance in guards:
        base_value, value = metric_value(base, metric), metric_value(candidate, metric)
        if base_value is None or not math.isfinite(base_value):
            out.append({"metric": metric, "tolerance": tolerance, "base": base_value, "value": value, "limit": None,
                        "held": False})  # fmt: skip
            continue
        lower = lower_is_better(metric)
        limit = base_value * (1.0 + tolerance) if lower else base_value - tolerance
        held = value is not None and math.isfinite(value) and (value <= limit if lower else value >= limit)
        out.append({"metric": metric, "tolerance": tolerance, "base": base_value, "value": value, "limit": limit,
                    "held": held})  # fmt: skip
    return out


def _number(value: float | None) -> str:
    return "missing" if value is None else f"{value:.4f}"


def _guard_reason(name: str, checks: list[dict]) -> str:
    lost = [g for g in checks if not g["held"]]
    said = "; ".join(
        f"{g['metric']} {_number(g['value'])} against the base's {_number(g['base'])}, beyond the tolerance "
        f"{g['tolerance']:g} (limit {_number(g['limit'])})"
        for g in lost
    )
    return f"refusing to promote: no checkpoint keeps every guard; the best, {name}, loses {said}"


def _guards_held(checks: list[dict]) -> str:
    return "guards held: " + ", ".join(
        f"{g['metric']} {_number(g['value'])} (base {_number(g['base'])}, limit {_number(g['limit'])})" for g in checks
    )


def _improvement(value: float, base: float, metric: str) -> float | None:
    """Perplexity: relative (1 - best / base); a task score: absolute points (best - base)."""
    if lower_is_better(metric):
        return 1.0 - value / base if base > 0 else None
    return value - base


def _reason(promoted: bool, name: str, metric: str, value: float, base: float, margin: float, limit: float) -> str:
    direction = "below" if lower_is_better(metric) else "above"
    need = f"{margin:.1%}" if lower_is_better(metric) else f"{margin:.4f} points"
    if promoted:
        return (
            f"{name} has {metric} {value:.4f} against the base model's {base:.4f}, which beats the required "
            f"margin of {need} ({direction} the threshold {limit:.4f})"
        )
    return (
        f"best checkpoint {name} has {metric} {value:.4f} but must be {direction} {limit:.4f} "
        f"(base {base:.4f} with the {need} margin): refusing to promote"
    )


def read_evaluation(path: str | Path) -> dict[str, Any]:
    """The evaluate step's evaluation.json; DataError naming the file when it is not the JSON object it wrote."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path} is missing: the evaluate step did not finish; re-run it") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DataError(f"{path}: not the JSON the evaluate step writes ({exc}); re-run the evaluate step") from None
    if not isinstance(data, dict) or not isinstance(data.get("base"), dict):
        raise DataError(f"{path}: no `base` entry: not an evaluation the evaluate step wrote; re-run it")
    return data


def promoted_destination(data_root: str | Path, model_name: str, run_id: str) -> Path:
    """``<data_root>/models/<model_name>/<run_id>``, resolved; ConfigError naming the pipeline parameter
    when either is not one plain path component or the result leaves ``<data_root>/models``."""
    check_path_component(model_name, "mlflow_model_name")
    check_path_component(run_id, "run_id")
    return path_under(Path(data_root) / MODELS_FOLDER, model_name, run_id)


def promote_to_volume(
    evaluation: dict[str, Any],
    data_root: str | Path,
    model_name: str,
    run_id: str,
    *,
    margin: float,
    metric: str = PERPLEXITY,
    max_lora_rank: int | None = None,
    guards: Sequence[tuple[str, float]] = (),
) -> PromotionDecision:
    """:func:`promote` into :func:`promoted_destination` (what the promote step calls)."""
    destination = promoted_destination(data_root, model_name, run_id)
    root = Path(data_root) / MODELS_FOLDER
    return promote(
        evaluation, destination, margin=margin, metric=metric, root=root, max_lora_rank=max_lora_rank, guards=guards
    )


def promote_step(run_plan, evaluation_dir: str | Path) -> tuple[PromotionDecision, str]:
    """The promote step's body (llmft/components/promote.py only calls it): the plan's gate over
    ``evaluation_dir``/evaluation.json, the winner copied to the volume; returns the decision and the promoted
    folder ('' when the gate refused: a decision, not a failure). With ``serving_mode=lora`` the adapter must be
    one vLLM serves (auto and merged can merge it)."""
    root, name, run_id = run_plan.layout.root, run_plan.registry.model_name, run_plan.run_id
    result = read_evaluation(Path(evaluation_dir) / "evaluation.json")  # one line naming a corrupt file
    serving = run_plan.serving
    try:
        decision = promote_to_volume(
            result,
            root,
            name,
            run_id,
            margin=run_plan.registry.promote_margin,
            metric=run_plan.registry.promote_metric,
            max_lora_rank=serving.max_lora_rank if serving.serving_mode == "lora" else None,
            guards=[(g.metric, g.tolerance) for g in run_plan.evaluation.guards],
        )
    except GateRefused as refused:
        return refused.decision, ""
    return decision, str(promoted_destination(root, name, run_id))


def write_promotion(decision: PromotionDecision, destination: str, directory: str | Path) -> dict[str, Any]:
    """promotion.json in ``directory`` (written whole or not at all); returns the artifact's KFP metadata."""
    atomic_write_json(Path(directory) / "promotion.json", decision.to_dict())
    facts = ("reason", "checkpoint", "step", "perplexity", "base_perplexity", "metric", "value", "base_value")
    return {"decision": verdict(decision), "path": destination, **{k: getattr(decision, k) for k in facts}}


def verdict(decision: PromotionDecision) -> str:
    """The step's ``decision`` output: the branch the steps after it run under."""
    return PROMOTED if decision.promoted else NOT_PROMOTED


def promote(
    evaluation: dict[str, Any],
    destination: str | Path,
    *,
    margin: float,
    metric: str = PERPLEXITY,
    root: str | Path | None = None,
    max_lora_rank: int | None = None,
    guards: Sequence[tuple[str, float]] = (),
) -> PromotionDecision:
    """Decide (by ``metric``), then copy the best checkpoint to ``destination`` atomically.

    The decision JSON is written to ``<destination>.decision.json`` in every case;
    :class:`PromotionRefused` is raised (after writing it) when nothing may be promoted.
    ``destination`` may not climb out of its folder (no ``..``); with ``root`` it must resolve
    under ``root``. Both are checked before anything is written.
    """
    destination = _checked_destination(Path(destination), root)
    decision = decide(evaluation, margin, metric, guards)
    record_path = destination.with_name(destination.name + ".decision.json")
    if not decision.promoted or decision.checkpoint_path is None:  # a promoted decision names its checkpoint
        atomic_write_json(record_path, decision.to_dict())
        raise GateRefused(f"{decision.reason} (decision recorded in {record_path})", decision)
    source = Path(decision.checkpoint_path)
    decision = PromotionDecision(**{**decision.to_dict(), "destination": str(destination)})
    copy_servable(source, destination, decision, max_lora_rank=max_lora_rank)
    atomic_write_json(record_path, decision.to_dict())
    return decision


def _checked_destination(destination: Path, root: str | Path | None) -> Path:
    if ".." in destination.parts:
        raise ConfigError(
            f"promote destination {destination} climbs out of its folder ('..'): a name used in the path is not a "
            "plain folder name; use letters, digits, '.', '_' and '-' only (check mlflow_model_name and run_id)"
        )
    if root is not None:
        base, target = Path(root).resolve(), destination.resolve()
        if base not in target.parents:
            raise ConfigError(f"promote destination {destination} resolves to {target}, outside {base}; refusing")
    return destination


def require_servable_adapter(promoted: Path, max_lora_rank: int) -> None:
    """AdapterNotServableError when the promoted copy's LoRA adapter is one vLLM (``--max-lora-rank``
    ``max_lora_rank``) would refuse; full weights are not checked here."""

    for config in (p for p in servable_files(promoted) if p.name == "adapter_config.json"):
        require_vllm_servable(config.parent, max_lora_rank=max_lora_rank)


def copy_servable(
    checkpoint: Path, destination: Path, decision: PromotionDecision, *, max_lora_rank: int | None = None
) -> list[str]:
    """Copy the servable files of ``checkpoint`` into ``destination`` (atomic, with marker). With
    ``max_lora_rank`` the copy (what register and deploy get; no optimizer state) must be an adapter
    vLLM serves, or nothing is promoted: refused before register, not when vLLM loads it at deploy."""
    if not is_complete(checkpoint):
        raise PromotionRefused(f"{checkpoint} has no COMPLETE marker: a half-written checkpoint is never promoted")
    files = servable_files(checkpoint)
    if not files:
        raise PromotionRefused(
            f"{checkpoint} holds no adapter or model weights (looked for {', '.join(SERVABLE_PATTERNS[:3])}, ...)"
        )
    with atomic_directory(destination, kind=PROMOTED_KIND, marker=True) as tmp:  # files get the umask mode
        for source in files:
            target = tmp / source.relative_to(checkpoint)
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_file(source, target, checkpoint)
        if max_lora_rank is not None:
            require_servable_adapter(tmp, max_lora_rank)
        atomic_write_json(tmp / DECISION_FILE, decision.to_dict())
    return sorted(str(f.relative_to(checkpoint)) for f in files)


def servable_files(checkpoint: Path) -> list[Path]:
    """Servable files of a checkpoint: weights, configs, tokenizer (top level or one folder down). A
    symlink, FIFO or device among them is refused (llmft/trainer/safe_files.py): nothing it points to is
    promoted; a linked folder is not entered."""
    found = []
    for path in _entries(checkpoint, depth=2):
        if any(fnmatch.fnmatch(path.name, p) for p in SERVABLE_PATTERNS):
            check_file(path, checkpoint)
            found.append(path)
    if any(p.name == "adapter_config.json" for p in found):  # LoRA: config.json is the trainer's, not a model's
        found = [p for p in found if p.name != "config.json"]
    weights = [p for p in found if p.name.endswith(".safetensors")]
    return found if weights else []


def _entries(directory: Path, depth: int) -> list[Path]:
    """Every non-directory entry up to ``depth`` levels down, sorted; links to folders are not followed."""
    found = []
    for root, dirs, files in os.walk(directory):  # followlinks=False: a linked folder is listed, not entered
        level = len(Path(root).relative_to(directory).parts) + 1
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
        found += [Path(root, name) for name in files + links]
        dirs[:] = [d for d in dirs if d not in links] if level < depth else []
    return sorted(found)
