"""`llmft pipeline ...`: compile, run locally (kfp.local), submit, or schedule the KFP pipeline.

Every command takes pipeline parameters as ``key=value`` (typed by the plan component's signature).
``compile`` makes them the compiled pipeline's defaults; ``submit`` and ``schedule`` pass them as
the run's arguments and compile with them too, so the parameters the pipeline's own tasks apply
(hf_token_secret, mlflow_secret, gpu_node_selector) mount what the run names. Errors reach the
CLI, which prints them as one line with their exit code. Heavy imports (kfp, the pipeline module,
mlflow) happen inside each command.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

CRON_FIELD = re.compile(r"^[0-9*?/,\-LW#A-Za-z]+$")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    compile_ = sub.add_parser("compile", help="compile the pipeline to a YAML file")
    compile_.add_argument(
        "arguments",
        nargs="*",
        metavar="key=value",
        help="parameter defaults of the compiled pipeline (e.g. "
        "mlflow_secret=llmft-mlflow); Secrets and gpu_node_selector are fixed here",
    )
    compile_.add_argument("--output", required=True, help="YAML file to write")
    compile_.add_argument("--hpo", action="store_true", help="compile llm_finetune_hpo_pipeline (Katib sweep) instead")
    compile_.set_defaults(func=run_compile)

    local = sub.add_parser("run-local", help="run the whole pipeline here with kfp.local (tiny model, CPU)")
    local.add_argument("arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. max_steps=40)")
    local.add_argument("--work-dir", default=None, help="work folder (default runs/pipeline-local)")
    local.add_argument("--verbose", action="store_true", help="show every task's full log, not just progress")
    local.add_argument("--hpo", action="store_true", help="run llm_finetune_hpo_pipeline (a small local sweep)")
    local.set_defaults(func=run_local)

    submit = sub.add_parser("submit", help="start a run on a KFP endpoint (create_run_from_pipeline_func)")
    _cluster_arguments(submit)
    submit.add_argument("--run-name", default=None, help="run name (default: generated)")
    submit.set_defaults(func=run_submit)

    schedule = sub.add_parser("schedule", help="create a recurring run (KFP cron: six fields, seconds first)")
    _cluster_arguments(schedule)
    schedule.add_argument(
        "--cron", required=True, help='six-field cron, seconds first, e.g. "0 0 3 * * *" = daily 03:00'
    )
    schedule.add_argument("--name", default="llm-finetune-nightly", help="recurring run name")
    schedule.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule at once")
    schedule.set_defaults(func=run_schedule)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. dataset=org/data)")
    parser.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    parser.add_argument("--experiment", default="llm-finetune", help="KFP experiment name")
    parser.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user installs)")
    parser.add_argument("--service-account", default=None, help="service account the run's pods use")
    parser.add_argument("--hpo", action="store_true", help="use llm_finetune_hpo_pipeline (Katib sweep)")


def _pipeline(hpo: bool, defaults: dict | None = None):
    """The pipeline (GraphComponent); with ``defaults``, built with them as parameter defaults."""
    from llmft.trainer.errors import ConfigError

    try:
        from llmft.pipelines.llm_finetune import build_pipeline, llm_finetune_pipeline
        from llmft.pipelines.llm_finetune_hpo import llm_finetune_hpo_pipeline
    except ImportError as exc:
        raise ConfigError(f"cannot import the pipelines ({exc}); install the `pipeline` extra") from None
    if defaults:
        return build_pipeline(hpo=hpo, defaults=defaults)
    return llm_finetune_hpo_pipeline if hpo else llm_finetune_pipeline


def _arguments(args: argparse.Namespace) -> dict:
    """The ``key=value`` arguments, typed by the pipeline's parameters."""
    from llmft.pipelines.defaults import parse_arguments

    return parse_arguments(args.arguments, _pipeline(args.hpo))


