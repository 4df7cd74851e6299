"""The commands of `llmft pipeline` (its command line: llmft/commands/pipeline.py): compile, run locally
(kfp.local), submit, wait for, or schedule the KFP pipeline.

This module imports the ``pipeline`` extra's light packages (kfp_server_api, urllib3) at module level; the command
line imports it only when a command runs. Errors reach the CLI, which prints them as one line with their exit
code. Heavy imports (kfp, the pipeline module, mlflow) happen inside each command. kfp.Client's own output (its
FutureWarning about server versions, its "Experiment details:" / "Run details:" prints) is kept off the screen:
submit prints the run's id and UI link itself, once.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import sys
import tempfile
import time
import warnings
from pathlib import Path

import kfp_server_api  # light, but only with kfp: the pipeline extra (llmft pipeline needs it: llmft/cli.py says so)
import urllib3

from llmft.commands.pipeline_args import (
    KF_SA_TOKEN_ENV,
    KF_SA_TOKEN_PATH,
    UI_ENDPOINT_ENV,
    check_compiled_eval,
    check_yaml_output,
    command_form,
    load_pipeline,
    typed_arguments,
)
from llmft.commands.pipeline_wait import RunLink, run_url, wait_for_run
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
        with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
            warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")  # kfp/client/client.py line 159
            return kfp.Client(host=args.host, namespace=args.namespace or "kubeflow", **client_auth(args))
    except urllib3.exceptions.HTTPError as exc:  # MaxRetryError: nothing answered the health check at --host
        reason = getattr(exc, "reason", None) or exc
        raise TransientError(
            f"--host {redact_credentials(args.host)}: the KFP API did not answer ({type(reason).__name__}: {reason}). "
            "Check the URL and that the KFP API is reachable from here (ingress, VPN or a kubectl port-forward)"
        ) from None


def _api_call(args: argparse.Namespace, fn, *a, **kw):
    """One KFP API call; a 401/403 (the auth proxy refused us) becomes a one-line ConfigError with the fix.
    What kfp.Client prints itself ("Experiment details: ...", "Run details: ...") is swallowed: the command says
    what it did in its own words."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
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
    check_compiled_eval(arguments)  # every run (or scheduled run) would meet these
    pipeline = load_pipeline(form, arguments)
    client = _client(args)
    result = _api_call(
        args,
        client.create_run_from_pipeline_func,
        pipeline,
        arguments=run_arguments(arguments, form),
        run_name=args.run_name,
        experiment_name=args.experiment,
        namespace=args.namespace,
        service_account=args.service_account,
        enable_caching=False,
    )
    link = run_link(args, result.run_id)
    print(f"submitted run {result.run_id} in experiment {args.experiment!r} on {redact_credentials(args.host)}")
    print(f"  run details: {link.url}", flush=True)
    if args.wait:
        _wait(args, client, link)
    return 0


def run_wait(args: argparse.Namespace) -> int:
    """``llmft pipeline wait RUN_ID``: exit 0 when the run SUCCEEDED, 1 when it did not (or --timeout passed)."""
    _wait(args, _client(args), run_link(args, args.run_id))
    return 0


def _wait(args: argparse.Namespace, client, link: RunLink) -> None:
    """Until the run ends (llmft/commands/pipeline_wait.py): returns when it SUCCEEDED, raises (exit 1) otherwise."""
    wait_for_run(
        lambda run_id: _api_call(args, client.get_run, run_id),
        link,
        timeout_s=args.timeout,
        poll_s=args.poll_interval,
    )
    print(f"run {link.run_id} SUCCEEDED: {link.url}")


def run_link(args: argparse.Namespace, run_id: str) -> RunLink:
    """The run's UI page: --ui-host, else $KF_PIPELINES_UI_ENDPOINT, else --host (kfp.Client's own rule, kfp 2.17.3
    kfp/client/client.py line 165), and the command that waits for it again."""
    ui_base = args.ui_host or os.environ.get(UI_ENDPOINT_ENV) or args.host
    again = ["llmft", "pipeline", "wait", run_id, "--host", redact_credentials(args.host)]
    if args.namespace:
        again += ["--namespace", args.namespace]
    for name in ("token_env", "token_file", "cookie_env", "cookie_file"):  # where the secret is, never the secret
        if getattr(args, name, None):
            again += [f"--{name.replace('_', '-')}", getattr(args, name)]
    if getattr(args, "sa_token", False):
        again.append("--sa-token")
    return RunLink(run_id=run_id, url=run_url(ui_base, run_id), wait_again=f"Wait again: {shlex.join(again)}")


def run_schedule(args: argparse.Namespace) -> int:

    # heavy: kfp
    from kfp import compiler

    cron = validate_cron(args.cron)
    arguments, form = typed_arguments(args), command_form(args)
    check_compiled_eval(arguments)  # every run (or scheduled run) would meet these
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
        # heavy: kfp
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
