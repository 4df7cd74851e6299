"""`llmft pipeline ...`: compile, run locally (kfp.local), submit, wait for, or schedule the KFP pipeline; render the
training job (render-job); delete the jobs of ended runs (janitor).

This module is the command line only: it imports nothing of the ``pipeline`` extra, so ``llmft pipeline --help``
(and every sub-command's ``--help``) works in an install without it, and says so. The commands themselves are
in llmft/commands/pipeline_run.py and llmft/commands/render_job.py, imported when one runs; without the extra,
that is one line naming the package and the extra (exit 1).

Every command takes pipeline parameters as ``key=value`` (typed by their declarations,
llmft/components/lib/plan/parameters.py; an older name still works, with a note). ``compile`` makes them the
compiled pipeline's defaults; ``submit`` and ``schedule`` compile with them too and pass the run parameters
among them as the run's arguments, so the parameters the pipeline's own tasks apply (hf_token_secret,
mlflow_secret, langfuse_secret, s3_secret, gpu_node_selector: never run parameters) mount what the command names.
``--minimal`` picks the minimal form (a few run parameters; the others are compiled in).

``submit``, ``wait`` and ``schedule`` reach a KFP API behind Kubeflow's auth proxy with a bearer token
(``--token-file`` / ``--token-env``), a browser's session cookie (``--cookie-file`` /
``--cookie-env``) or the KFP service-account token volume (``--sa-token``): kfp.Client's
``existing_token``, ``cookies`` and ``credentials``. A secret is read from a file or a variable,
never taken as an argument (it would land in shell history and process listings), never printed.
"""

from __future__ import annotations

import argparse
import importlib.util
from types import ModuleType

from llmft.commands.pipeline_args import KF_SA_TOKEN_ENV, KF_SA_TOKEN_PATH, UI_ENDPOINT_ENV
from llmft.components.lib.plan.forms import Form
from llmft.trainer.errors import ConfigError
from llmft.trainer.failures import Teller, missing_package

EXTRA = "pipeline"
EXTRA_PACKAGES = ("kfp", "kfp_server_api", "urllib3", "kubernetes")
"""What the commands import from the ``pipeline`` extra (checked with find_spec, which imports nothing)."""
DEFAULT_POLL_S = 10.0


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    _add_compile(sub)
    _add_run_local(sub)
    _add_submit(sub)
    _add_wait(sub)
    _add_schedule(sub)
    _add_render_job(sub)
    _add_janitor(sub)
    missing = [name for name in EXTRA_PACKAGES if not _installed(name)]
    if missing:
        note = (
            f"This install lacks {', '.join(missing)}: the commands need the `{EXTRA}` extra "
            f"(pip install 'kfp-llm-finetune[{EXTRA}]'); --help works without it."
        )
        for command_parser in (parser, *sub.choices.values()):
            command_parser.epilog = note


