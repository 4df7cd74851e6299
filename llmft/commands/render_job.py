"""`llmft pipeline render-job`: write the training job the train step would submit, for review.

The job is built by the launcher's own code from a plan built from the given pipeline
parameters: ``build_plan`` (as the plan-run step does on a cluster), then
``plan.trainer.launch(<tokenized dir>)`` and ``build_job_spec`` (as the train step does),
then the backend's ``build`` (llmft/components/lib/jobs/backends.py: every backend with a
``render_name``). Only the tokenized folder (known once the tokenize
step ran) and the run id (the KFP run's) are placeholders. The job runs ``llmft train --config
<run_dir>/config.yaml data=...``; the file's header shows that config.yaml as the plan step would
write it on the volume (this command writes nothing there).
"""

from __future__ import annotations

import argparse

from llmft.commands.pipeline_args import check_yaml_output, typed_arguments
from llmft.components.lib.jobs.backends import backend_for, render_names
from llmft.components.lib.jobs.pytorchjob_spec import build_job_spec
from llmft.components.lib.plan.build import build_plan
from llmft.components.lib.plan.checks import compiled_settings
from llmft.components.lib.plan.parameters import parameter_defaults
from llmft.katib.experiment_yaml import kubectl_yaml
from llmft.katib.k8s_names import check_k8s_name
from llmft.trainer.config_load import config_to_yaml
from llmft.trainer.errors import ConfigError
from llmft.trainer.io import write_owned_file

RENDER_POD = {"KFP_POD_NAME": "llmft-render-job"}
"""The environment of a KFP task pod, so the plan applies the checks it applies on a cluster."""


def render_job(
    arguments: dict, backend: str, *, run_id: str, namespace: str | None, data: str | None, hpo: bool = False
) -> dict:
    """The job body (a dict, as the API server receives it) for pipeline parameters ``arguments``, checked as
    the plan step of that pipeline (``hpo``: the sweep pipeline, whose trial overrides are checked too)."""
    return render_job_and_config(arguments, backend, run_id=run_id, namespace=namespace, data=data, hpo=hpo)[0]


def render_job_and_config(
    arguments: dict, backend: str, *, run_id: str, namespace: str | None, data: str | None, hpo: bool = False
) -> tuple[dict, str]:
    """:func:`render_job`'s body, and the config.yaml the plan step would write (path line, then its YAML)."""
    training_backend = render_names()[backend]
    given = arguments.get("training_backend", training_backend)
    if backend_for(given).name != training_backend:  # an older name (kubeflow) means its backend
        raise ConfigError(f"training_backend={given} contradicts --backend {backend}; drop one of them")
    values = {**parameter_defaults(), **arguments, "training_backend": training_backend}
    pipeline = "llm-finetune-hpo" if hpo else "llm-finetune"
    plan = build_plan(values, run_id=run_id, compiled=compiled_settings(pipeline, values), environ=RENDER_POD)
    launch = plan.trainer.launch(data or plan.layout.tokenized("CACHE_KEY"))
    spec = build_job_spec(plan.job, launch, namespace=namespace)
    config = f"{plan.trainer.config_path}:\n{config_to_yaml(plan.trainer.config)}"
    return backend_for(training_backend).build_job(plan.job, spec), config


def run_render_job(args: argparse.Namespace) -> int:
    check_yaml_output(args.output, force=args.force)
    if args.namespace is not None:  # written into the manifest: a Kubernetes name, never a path such as ../x
        check_k8s_name(args.namespace, "--namespace")
    body, config = render_job_and_config(
        typed_arguments(args), args.backend, run_id=args.run_id, namespace=args.namespace, data=args.data, hpo=args.hpo
    )
    header = (
        f"# {body['kind']} the train step would submit (llmft pipeline render-job --backend {args.backend}).\n"
        "# Placeholders: the run id in the name and labels, CACHE_KEY in data= (the tokenize step's folder).\n"
        "# The trainer reads --config, which the plan step writes on the volume (not written by this command):\n"
        + "".join(f"#   {line}\n" for line in config.splitlines())
    )
    text = kubectl_yaml(body)
    write_owned_file(args.output, header + text, command="pipeline render-job", force=args.force)
    print(f"wrote {body['kind']} {body['metadata']['name']} to {args.output}")
    return 0
