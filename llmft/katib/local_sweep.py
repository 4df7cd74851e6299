"""The same sweep on this machine: Optuna samplers, trials in sequence, the real trainer.

Katib 0.19 answers grid with its Optuna service (``GridSampler``), random and tpe with its
Hyperopt service, bayesianoptimization with scikit-optimize's Gaussian process. This module
uses Optuna samplers of the same algorithm family, configured like those services (see
:func:`make_sampler`), on the same ``spec.parameters`` models the Experiment carries, each
parameter mapped to an Optuna distribution the way Katib's Optuna service maps it.

Each trial runs the trainer as a subprocess (``python -m llmft train ...`` with the
trial's overrides), stdout and stderr merged the way Katib's StdOut collector
captures them, and is parsed with the collector's own filter
(:mod:`llmft.katib.metrics`). A trial that exits non-zero is Failed; one that exits 0
without reporting the objective is MetricsUnavailable (both count against
``max_failed_trials``, as in Katib).

With ``MLFLOW_TRACKING_URI`` set, the sweep is one MLflow parent run and every
trial's trainer gets ``LLMFT_MLFLOW_PARENT_RUN_ID`` so its own run is a child.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from llmft.katib import search_space as ss
from llmft.katib.errors import ExperimentFailed, SweepError
from llmft.katib.experiment import SweepSpec, algorithm_settings, objective_spec
from llmft.katib.metrics import METRICS_FILTER, parse_metric_lines, summarize
from llmft.katib.tracking import PARENT_RUN_ENV, ParentRun  # noqa: F401 - PARENT_RUN_ENV re-exported
from llmft.trainer.command_line import format_overrides, override_pairs, train_arguments

LOCAL_ALGORITHMS = ("random", "tpe", "grid", "bayesianoptimization")


@dataclass
class TrialResult:
    """One finished local trial."""

    number: int
    """0-based trial index."""
    assignments: dict[str, str]
    """Katib parameter name -> value (as Katib would substitute it)."""
    overrides: list[str]
    """The trainer arguments those values became (``config_key=value``)."""
    status: str
    """Succeeded, Failed or MetricsUnavailable."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Each metric reduced by its strategy (eval_loss: min over the evals)."""
    seconds: float = 0.0
    """Wall time of the trial."""
    log_path: str = ""
    """The trial's captured stdout+stderr."""


