"""`llmft sweep ...`: Katib hyperparameter sweeps of the training step.

    llmft sweep create [--dry-run] [--output FILE [--force]] [--from-yaml FILE] [--wait] [key=value ...]
    llmft sweep status NAME [--watch]
    llmft sweep best NAME
    llmft sweep run-local --trials N [--algorithm random|tpe|grid|bayesianoptimization] [key=value ...]

``key=value`` settings of `create` and `run-local`:
- the sweep (katib.experiment.SweepSpec): name, namespace, algorithm, max_trials, parallel_trials,
  max_failed_trials, resume_policy, early_stopping, seed, ...; the search space as
  ``space.<param>.<field>=<value>`` (e.g. ``space.lora_r.values=8,16``, ``space.warmup_ratio=off``);
- the trial job (create only): ``data`` (tokenized shards on the PVC) and the pipeline parameters of
  the training job (JOB_PARAMETERS: base_model, finetune_method, volume_pvc_name, training_workers,
  training_gpus_per_worker, training_cpu, training_memory, gpu_node_selector, training_image (or image),
  volume_path, the Secrets, ...; their older names work too), built by the
  plan's own ``job_plan`` from the pipeline's defaults;
- fixed trainer settings of every trial: ``train.<key>=<value>`` (e.g. ``train.max_steps=300``).

Errors (a SweepError is an LlmftError) reach the CLI, which prints one line and exits with the
error's code (1; 200 for a wait that timed out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from llmft.commands.pipeline_args import check_yaml_output, refuse_credentials
from llmft.components.lib.cluster import Cluster
from llmft.components.lib.contracts.schema import DataLayout, Images
from llmft.components.lib.jobs.katib_sweep import DEFAULT_TRIAL_OVERRIDES, build_sweep_experiment
from llmft.components.lib.plan.build import job_plan, trainer_plan
from llmft.components.lib.plan.checks import SECRET_PARAMETERS, check_image, parse_secret
from llmft.components.lib.plan.forms import rename_note
from llmft.components.lib.plan.parameters import OLD_NAMES, PipelineParameters, parameter_defaults
from llmft.demo import sample_path
from llmft.katib import status as katib_status
from llmft.katib.errors import SweepError
from llmft.katib.experiment import GROUP, PLURAL, VERSION, SweepSpec, apply_overrides, experiment_dict
from llmft.katib.experiment_yaml import load_yaml, to_yaml
from llmft.katib.k8s_names import check_k8s_name
from llmft.katib.local_sweep import run_local_sweep
from llmft.katib.webhook_rules import check_experiment
from llmft.trainer.command_line import override_pairs
from llmft.trainer.config_load import changed_settings, split_assignment
from llmft.trainer.data.prepare import prepare_dataset
from llmft.trainer.data.tokenize import tokenize_dataset
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import is_complete, write_owned_file
from llmft.trainer.tiny_model import build_tiny_model

JOB_PARAMETERS = (
    "base_model",
    "finetune_method",
    "volume_pvc_name",
    "training_workers",
    "training_gpus_per_worker",
    "training_cpu",
    "training_memory",
    "gpu_node_selector",
    "training_image",
    "volume_path",
    "mlflow_experiment",
    "mlflow_tracking_uri",
    "hf_token_secret",
    "mlflow_secret",
    "langfuse_secret",
    "training_backend",
    "training_runtime",
)
"""Pipeline parameters `llmft sweep create` accepts for the trial job (defaults: the pipeline's)."""
ALIASES = {"image": "training_image"} | {old: new for old, new in OLD_NAMES.items() if new in JOB_PARAMETERS}
"""Other names of the job settings: ``image``, and the pipeline parameters' older names (with a note)."""
# The settings the checkout's katib/experiment_template*.yaml were rendered from (tests keep them equal).
TEMPLATE_ARGS = (
    "data=/data/tokenized/CACHE_KEY",
    "hf_token_secret=llmft-hf-token",
    "mlflow_secret=llmft-mlflow",
    "langfuse_secret=llmft-langfuse",
)
LOCAL_TRIAL_DEFAULTS = (
    "max_steps=8",
    "eval_every=4",
    "log_every=4",
    "batch.global_sequences=4",
    "eval.max_sequences=16",
    "observe.progress_bar=false",
    "observe.tensorboard=false",
)
"""Fixed trainer settings of a local trial on the tiny model (a few seconds each on a laptop CPU)."""


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    create = sub.add_parser("create", help="build (and unless --dry-run, submit) the Katib Experiment")
    create.add_argument("settings", nargs="*", metavar="key=value", help="sweep, job and train.<key> settings")
    create.add_argument("--dry-run", action="store_true", help="validate and print/write the Experiment only")
    create.add_argument(
        "--output", help="write the Experiment YAML here (.yaml or .yml; atomically; new, or one llmft wrote)"
    )
    create.add_argument(
        "--force", action="store_true", help="replace a file (or symlink) at --output that llmft did not write"
    )
    create.add_argument("--from-yaml", help="submit this (edited) Experiment YAML instead of building one")
    create.add_argument("--wait", action="store_true", help="wait for the end, then print the best key=value lines")
    _cluster_flags(create)
    create.set_defaults(func=run_create)

    status = sub.add_parser("status", help="conditions, trial counts and the best trial so far")
    status.add_argument("name", help="Experiment name")
    status.add_argument("--watch", action="store_true", help="poll until Succeeded or Failed")
    status.add_argument("--poll-seconds", type=float, default=30.0, help="poll interval of --watch")
    _cluster_flags(status)
    status.set_defaults(func=run_status)

    best = sub.add_parser("best", help="the optimal trial's hyperparameters as key=value lines")
    best.add_argument("name", help="Experiment name")
    _cluster_flags(best)
    best.set_defaults(func=run_best)

    local = sub.add_parser("run-local", help="the same search space with Optuna, trials in sequence, on this machine")
    local.add_argument("settings", nargs="*", metavar="key=value", help="sweep and train.<key> settings")
    local.add_argument("--trials", type=int, required=True, help="number of trials")
    local.add_argument(
        "--algorithm",
        choices=("random", "tpe", "grid", "bayesianoptimization"),
        default=None,
        help="suggestion algorithm (default: the sweep's, tpe)",
    )
    local.add_argument("--model", help="model directory or hub id (default: build the tiny offline model)")
    local.add_argument("--data", help="tokenized dataset dir (default: the shipped sample, prepared and tokenized)")
    local.add_argument("--workdir", default="runs/sweep-local", help="trial outputs and logs (default %(default)s)")
    local.add_argument("--timeout-seconds", type=float, default=None, help="limit per trial")
    local.set_defaults(func=run_local)


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", help="namespace (default: the pod's or the kubeconfig context's)")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", help="kubeconfig context")