def _installed(name: str) -> bool:
    """Whether the package ``name`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses the name outright
        return False


def _later(module: str, name: str):
    """The command ``name`` of ``llmft.commands.<module>``, imported when it runs: a package of the extra that
    this install lacks is then one line naming it (llmft/trainer/failures.py ``missing_package``)."""

    def command(args: argparse.Namespace) -> int:
        loader = _render_job if module == "render_job" else _pipeline_run
        return int(getattr(loader(args.command), name)(args) or 0)

    return command


def _pipeline_run(command: str) -> ModuleType:
    try:
        from llmft.commands import pipeline_run  # optional: llmft.commands.pipeline_run
    except ModuleNotFoundError as exc:
        raise _missing(exc, command) from None
    return pipeline_run


def _render_job(command: str) -> ModuleType:
    try:
        from llmft.commands import render_job  # optional: llmft.commands.render_job
    except ModuleNotFoundError as exc:
        raise _missing(exc, command) from None
    return render_job


def _missing(exc: ModuleNotFoundError, command: str) -> Exception:
    """The one line (llmft/trainer/failures.py ``missing_package``) for a package of the extra this install lacks;
    a module of ours missing is a bug: its traceback."""
    line = missing_package(exc, Teller(command=f"llmft pipeline {command}", extras=(EXTRA,)))
    return exc if line is None else ConfigError(line)


def _add_janitor(sub) -> None:
    """``janitor`` (llmft/commands/janitor.py), whose options come from the job rules it imports; without the
    extra, the command is listed and says what to install."""
    try:
        from llmft.commands import janitor  # optional: llmft.commands.janitor
    except ModuleNotFoundError as exc:
        error = _missing(exc, "janitor")
        if not isinstance(error, ConfigError):
            raise
        stand_in = sub.add_parser("janitor", help="delete the unfinished jobs and Experiments of runs that have ended")
        stand_in.set_defaults(func=_raises(error))
        return
    janitor.add_parser(sub)


def _raises(error: Exception):
    def command(_args: argparse.Namespace) -> int:
        raise error

    return command


def _add_compile(sub) -> None:
    compile_ = sub.add_parser("compile", help="compile the pipeline to a YAML file")
    compile_.add_argument(
        "arguments",
        nargs="*",
        metavar="key=value",
        help="parameter values of the compiled pipeline: run parameters' defaults, and the values it compiles in "
        "(e.g. mlflow_secret=llmft-mlflow: Secrets and gpu_node_selector are fixed here; with --minimal every "
        "parameter but its eleven). promote_eval_tasks naming an lm-eval task prints a note: each run's plan step "
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
    compile_.set_defaults(func=_later("pipeline_run", "run_compile"))


def _add_run_local(sub) -> None:
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
    local.add_argument(
        "--verbose", action="store_true", help="show every task's full log, not just progress (always in the log)"
    )
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
    local.set_defaults(func=_later("pipeline_run", "run_local"))


def _add_submit(sub) -> None:
    submit = sub.add_parser(
        "submit",
        help="start a run on a KFP endpoint (create_run_from_pipeline_func); prints its UI link; --wait waits "
        "for its end (exit 0 only when it succeeded)",
    )
    _connection_arguments(submit, parameters=True)
    submit.add_argument("--run-name", default=None, help="run name (default: generated)")
    submit.add_argument(
        "--wait",
        action="store_true",
        help="wait for the run to end, printing its state as it changes: exit 0 when it SUCCEEDED, 1 when it "
        "FAILED, was CANCELED or --timeout passed (the run goes on; `llmft pipeline wait` picks it up again)",
    )
    _wait_arguments(submit)
    submit.set_defaults(func=_later("pipeline_run", "run_submit"))


def _add_wait(sub) -> None:
    wait = sub.add_parser("wait", help="wait for a run to end (exit 0 when it SUCCEEDED, 1 otherwise)")
    wait.add_argument("run_id", metavar="RUN_ID", help="the KFP run id (`llmft pipeline submit` prints it)")
    _connection_arguments(wait, parameters=False)
    _wait_arguments(wait)
    wait.set_defaults(func=_later("pipeline_run", "run_wait"))


def _add_schedule(sub) -> None:
    schedule = sub.add_parser("schedule", help="create a recurring run (KFP cron: six fields, seconds first)")
    _connection_arguments(schedule, parameters=True)
    schedule.add_argument(
        "--cron", required=True, help='six-field cron, seconds first, e.g. "0 0 3 * * *" = daily 03:00'
    )
    schedule.add_argument("--name", default="llm-finetune-nightly", help="recurring run name")
    schedule.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule at once")
    schedule.set_defaults(func=_later("pipeline_run", "run_schedule"))


def _add_render_job(sub) -> None:
    render = sub.add_parser(
        "render-job", help="write the PyTorchJob or TrainJob the train step would submit (for review)"
    )
    render.add_argument(
        "arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. training_workers=2)"
    )
    choices = _render_backends()
    render.add_argument(
        "--backend",
        choices=choices,
        required=True,
        help=" or ".join(choices) if choices else "the job's kind (the pipeline extra lists them)",
    )
    render.add_argument(
        "--output", required=True, help="YAML file to write (.yaml or .yml; atomically; new, or one llmft wrote)"
    )
    render.add_argument(
        "--force", action="store_true", help="replace a file (or symlink) at --output that llmft did not write"
    )
    render.add_argument("--run-id", default="RUN-ID", help="KFP run id the job name derives from (default RUN-ID)")
    render.add_argument("--namespace", default=None, help="namespace to set on the job (default: none)")
    render.add_argument(
        "--data", default=None, help="tokenized shards the trainer reads (default /data/tokenized/CACHE_KEY)"
    )
    render.add_argument("--hpo", action="store_true", help="take the HPO pipeline's parameters")
    render.set_defaults(func=_later("render_job", "run_render_job"))


def _render_backends() -> list[str] | None:
    """``--backend`` choices from the backend registry (llmft/components/lib/jobs/backends.py), when its packages
    are installed; without them the command itself says what to install."""
    try:
        from llmft.components.lib.jobs.backends import render_names  # optional: llmft.components.lib.jobs.backends
    except ModuleNotFoundError as exc:
        if (exc.name or "llmft").split(".")[0] == "llmft":
            raise
        return None
    return sorted(render_names())


def _connection_arguments(parser: argparse.ArgumentParser, *, parameters: bool) -> None:
    if parameters:
        parser.add_argument(
            "arguments", nargs="*", metavar="key=value", help="pipeline parameters (e.g. dataset=org/data)"
        )
    parser.add_argument("--host", required=True, help="KFP API endpoint, e.g. https://kubeflow.example.com/pipeline")
    parser.add_argument(
        "--ui-host",
        default=None,
        help=f"where the KFP UI answers, for the run's link (default ${UI_ENDPOINT_ENV}, else --host: right behind "
        "Kubeflow's gateway; with a port-forward to the API, the UI's own address)",
    )
    parser.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user installs)")
    if parameters:
        parser.add_argument("--experiment", default="llm-finetune", help="KFP experiment name")
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


def _wait_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="stop waiting after this long (exit 1; the run goes on); default 0 = until the run ends",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=DEFAULT_POLL_S,
        metavar="SECONDS",
        help=f"seconds between two looks at the run (default {DEFAULT_POLL_S:g})",
    )


MINIMAL_HELP = (
    f"the minimal form: run parameters {', '.join(p.name for p in Form(minimal=True).offered())} only; every other "
    "value compiled in (docs/pipeline-parameters.md)"
)
