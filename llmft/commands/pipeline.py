"""`llmft pipeline ...`: compile, run locally (kfp.local), submit, or schedule the KFP pipeline; render the
training job (render-job); delete the jobs of ended runs (janitor).

Every command takes pipeline parameters as ``key=value`` (typed by their declarations,
llmft/components/lib/plan/parameters.py; an older name still works, with a note). ``compile`` makes them the
compiled pipeline's defaults; ``submit`` and ``schedule`` compile with them too and pass the run parameters
among them as the run's arguments, so the parameters the pipeline's own tasks apply (hf_token_secret,
mlflow_secret, langfuse_secret, gpu_node_selector: never run parameters) mount what the command names.
``--minimal`` picks the minimal form (about ten run parameters; the others are compiled in). Errors reach the
CLI, which prints them as one line with their exit code. Heavy imports (kfp, the pipeline module,
mlflow) happen inside each command.

``submit`` and ``schedule`` reach a KFP API behind Kubeflow's auth proxy with a bearer token
(``--token-file`` / ``--token-env``), a browser's session cookie (``--cookie-file`` /
``--cookie-env``) or the KFP service-account token volume (``--sa-token``): kfp.Client's
``existing_token``, ``cookies`` and ``credentials``. A secret is read from a file or a variable,
never taken as an argument (it would land in shell history and process listings), never printed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import kfp_server_api  # light, but only with kfp: the pipeline extra (llmft pipeline needs it: llmft/cli.py says so)
import urllib3

from llmft.commands import janitor, render_job
from llmft.commands.pipeline_args import (
    check_compiled_eval,
    check_yaml_output,
    command_form,
    load_pipeline,
    typed_arguments,
)
from llmft.components.lib.plan.forms import Form
from llmft.katib.k8s_names import check_k8s_name
from llmft.pipelines.defaults import (
    DEFAULT_WORK_DIR,
    REAL_WORK_DIR,
    TINY_WORK_DIR,
    local_profile,
    run_arguments,
)
from llmft.pipelines.local_run import run_pipeline_locally
from llmft.pipelines.real_demo import heldout_report, learning_report, merged_answers
from llmft.trainer.errors import ConfigError, TransientError
from llmft.trainer.io import write_owned_file
from llmft.trainer.mlflow_settings import redact_credentials

CRON_FIELD = re.compile(r"^[0-9*?/,\-LW#A-Za-z]+$")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")

    compile_ = sub.add_parser("compile", help="compile the pipeline to a YAML file")
    compile_.add_argument(
        "arguments",
        nargs="*",
        metavar="key=value",
        help="parameter values of the compiled pipeline: run parameters' defaults, and the values it compiles in "
        "(e.g. mlflow_secret=llmft-mlflow: Secrets and gpu_node_selector are fixed here; with --minimal every "
        "parameter but its ten). promote_eval_tasks naming an lm-eval task prints a note: each run's plan step "
        "needs its data in the volume's eval-cache (llmft eval cache) or a reachable hub",
    )
    compile_.add_argument(
        "--output", required=True, help="YAML file to write (.yaml or .yml; atomically; new, or one llmft wrote)"
    )
    compile_.add_argument(
        "--force", action="store_true", help="replace a file (or symlink) at --output that llmft did not write"
    )
    compile_.add_argument("--hpo", action="store_true", help="compile llm_finetune_hpo_pipeline (Katib sweep) instead")
    compile_.add_argument("--minimal", action="store_true", help=MINIMAL_HELP)
    compile_.set_defaults(func=run_compile)

    local = sub.add_parser(
        "run-local",
        help="run the whole pipeline here with kfp.local (CPU): by default the real SmolLM2-135M-Instruct learns "
        "three made-up facts (short profile, `make demo`), scored base against adapter on held-out questions; "
        "shows the running task's progress line; SIGTERM stops the running task (exit 143)",
    )
    local.add_argument(
        "arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. finetune_max_steps=40)"
    )
    local.add_argument(
        "--work-dir",
        default=None,
        help="work folder, one run at a time (default runs/pipeline-local; --real: runs/pipeline-real; --tiny: "
        "runs/pipeline-tiny)",
    )
    local.add_argument("--verbose", action="store_true", help="show every task's full log, not just progress")
    local.add_argument("--hpo", action="store_true", help="run llm_finetune_hpo_pipeline (a small local sweep)")
    local.add_argument(
        "--real",
        action="store_true",
        help="a real pretrained model (SmolLM2-135M-Instruct, `llmft dev real-model`) learns the shipped made-up "
        "facts; prints whether it learned (perplexity, the served answers) and exits 1 when it did not "
        "(`make demo-real`)",
    )
    local.add_argument(
        "--tiny",
        action="store_true",
        help="the plumbing run: the project's tiny random-weight model on the sample data (seconds per step; its "
        "answers are noise, it shows only that every step runs)",
    )
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

    render_job.add_parser(sub)  # render-job: the PyTorchJob / TrainJob the train step would submit
    janitor.add_parser(sub)  # janitor: delete the jobs of runs that have ended (deploy/janitor.yaml's CronJob)


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. dataset=org/data)")
    parser.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    parser.add_argument("--experiment", default="llm-finetune", help="KFP experiment name")
    parser.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user installs)")
    parser.add_argument("--service-account", default=None, help="service account the run's pods use")
    parser.add_argument("--hpo", action="store_true", help="use llm_finetune_hpo_pipeline (Katib sweep)")
    parser.add_argument("--minimal", action="store_true", help=MINIMAL_HELP)
    auth = parser.add_argument_group(
        "authentication behind Kubeflow's auth proxy (secrets are read from a variable or a file, never taken "
        "on the command line, and never printed)"
    )
    token = auth.add_mutually_exclusive_group()
    token.add_argument("--token-env", metavar="VAR", help="bearer token from environment variable VAR")
    token.add_argument(
        "--token-file", metavar="FILE", help="bearer token from FILE (e.g. the output of `kubectl create token`)"
    )
    token.add_argument(
        "--sa-token",
        action="store_true",
        help=f"the KFP service-account token volume (${KF_SA_TOKEN_ENV}, default {KF_SA_TOKEN_PATH}), "
        "re-read by the SDK",
    )
    cookie = auth.add_mutually_exclusive_group()
    cookie.add_argument(
        "--cookie-env",
        metavar="VAR",
        help="session cookie(s) 'name=value[; name=value]' from environment variable VAR, as a logged-in browser "
        "sends them (oauth2_proxy_kubeflow=... or authservice_session=...)",
    )
    cookie.add_argument("--cookie-file", metavar="FILE", help="the session cookie(s) from FILE")


MINIMAL_HELP = (
    f"the minimal form: run parameters {', '.join(p.name for p in Form(minimal=True).offered())} only; every other "
    "value compiled in (docs/pipeline-parameters.md)"
)
KF_SA_TOKEN_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
KF_SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
"""Where kfp.client's ServiceAccountTokenVolumeCredentials reads the token (kfp/client/__init__.py)."""