def make_cluster(args: argparse.Namespace):
    """The one cluster module (tests replace this factory to inject a fake kubernetes client)."""

    if getattr(args, "namespace", None) is not None:
        check_k8s_name(args.namespace, "--namespace")
    return Cluster(
        getattr(args, "namespace", None),
        config_file=getattr(args, "kubeconfig", None),
        context=getattr(args, "context", None),
    )


# --- create -------------------------------------------------------------------------------------


def split_settings(items: list[str]) -> tuple[list[str], dict, list[str]]:
    """``key=value`` items -> (sweep overrides, job settings, fixed train overrides)."""

    sweep, job, train = [], {}, []
    for item in items:
        try:
            key, value = split_assignment(item, "max_trials=8")
        except ConfigError as exc:
            raise SweepError(str(exc)) from None
        if key in OLD_NAMES and ALIASES.get(key) == OLD_NAMES[key]:
            print(f"note: {rename_note(key)}", file=sys.stderr)
        key = ALIASES.get(key, key)
        if key.startswith("train."):
            train.append(f"{key[6:]}={value}")
        elif key == "data" or key in JOB_PARAMETERS:
            job[key] = value
        else:
            sweep.append(item)
    refuse_credentials(job)  # the trial job's env would carry it into the Experiment YAML
    return sweep, job, train


def trial_job(settings: dict, name: str):
    """(JobPlan, parameters) of the trials: the pipeline's defaults with ``settings`` over them, through
    the plan's own job builder (so a trial gets what the pipeline's trials get)."""
    defaults = parameter_defaults()
    values = dict(defaults)
    for key, raw in settings.items():
        kind = type(defaults[key])
        try:
            values[key] = kind(raw)
        except ValueError:
            raise SweepError(f"{key}={raw}: expected {kind.__name__}") from None
    p = PipelineParameters.from_values(values)
    images = Images(trainer=check_image(p.training_image), serving_runtime=p.serving_runtime)
    secrets = {kind: parse_secret(kind, getattr(p, param)) for kind, param in SECRET_PARAMETERS.items()}
    return job_plan(p, DataLayout(p.volume_path), name, images, secrets), p


def build_from_settings(items: list[str]):
    """The Experiment (typed model) for ``llmft sweep create key=value ...``; its trials start from the
    trainer config the pipeline's plan would resolve from the same parameters. No plan step writes a
    config.yaml on the volume here, so the trials carry its non-default settings as key=value."""
    sweep_items, job, train = split_settings(items)
    spec = apply_overrides(SweepSpec(), sweep_items)
    fixed = dict(override_pairs((*DEFAULT_TRIAL_OVERRIDES, *train)))  # a later key wins
    data = job.pop("data", "")
    plan_job, p = trial_job(job, spec.name)
    config = trainer_plan(p, DataLayout(p.volume_path), spec.name).config
    return build_sweep_experiment(
        spec,
        job=plan_job,
        data=data,
        settings=changed_settings(config),
        fixed_overrides=[f"{k}={v}" for k, v in fixed.items()],
        mlflow_experiment=job.get("mlflow_experiment", ""),
    )


