"""What ``llmft pipeline``'s command line (llmft/commands/pipeline.py) and its commands (pipeline_run.py,
render_job.py) share: the pipeline function (imported on first use: kfp is heavy), its typed ``key=value``
arguments, the ``--output`` check, and the names of the KFP client's environment variables. Nothing here
imports a package of the ``pipeline`` extra at module level: ``llmft pipeline --help`` works without it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from llmft.components.lib.evaluation.task_plan import compiled_eval_notes
from llmft.components.lib.plan.forms import Form
from llmft.components.lib.plan.parameters import BY_NAME
from llmft.pipelines.defaults import parse_arguments
from llmft.trainer.data.remote import is_remote, shown_url, url_credentials
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import check_owned_file
from llmft.trainer.mlflow_settings import redact_credentials

KF_SA_TOKEN_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
KF_SA_TOKEN_PATH = "/var/run/secrets/kubeflow/pipelines/token"
"""Where kfp.client's ServiceAccountTokenVolumeCredentials reads the token (kfp/client/__init__.py)."""
UI_ENDPOINT_ENV = "KF_PIPELINES_UI_ENDPOINT"
"""The KFP UI's address when it is not the API's (kfp 2.17.3 kfp/client/client.py line 165 reads it too)."""
YAML_SUFFIXES = (".yaml", ".yml")
"""What KFP's compiler accepts as a package path (kfp/compiler/pipeline_spec_builder.py, write_pipeline_spec_to_file,
about line 2303 in kfp 2.17)."""


def command_form(args: argparse.Namespace) -> Form:
    """The pipeline form a command works on: ``--hpo``, ``--minimal`` (compile, submit, schedule)."""
    return Form(hpo=bool(getattr(args, "hpo", False)), minimal=bool(getattr(args, "minimal", False)))


def load_pipeline(form: Form, defaults: dict | None = None):
    """The pipeline (GraphComponent) of ``form``, built with ``defaults`` as its compiled values."""

    try:
        # heavy: kfp
        from llmft.pipelines.llm_finetune import build_pipeline
    except ImportError as exc:
        raise ConfigError(f"cannot import the pipelines ({exc}); install the `pipeline` extra") from None
    return build_pipeline(hpo=form.hpo, minimal=form.minimal, local=form.local, defaults=defaults)


def typed_arguments(args: argparse.Namespace, form: Form | None = None) -> dict:
    """The ``key=value`` arguments, typed by the parameters' declarations (older names renamed), checked
    against the command's pipeline form."""

    arguments = parse_arguments(args.arguments, form or command_form(args))
    refuse_credentials(arguments)
    return arguments


def check_compiled_eval(arguments: Mapping[str, Any]) -> None:
    """compile, submit, schedule: the evaluation the pipeline carries (these arguments over the declared defaults),
    checked before anything is compiled: refused in one line when no run could use it, a note on stderr for
    what each run's plan step checks on its volume (an lm-eval task's cached data; task_plan.compiled_eval_notes)."""
    value = {name: arguments.get(name, BY_NAME[name].default) for name in EVAL_PARAMETERS}
    for note in compiled_eval_notes(*value.values()):
        print(f"note: {note}", file=sys.stderr)


EVAL_PARAMETERS = ("promote_eval_tasks", "promote_metric", "promote_guards")
"""The evaluation settings :func:`check_compiled_eval` reads, in compiled_eval_notes' order."""


def refuse_credentials(arguments: Mapping[str, Any]) -> None:
    """A pipeline parameter never carries a password: the KFP UI shows parameters, kfp.local logs a task's
    inputs and the train step copies them into the job. A URL with ``user:password@`` is refused before
    anything sees it, in one line that shows it redacted."""
    for name, value in arguments.items():
        if isinstance(value, str) and redact_credentials(value) != value:
            raise ConfigError(
                f"pipeline parameter `{name}`={redact_credentials(value)!r} holds a user name or password, which "
                "the KFP UI and the run's logs would show. Pass the URL alone and put the credentials in a "
                "Kubernetes Secret (for MLflow: the mlflow_secret's MLFLOW_TRACKING_USERNAME and "
                "MLFLOW_TRACKING_PASSWORD keys, deploy/secrets)"
            )
        if isinstance(value, str) and is_remote(value) and url_credentials(value):
            raise ConfigError(
                f"pipeline parameter `{name}`={shown_url(value)!r} carries {url_credentials(value)}, which the KFP UI "
                "and the run's logs would show. Put the data in S3 (or an S3-compatible store) and pass "
                "s3://bucket/key with s3_secret=<Secret with AWS_* keys>"
            )


def check_yaml_output(output: str, *, force: bool) -> None:
    """``--output`` of compile and render-job: a .yaml/.yml file name, and nothing there this program did
    not write (llmft/trainer/io.py ``check_owned_file``); checked before any work."""

    if not output.endswith(YAML_SUFFIXES):
        raise ConfigError(f"--output {output}: the output is a YAML file; give it a .yaml name, e.g. {output}.yaml")
    check_owned_file(output, force=force)