def _secret_value(flag: str, source: str, *, from_file: bool, environ) -> str:
    """The secret a flag names (a variable or a file); ConfigError naming the flag, never the value."""

    if from_file:
        try:
            value = Path(source).expanduser().read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{flag} {source}: cannot read it ({exc.strerror or exc})") from None
        where = f"file {source}"
    else:
        value, where = (environ.get(source) or "").strip(), f"environment variable {source}"
    if not value:
        raise ConfigError(f"{flag} {source}: the {where} is empty or not set")
    return value


def client_auth(args: argparse.Namespace, environ=None) -> dict:
    """kfp.Client keyword arguments for the chosen credentials (``existing_token``, ``cookies`` or
    ``credentials``); empty without any (in-cluster, or a port-forward)."""

    environ = os.environ if environ is None else environ
    kwargs: dict = {}
    if getattr(args, "token_env", None):
        kwargs["existing_token"] = _secret_value("--token-env", args.token_env, from_file=False, environ=environ)
    elif getattr(args, "token_file", None):
        kwargs["existing_token"] = _secret_value("--token-file", args.token_file, from_file=True, environ=environ)
    elif getattr(args, "sa_token", False):
        path = environ.get(KF_SA_TOKEN_ENV) or KF_SA_TOKEN_PATH
        if not Path(path).is_file():
            raise ConfigError(
                f"--sa-token: no token at {path}; mount the KFP service-account token volume there or set "
                f"{KF_SA_TOKEN_ENV}, or use --token-file"
            )
        # heavy: kfp
        from kfp.client import ServiceAccountTokenVolumeCredentials

        kwargs["credentials"] = ServiceAccountTokenVolumeCredentials(path=path)
    if getattr(args, "cookie_env", None):
        kwargs["cookies"] = _secret_value("--cookie-env", args.cookie_env, from_file=False, environ=environ)
    elif getattr(args, "cookie_file", None):
        kwargs["cookies"] = _secret_value("--cookie-file", args.cookie_file, from_file=True, environ=environ)
    return kwargs


def run_compile(args: argparse.Namespace) -> int:

    # heavy: kfp
    from kfp import compiler

    check_yaml_output(args.output, force=args.force)
    arguments = typed_arguments(args)
    check_compiled_eval(arguments)  # a default every run would refuse: here, not at each run
    pipeline = load_pipeline(command_form(args), arguments)
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "pipeline.yaml"
        compiler.Compiler().compile(pipeline, package_path=str(package))
        write_owned_file(args.output, package.read_text(), command="pipeline compile", force=args.force)
    print(f"compiled {pipeline.name} to {args.output}")
    return 0