@dataclass
class LocalSweepResult:
    """All trials, and the best by the objective."""

    objective: str
    """The objective metric (lower is better)."""
    trials: list[TrialResult]
    """Every trial run, in order."""
    parent_run_id: str | None = None
    """The MLflow parent run (None without MLFLOW_TRACKING_URI)."""
    run_dir: str = ""
    """This sweep's folder: trial-NNN/ (trainer output_dir) and trial-NNN.log per trial."""

    @property
    def best(self) -> TrialResult | None:
        done = [t for t in self.trials if t.status == "Succeeded" and self.objective in t.metrics]
        return min(done, key=lambda t: t.metrics[self.objective], default=None)

    def table(self) -> str:
        """A plain-text table of trials, then the best trial's overrides."""
        names = list(self.trials[0].assignments) if self.trials else []
        metrics = sorted({m for t in self.trials for m in t.metrics}, key=lambda m: (m != self.objective, m))
        header = ["trial", "status", *metrics, *names, "seconds"]
        rows = [
            [
                str(t.number),
                t.status,
                *[f"{t.metrics[m]:.6g}" if m in t.metrics else "-" for m in metrics],
                *[_short(t.assignments[n]) for n in names],
                f"{t.seconds:.1f}",
            ]
            for t in self.trials
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
        best = self.best
        if best is None:
            lines.append(f"no trial reported {self.objective}")
        else:
            lines.append(f"best: trial {best.number} {self.objective}={best.metrics[self.objective]:.6g}")
            lines.extend(f"  {o}" for o in best.overrides)
        return "\n".join(lines)


def _short(value: str) -> str:
    try:
        number = float(value)
    except ValueError:
        return value
    return value if number.is_integer() and "." not in value and "e" not in value.lower() else f"{number:.4g}"


# --- Katib's parameter -> Optuna mapping -------------------------------------------------------


def optuna_distributions(parameters) -> dict:
    """``{name: optuna distribution}`` for ``V1beta1ParameterSpec`` models, as Katib's Optuna service maps them."""
    # heavy: optuna
    import optuna

    dists: dict[str, optuna.distributions.BaseDistribution] = {}
    for p in parameters:
        space, ptype = p.feasible_space, p.parameter_type
        step = space.step or None
        log = space.distribution == "logUniform"
        if ptype == "int":
            dists[p.name] = optuna.distributions.IntDistribution(
                low=max(1, int(space.min)) if log else int(space.min),
                high=int(space.max),
                log=log,
                step=1 if log else int(step or 1),
            )
        elif ptype == "double":
            dists[p.name] = optuna.distributions.FloatDistribution(
                low=max(1e-10, float(space.min)) if log else float(space.min),
                high=float(space.max),
                log=log,
                step=None if log or not step else float(step),
            )
        elif ptype in ("categorical", "discrete"):
            dists[p.name] = optuna.distributions.CategoricalDistribution(list(space.list))
        else:
            raise SweepError(f"parameter {p.name}: type {ptype!r} has no Optuna distribution")
    return dists


def grid_combinations(parameters) -> dict[str, list]:
    """The grid per parameter, as Katib's ``convert_to_combinations`` builds it."""
    combos: dict[str, list] = {}
    for p in parameters:
        space, ptype = p.feasible_space, p.parameter_type
        if ptype == "int":
            combos[p.name] = list(range(int(space.min), int(space.max) + 1, int(space.step or 1)))
        elif ptype == "double":
            if not space.step:
                raise SweepError(f"grid: parameter {p.name} is a double without a step; give it a step or a list")
            low, high, step = float(space.min), float(space.max), float(space.step)
            count = int((high - low) // step) + 1
            combos[p.name] = [low + i * step for i in range(count) if low + i * step <= high]
        else:
            combos[p.name] = list(space.list)
    return combos


def make_sampler(algorithm: str, settings: Mapping[str, str], parameters, *, startup_trials: int = 1):
    """The Optuna sampler for a Katib algorithm name and its algorithmSettings.

    random: independent draws per parameter (what hyperopt.rand does for Katib's random).
    tpe: configured like Katib's Hyperopt TPE service: ``startup_trials`` random trials first
    (Katib passes n_startup_jobs = the trials requested at once, i.e. parallelTrialCount),
    n_EI_candidates, and, when the Experiment sets them, hyperopt's gamma (good-trial split
    ceil(gamma * sqrt(n))) and prior_weight. grid: the GridSampler Katib's Optuna service uses, on
    Katib's grid. bayesianoptimization: Optuna's Gaussian-process sampler in place of skopt's GP.
    """
    # heavy: optuna
    import optuna

    seed = int(settings["random_state"]) if "random_state" in settings else None
    if algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if algorithm == "tpe":
        kwargs: dict = {}
        if "gamma" in settings:  # hyperopt's split of good trials: ceil(gamma * sqrt(n))
            gamma = float(settings["gamma"])
            kwargs["gamma"] = lambda n: min(int(math.ceil(gamma * math.sqrt(n))), 25)
        if "prior_weight" in settings:
            kwargs["prior_weight"] = float(settings["prior_weight"])
        with warnings.catch_warnings():  # Optuna >= 4.9 deprecates gamma/prior_weight; used only when set
            warnings.simplefilter("ignore", FutureWarning)
            return optuna.samplers.TPESampler(
                seed=seed,
                n_startup_trials=startup_trials,
                constant_liar=False,
                n_ei_candidates=int(settings.get("n_EI_candidates", 24)),
                **kwargs,
            )
    if algorithm == "grid":
        return optuna.samplers.GridSampler(grid_combinations(parameters), seed=seed)
    if algorithm == "bayesianoptimization":
        startup = int(settings.get("n_initial_points", 10))
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    raise SweepError(f"algorithm {algorithm!r} has no local sampler; use one of {', '.join(LOCAL_ALGORITHMS)}")


# --- the sweep -------------------------------------------------------------------------------------


def run_local_sweep(
    spec: SweepSpec,
    *,
    trials: int,
    trainer_args: Sequence[str],
    workdir: str | Path,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    echo: Callable[[str], None] = print,
    mlflow_experiment: str = "",
    config_path: str | None = None,
    mlflow_tags: Mapping[str, str] | None = None,
) -> LocalSweepResult:
    """Run ``trials`` trials of ``spec``'s search space in sequence; the best is ``result.best``.

    ``config_path``: the trainer config every trial starts from (``llmft train --config``; the HPO
    pipeline's: the plan's config.yaml). ``trainer_args`` are the fixed trainer overrides of every
    trial (model, data, steps, ...); each trial adds ``output_dir=<workdir>/<name>-<timestamp>/trial-NNN``
    and its sampled overrides. ``mlflow_tags``: more tags of the sweep's MLflow parent run (the HPO pipeline nests it
    under the pipeline run's)."""
    # heavy: optuna
    import optuna

    spec.check()
    if trials < 1:
        raise SweepError(f"--trials {trials}: run at least one trial")
    parameters = ss.parameter_specs(spec.search_space, spec.algorithm)
    _check_grid_size(spec, parameters, trials)
    settings = {s.name: s.value for s in algorithm_settings(spec)}
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # each trial's outcome is echoed below
    sampler = make_sampler(spec.algorithm, settings, parameters, startup_trials=spec.parallel_trials)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    run_dir = _fresh_run_dir(Path(workdir), spec.name)
    params = {
        "algorithm": spec.algorithm,
        "trials": trials,
        "objective": spec.objective_metric,
        "search_space": json.dumps([p.override() for p in spec.search_space]),
    }
    tags = {"llmft.sweep.algorithm": spec.algorithm, **(mlflow_tags or {})}
    with ParentRun(f"sweep-{spec.name}", mlflow_experiment, params=params, tags=tags) as parent:
        # resume=never first (the caller's args may override it): a trial never picks up old checkpoints
        fixed = [("resume", "never"), *override_pairs(trainer_args)]
        command = [
            python,
            "-m",
            "llmft",
            *train_arguments(config_path=config_path and str(config_path), overrides=fixed),
        ]
        sweep = _Sweep(
            spec,
            optuna_distributions(parameters),
            command,
            run_dir,
            {**(env or {}), **parent.env()},
            timeout_s,
            echo,
            parent,
        )
        try:
            study.optimize(sweep.objective, n_trials=trials)
        finally:  # a failed sweep still leaves its record
            _write_trials(sweep.result, run_dir, Path(workdir))
        _log_parent_best(parent, sweep.result, run_dir)
    return sweep.result


class _Sweep:
    """State of one local sweep; :meth:`objective` runs one trial for Optuna."""

    def __init__(self, spec, dists, base_command, workdir, env, timeout_s, echo, parent: ParentRun):
        self.spec, self.dists, self.base_command, self.workdir = spec, dists, base_command, workdir
        self.env, self.timeout_s, self.echo, self.parent = env, timeout_s, echo, parent
        self.keys = {p.name: p.config_key for p in spec.search_space}
        self.strategies = {s.name: s.value for s in objective_spec(spec).metric_strategies}
        self.result = LocalSweepResult(
            objective=spec.objective_metric, trials=[], parent_run_id=parent.run_id, run_dir=str(workdir)
        )

    def objective(self, trial) -> float:
        number, objective = trial.number, self.spec.objective_metric
        assignments = {name: str(_suggest(trial, name, dist)) for name, dist in self.dists.items()}
        overrides = format_overrides((self.keys[n], v) for n, v in assignments.items())
        trial_dir = ("output_dir", self.workdir / f"trial-{number:03d}")
        command = [*self.base_command, *format_overrides([trial_dir]), *overrides]
        self.echo(f"[trial {number}] {' '.join(overrides)}")
        outcome = _run_trial(number, command, self.workdir, self.env, self.timeout_s, self.strategies, objective)
        outcome.assignments, outcome.overrides = assignments, overrides
        self.result.trials.append(outcome)
        self.echo(f"[trial {number}] {outcome.status} " + " ".join(f"{k}={v:.6g}" for k, v in outcome.metrics.items()))
        if objective in outcome.metrics:
            self.parent.log_metric(f"trial_{objective}", outcome.metrics[objective], step=number)
        failed = sum(t.status != "Succeeded" for t in self.result.trials)
        if failed > self.spec.max_failed_trials:
            raise ExperimentFailed(
                f"{failed} trials failed (max_failed_trials={self.spec.max_failed_trials}); "
                f"logs under {self.workdir}\n{self.result.table()}",
                self.result,
            )
        if outcome.status != "Succeeded":
            return float("nan")  # Optuna records a FAIL trial; the sweep goes on
        return outcome.metrics[objective]


def _fresh_run_dir(workdir: Path, name: str) -> Path:
    """``<workdir>/<name>-<timestamp>``: every sweep gets its own trial folders."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        candidate = workdir / (f"{name}-{stamp}" + (f"-{attempt}" if attempt else ""))
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue
    raise SweepError(f"{workdir}: could not create a fresh sweep folder")


def _suggest(trial, name: str, dist):
    """Ask the sampler for one value of ``dist`` through Optuna's public API."""
    # heavy: optuna
    import optuna

    if isinstance(dist, optuna.distributions.FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, optuna.distributions.IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_categorical(name, dist.choices)


def _check_grid_size(spec: SweepSpec, parameters, trials: int) -> None:
    if spec.algorithm != "grid":
        return
    size = 1
    for values in grid_combinations(parameters).values():
        size *= len(values)
    if trials > size:
        raise SweepError(
            f"--trials {trials} > the {size} grid combinations (Katib's grid service refuses the same); "
            "lower --trials or add grid values (space.<name>.grid=...)"
        )


def _run_trial(number, command, workdir, env, timeout_s, strategies, objective) -> TrialResult:
    trial_env = {**os.environ, **env}
    log_path = workdir / f"trial-{number:03d}.log"
    start = time.monotonic()
    try:
        proc = subprocess.run(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=trial_env,
            timeout=timeout_s,
            check=False,
        )
        output, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""), -9
    seconds = time.monotonic() - start
    log_path.write_text(output, encoding="utf-8")
    metrics = summarize(parse_metric_lines(output, list(strategies), METRICS_FILTER), strategies)
    status = "Failed" if rc != 0 else ("Succeeded" if objective in metrics else "MetricsUnavailable")
    return TrialResult(
        number=number,
        assignments={},
        overrides=[],
        status=status,
        metrics=metrics,
        seconds=seconds,
        log_path=str(log_path),
    )


def _write_trials(result: LocalSweepResult, run_dir: Path, workdir: Path) -> None:
    """``trials.json`` in the sweep's folder, and a copy at ``<workdir>/trials.json`` (the latest sweep)."""
    text = json.dumps([dataclasses.asdict(t) for t in result.trials], indent=2) + "\n"
    for path in (run_dir / "trials.json", workdir / "trials.json"):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)


def _log_parent_best(parent: ParentRun, result: LocalSweepResult, run_dir: Path) -> None:
    if parent.run_id is None:
        return
    parent.log_artifact(str(run_dir / "trials.json"))
    best = result.best
    if best is not None:
        parent.log_metric(f"best_{result.objective}", best.metrics[result.objective])
        parent.log_params({f"best.{key}": value for key, value in override_pairs(best.overrides)})