def run_create(args: argparse.Namespace) -> int:
    if args.output:
        check_yaml_output(args.output, force=args.force)  # before any work: the file is not ours -> one line
    if args.from_yaml:
        if args.settings:
            raise SweepError("--from-yaml submits the file as it is; edit the file instead of passing key=value")
        body = load_yaml(args.from_yaml)
    else:
        body = experiment_dict(build_from_settings(args.settings))
    check_experiment(body)
    text = to_yaml(body, header="Katib Experiment built by `llmft sweep create`; apply with kubectl apply -f")
    if args.output:
        write_owned_file(args.output, text, command="sweep create", force=args.force)
        print(f"wrote {args.output}")
    if args.dry_run:
        if not args.output:
            print(text, end="")
        print(
            f"dry run: Experiment {body['metadata']['name']} passes Katib's admission rules; nothing submitted",
            file=sys.stderr,
        )
        return 0
    return _submit(args, body)


def _submit(args: argparse.Namespace, body: dict) -> int:
    cluster = make_cluster(args)
    namespace = args.namespace or body["metadata"].get("namespace") or cluster.namespace
    name = body["metadata"]["name"]
    katib_status.submit(cluster, body, namespace=namespace)
    print(
        f"created Experiment {namespace}/{name} (the namespace needs the label "
        "katib.kubeflow.org/metrics-collector-injection=enabled for metrics to be collected)"
    )
    if not args.wait:
        print(f"follow it with: llmft sweep status {name} --watch")
        return 0
    katib_status.wait(cluster, name, namespace, on_update=lambda s: print(s.summary(), flush=True))
    return _print_best(cluster, name, namespace)


# --- status / best -----------------------------------------------------------------------------


def run_status(args: argparse.Namespace) -> int:
    cluster = make_cluster(args)
    namespace = args.namespace or cluster.namespace
    if args.watch:
        state = katib_status.wait(
            cluster,
            args.name,
            namespace,
            poll_s=args.poll_seconds,
            on_update=lambda s: print(s.summary() + "\n", flush=True),
        )
        return 0 if state.phase == "Succeeded" else 1
    state = katib_status.get_state(cluster, args.name, namespace)
    print(state.summary())
    return 1 if state.phase == "Failed" else 0


def run_best(args: argparse.Namespace) -> int:
    cluster = make_cluster(args)
    return _print_best(cluster, args.name, args.namespace or cluster.namespace)


def _print_best(cluster, name: str, namespace: str) -> int:
    for line in katib_status.best_overrides(
        cluster.get_custom_object(GROUP, VERSION, PLURAL, name, namespace=namespace)
    ):
        print(line)
    return 0


# --- run-local ---------------------------------------------------------------------------------


def run_local(args: argparse.Namespace) -> int:
    sweep_items, job, train = split_settings(args.settings)
    if job:
        raise SweepError(f"{', '.join(job)}: cluster job settings do not apply to run-local; use --model/--data")
    if args.algorithm:
        sweep_items.append(f"algorithm={args.algorithm}")
    spec = apply_overrides(SweepSpec(name="local-sweep"), sweep_items)
    workdir = Path(args.workdir)
    model, data = local_inputs(workdir, args.model, args.data)
    fixed = dict(override_pairs((*LOCAL_TRIAL_DEFAULTS, *train)))  # a later key wins
    trainer_args = [f"model.name_or_path={model}", f"data={data}", *[f"{k}={v}" for k, v in fixed.items()]]
    print(f"local sweep: {args.trials} trials, algorithm {spec.algorithm}, model {model}, data {data}")
    result = run_local_sweep(
        spec,
        trials=args.trials,
        trainer_args=trainer_args,
        workdir=workdir / "trials",
        timeout_s=args.timeout_seconds,
    )
    print(result.table())
    print(f"trial folders and logs: {result.run_dir}")
    if result.parent_run_id:
        print(f"MLflow parent run: {result.parent_run_id}")
    return 0 if result.best is not None else 1


def local_inputs(workdir: Path, model: str | None, data: str | None) -> tuple[str, str]:
    """The model and tokenized data of a local sweep: given, or built once under ``workdir`` (tiny model,
    shipped sample data prepared and tokenized; a re-run is a cache hit)."""

    if model is None:
        model_dir = workdir / "tiny-model"
        if not (model_dir / "config.json").is_file():
            build_tiny_model(model_dir)
        model = str(model_dir)
    if data is None:
        sample = sample_path("alpaca_demo")
        prepared = workdir / "prepared"
        if not is_complete(prepared):
            prepare_dataset(str(sample), prepared)
        tokenized = workdir / "tokenized"
        tokenize_dataset(prepared, model, tokenized, max_length=256, pack=True)
        data = str(tokenized)
    return model, data