def validate_cron(expression: str) -> str:
    """KFP's cron has six fields (seconds first); a five-field Unix cron is refused with the fix."""

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
    if args.namespace is not None:
        check_k8s_name(args.namespace, "--namespace")
    # heavy: kfp
    import kfp

    try:
        return kfp.Client(host=args.host, namespace=args.namespace or "kubeflow", **client_auth(args))
    except urllib3.exceptions.HTTPError as exc:  # MaxRetryError: nothing answered the health check at --host
        reason = getattr(exc, "reason", None) or exc
        raise TransientError(
            f"--host {redact_credentials(args.host)}: the KFP API did not answer ({type(reason).__name__}: {reason}). "
            "Check the URL and that the KFP API is reachable from here (ingress, VPN or a kubectl port-forward)"
        ) from None


def _api_call(args: argparse.Namespace, fn, *a, **kw):
    """One KFP API call; a 401/403 (the auth proxy refused us) becomes a one-line ConfigError with the fix."""
    try:
        return fn(*a, **kw)
    except kfp_server_api.ApiException as exc:
        if exc.status in (401, 403):
            raise ConfigError(
                f"--host {redact_credentials(args.host)}: HTTP {exc.status} {exc.reason}: the KFP API (or Kubeflow's "
                "auth proxy in front of it) refused the request. Pass credentials: --token-env VAR / --token-file "
                "FILE (a bearer token), --cookie-env VAR / --cookie-file FILE (a logged-in browser's session cookie), "
                "or --sa-token"
            ) from None
        raise


def run_submit(args: argparse.Namespace) -> int:
    arguments, form = typed_arguments(args), command_form(args)
    check_compiled_eval(arguments)
    pipeline = load_pipeline(form, arguments)
    result = _api_call(
        args,
        _client(args).create_run_from_pipeline_func,
        pipeline,
        arguments=run_arguments(arguments, form),
        run_name=args.run_name,
        experiment_name=args.experiment,
        namespace=args.namespace,
        service_account=args.service_account,
        enable_caching=False,
    )
    print(f"submitted run {result.run_id} in experiment {args.experiment!r} on {redact_credentials(args.host)}")
    return 0


def run_schedule(args: argparse.Namespace) -> int:

    # heavy: kfp
    from kfp import compiler

    cron = validate_cron(args.cron)
    arguments, form = typed_arguments(args), command_form(args)
    check_compiled_eval(arguments)  # every scheduled run would meet these
    pipeline = load_pipeline(form, arguments)
    client = _client(args)
    experiment = _api_call(args, client.create_experiment, args.experiment, namespace=args.namespace)
    with tempfile.TemporaryDirectory() as tmp:
        package = str(Path(tmp) / "pipeline.yaml")
        compiler.Compiler().compile(pipeline, package_path=package)
        job = _api_call(
            args,
            client.create_recurring_run,
            experiment_id=experiment.experiment_id,
            job_name=args.name,
            cron_expression=cron,
            max_concurrency=args.max_concurrency,
            no_catchup=True,
            params=run_arguments(arguments, form),
            pipeline_package_path=package,
            enable_caching=False,
            service_account=args.service_account,
        )
    print(f"recurring run {args.name!r} ({job.recurring_run_id}) scheduled with cron {cron!r}")
    return 0


def run_local(args: argparse.Namespace) -> int:
    extra_defaults: dict = {}
    if args.hpo:
        # heavy: kfp, kubeflow_katib_api, pydantic
        from llmft.pipelines.llm_finetune_hpo import HPO_LOCAL_DEFAULTS

        extra_defaults = HPO_LOCAL_DEFAULTS
    real, tiny = getattr(args, "real", False), getattr(args, "tiny", False) or args.hpo
    overrides = typed_arguments(args, Form(hpo=args.hpo, local=True))
    profile, profile_defaults = local_profile(overrides, real=real, tiny=tiny)
    extra_defaults = {**extra_defaults, **profile_defaults}
    started = time.perf_counter()
    outcome = run_pipeline_locally(
        overrides,
        work_dir=args.work_dir or (REAL_WORK_DIR if real else TINY_WORK_DIR if tiny else DEFAULT_WORK_DIR),
        verbose=args.verbose,
        hpo=args.hpo,
        extra_defaults=extra_defaults,
    )
    print(outcome.render(time.perf_counter() - started))
    if outcome.stopped_by:
        print(f"error: {outcome.failure_line()}", file=sys.stderr)
        return 128 + outcome.stopped_by
    if not outcome.succeeded:
        print(f"error: {outcome.failure_line()}", file=sys.stderr)
        return 1
    if profile == "demo":  # make demo: the held-out questions, base against adapter
        lines, problems = heldout_report(outcome.facts)
        print("\n".join(lines))
        return 1 if problems else 0
    if getattr(args, "real", False):
        print("serving the merged model alone (the merged form) ...", flush=True)
        merged = merged_answers(outcome.run_dir, outcome.facts) if outcome.run_dir else None
        lines, problems = learning_report(outcome.facts, merged)
        print("\n".join(lines))
        return 1 if problems else 0
    return 0