def run_compile(args: argparse.Namespace) -> int:
    from kfp import compiler

    pipeline = _pipeline(args.hpo, _arguments(args))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, package_path=args.output)
    print(f"compiled {pipeline.name} to {args.output}")
    return 0


def validate_cron(expression: str) -> str:
    """KFP's cron has six fields (seconds first); a five-field Unix cron is refused with the fix."""
    from llmft.trainer.errors import ConfigError

    fields = expression.split()
    if len(fields) == 5:
        raise ConfigError(
            f"--cron {expression!r} has 5 fields, but KFP cron expressions have six, seconds first. "
            f'Did you mean "0 {expression}"?'
        )
    if len(fields) != 6:
        raise ConfigError(
            f"--cron {expression!r} has {len(fields)} fields; KFP needs six: "
            'second minute hour day-of-month month day-of-week (e.g. "0 0 3 * * *")'
        )
    bad = [f for f in fields if not CRON_FIELD.match(f)]
    if bad:
        raise ConfigError(f"--cron {expression!r}: field(s) {bad} are not cron syntax (digits, * , - / ?)")
    return " ".join(fields)


def _client(args: argparse.Namespace):
    import kfp
    import urllib3

    from llmft.trainer.errors import TransientError

    try:
        return kfp.Client(host=args.host, namespace=args.namespace or "kubeflow")
    except urllib3.exceptions.HTTPError as exc:  # MaxRetryError: nothing answered the health check at --host
        reason = getattr(exc, "reason", None) or exc
        raise TransientError(
            f"--host {args.host}: the KFP API did not answer ({type(reason).__name__}: {reason}). Check the URL "
            "and that the KFP API is reachable from here (ingress, VPN or a kubectl port-forward)"
        ) from None


def run_submit(args: argparse.Namespace) -> int:
    arguments = _arguments(args)
    pipeline = _pipeline(args.hpo, arguments)
    result = _client(args).create_run_from_pipeline_func(
        pipeline,
        arguments=arguments,
        run_name=args.run_name,
        experiment_name=args.experiment,
        namespace=args.namespace,
        service_account=args.service_account,
        enable_caching=False,
    )
    print(f"submitted run {result.run_id} in experiment {args.experiment!r} on {args.host}")
    return 0


def run_schedule(args: argparse.Namespace) -> int:
    import tempfile

    from kfp import compiler

    cron = validate_cron(args.cron)
    arguments = _arguments(args)
    pipeline = _pipeline(args.hpo, arguments)
    client = _client(args)
    experiment = client.create_experiment(args.experiment, namespace=args.namespace)
    with tempfile.TemporaryDirectory() as tmp:
        package = str(Path(tmp) / "pipeline.yaml")
        compiler.Compiler().compile(pipeline, package_path=package)
        job = client.create_recurring_run(
            experiment_id=experiment.experiment_id,
            job_name=args.name,
            cron_expression=cron,
            max_concurrency=args.max_concurrency,
            no_catchup=True,
            params=arguments,
            pipeline_package_path=package,
            enable_caching=False,
            service_account=args.service_account,
        )
    print(f"recurring run {args.name!r} ({job.recurring_run_id}) scheduled with cron {cron!r}")
    return 0


def run_local(args: argparse.Namespace) -> int:
    from llmft.pipelines.defaults import DEFAULT_WORK_DIR
    from llmft.pipelines.local_run import run_pipeline_locally

    pipeline = _pipeline(args.hpo)
    extra_defaults = {}
    if args.hpo:
        from llmft.pipelines.llm_finetune_hpo import HPO_LOCAL_DEFAULTS as extra_defaults
    overrides = _arguments(args)
    started = time.perf_counter()
    outcome = run_pipeline_locally(
        overrides,
        work_dir=args.work_dir or DEFAULT_WORK_DIR,
        verbose=args.verbose,
        pipeline=pipeline,
        extra_defaults=extra_defaults,
    )
    print(outcome.render(time.perf_counter() - started))
    return 0 if outcome.succeeded else 1
