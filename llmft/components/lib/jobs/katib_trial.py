"""A training job as a Katib trial: the ``sh -c`` script that keeps signals and exit codes through Katib's
metrics-collector wrapper, and the PyTorchJob trial template (a plain dict: llmft/katib/ takes it and never
imports llmft/components/). The TrainJob's trial template (trainjob_spec.py) runs the same script."""

from __future__ import annotations

import re

from llmft.components.lib.cluster import PYTORCHJOB_CONTAINER
from llmft.components.lib.jobs.pytorchjob_spec import JobSpec, build_pytorchjob, pytorchjob_to_dict, trainer_command
from llmft.trainer.command_line import format_override_value
from llmft.trainer.errors import ConfigError


def shell_safe(value: str) -> bool:
    """Katib's stdout collector runs the trial command through ``sh -c``: no whitespace
    or shell operators in arguments (``${trialParameters.x}`` placeholders are fine)."""
    stripped = re.sub(r"\$\{trial(Parameters|Spec)\.[A-Za-z0-9_]+\}", "", value)
    return not re.search(r"[\s;&|<>`$\\'\"()]", stripped)


def katib_trial_script(spec: JobSpec, *, early_stopping: bool) -> str:
    """The ``sh -c`` script of a Katib trial's container: the trainer command, with signals and exit
    codes kept through Katib's wrapper.

    Katib v0.19.0 rewrites the primary container of a trial with the StdOut collector into
    ``sh -c "<command> 1>metrics.log 2>&1 [|| <early-stop check; else exit 1>] && <mark completed>"``
    (``pkg/webhook/v1beta1/pod/utils.go`` 155-221; a command that starts with ``sh -c`` keeps its
    script, 165-171). Two things break for a plain ``llmft train``: ``sh`` is PID 1, and a PID 1 without
    a handler ignores SIGTERM, so a preempted pod's trainer never commits a checkpoint and is killed
    after the grace period; and with early stopping any failure, 143 included, ends in ``exit 1``,
    which ``restartPolicy: ExitCode`` treats as permanent.

    So the script is one brace group (the appended redirect covers all of it; no extra process, so
    Katib's collector still finds exactly one child to stop, file-metricscollector/main.go 281-293):
    it traps SIGTERM, forwards it to the trainer, waits for its checkpoint and exits with its code
    (143) before the wrapper's ``||`` can turn it into 1. A retryable code (128-255) of the trainer
    exits the shell the same way. 143 without the trap is Katib's collector stopping the trial early
    (it SIGTERMs the child, never PID 1): with ``early_stopping`` it becomes a plain failure status,
    so the wrapper's check finds the early-stopped marker and exits 0. 1-127 fall through to the
    wrapper (exit 1), 0 marks the trial completed."""
    command, args = trainer_command(spec)
    early_stop = "[ $code -eq 143 ] && code=1; " if early_stopping else ""
    return (
        "{ trap 'kill -TERM $pid 2>/dev/null; wait $pid; exit $?' TERM; "
        + " ".join([*command, *args])
        + " & pid=$!; wait $pid; code=$?; "
        + early_stop
        + "[ $code -lt 128 ] || exit $code; (exit $code); }"
    )


def trial_pytorchjob_dict(spec: JobSpec, *, early_stopping: bool = True) -> dict:
    """The PyTorchJob as a Katib trial template: no metadata.name/namespace (Katib sets them),
    overrides may hold ``${trialParameters.name}`` placeholders, and every replica runs
    :func:`katib_trial_script` through ``sh -c`` (``early_stopping``: the Experiment's)."""
    unsafe = [
        f"{k}={format_override_value(v)}" for k, v in spec.overrides.items() if not shell_safe(format_override_value(v))
    ]
    if unsafe or (spec.config_path and not shell_safe(spec.config_path)):
        raise ConfigError(
            f"Katib trial {spec.name!r}: arguments {unsafe or [spec.config_path]} contain whitespace "
            "or shell characters, which break Katib's metrics-collector wrapper; remove them"
        )
    body = pytorchjob_to_dict(build_pytorchjob(spec))
    body["metadata"].pop("name", None)
    body["metadata"].pop("namespace", None)
    script = katib_trial_script(spec, early_stopping=early_stopping)
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        for container in replica["template"]["spec"]["containers"]:
            if container["name"] == PYTORCHJOB_CONTAINER:
                container["command"], container["args"] = ["sh", "-c"], [script]
    return body
