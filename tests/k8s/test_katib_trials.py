"""A Katib trial keeps the trainer's signals and exit codes through Katib's
metrics-collector wrapper (cluster_sim.katib_wrap, katib v0.19.0 pkg/webhook/v1beta1/pod/utils.go
155-221), on the simulated cluster with the real trial PyTorchJob the sweep step builds. No real
cluster or Katib runs here."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from cluster_sim import base_env, k8s_expand, katib_early_stop, katib_wrap
from sim_plans import TINY_TRAIN, sim_plan

from llmft.components.lib.jobs.katib_sweep import sweep_trial_job
from llmft.components.lib.jobs.pytorchjob_launch import wait_for_job
from llmft.components.lib.jobs.pytorchjob_spec import GROUP, PLURAL, VERSION
from llmft.katib.experiment import SweepSpec, apply_overrides
from llmft.trainer.config_load import load_config
from llmft.trainer.io import is_complete

VALUES = {"learning_rate": "0.005", "lora_r": "4", "lora_alpha": "8", "lora_dropout": "0.0", "warmup_ratio": "0.0"}


def trial(plan, name: str, *, early_stopping: bool, data: str, max_steps: int = 400, eval_every: int = 0) -> dict:
    """The trial PyTorchJob Katib would create: the sweep step's template with the trial's values."""
    spec = apply_overrides(SweepSpec(name="llmft-sweep-t"), [f"early_stopping={str(early_stopping).lower()}"])
    body = sweep_trial_job(
        spec,
        job=plan.job,
        data=data,
        config_path=plan.trainer.config_path,
        fixed_overrides=[f"max_steps={max_steps}", "save_every=0", f"eval_every={eval_every}"],
    )
    values = {**VALUES, "trial_name": name}
    job = json.loads(re.sub(r"\$\{trialParameters\.([a-z_]+)\}", lambda m: values[m.group(1)], json.dumps(body)))
    job["metadata"] = {**job.get("metadata", {}), "name": name}
    return job


def _metrics(tmp_path: Path) -> Path:
    return tmp_path / "katib" / "metrics.log"


def _wait_for(path: Path, text: str, timeout_s: float = 180.0, sim=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and text in path.read_text(errors="replace")):
        if sim is not None:
            sim.reconcile()
        assert time.monotonic() < deadline, f"{path} did not show {text!r}"
        time.sleep(0.2)


def test_the_trial_carries_the_final_trainings_settings(sim_volume):
    """The sweep tunes the model the train step trains: each trial starts from the plan's config.yaml
    (``--config``: train_overrides, target modules and seed), and only the keys a trial sets itself,
    the fixed trial settings and the searched ones are key=value on its command line."""
    plan = sim_plan(
        sim_volume,
        finetune_lora_target_modules="q_proj,v_proj",
        finetune_seed=7,
        finetune_overrides=f"optim.weight_decay=0.05 {TINY_TRAIN}",
    )
    job = trial(plan, "t-1", early_stopping=True, data="/d")
    script = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["args"][0]
    words = script.split()
    config_path = words[words.index("--config") + 1]
    arguments = words[words.index("--config") + 2 : words.index("&")]
    assert config_path == plan.trainer.config_path and not {"seed=7", "optim.weight_decay=0.05"} & set(arguments)
    cfg = load_config(config_path, arguments)  # what the trial's trainer resolves
    assert (cfg.lora.target_modules, cfg.seed, cfg.optim.weight_decay, cfg.batch.global_sequences) == (
        ("q_proj", "v_proj"),
        7,
        0.05,
        4,
    )
    assert cfg.optim.lr == 0.005 and cfg.lora.r == 4 and cfg.max_steps == 400 and cfg.data == "/d"
    assert cfg.output_dir == f"{sim_volume}/sweeps/llmft-sweep-t/t-1" and cfg.observe.run_name == "t-1"


@pytest.mark.slow
def test_a_preempted_trial_pod_commits_and_resumes_instead_of_failing(sim, fake_cluster, sim_volume, tmp_path):
    """SIGTERM to the trial pod (its main process is Katib's `sh -c` wrapper): the trainer commits a
    checkpoint and the container exits 143, not 1, so the operator restarts it and the trial resumes."""
    plan = sim_plan(sim_volume, run_id="sweep-preempt")
    metrics = _metrics(tmp_path)
    metrics.parent.mkdir()
    sim.katib = {"early_stopping": True, "metrics_file": metrics}
    body = trial(plan, "trial-preempt", early_stopping=True, data=f"{sim_volume}/tokenized/demo", max_steps=8)
    fake_cluster.create_custom_object(GROUP, VERSION, PLURAL, body)
    master = "trial-preempt-master-0"
    _wait_for(metrics, "step=2 ", sim=sim)
    sim.containers[master].signal(15)  # the kubelet stopping the pod: SIGTERM to the container's main process
    job = wait_for_job(fake_cluster, "trial-preempt", fake_cluster.namespace, timeout_s=600, poll_s=0.2,
                       print_fn=lambda _: None)  # fmt: skip
    assert [c["type"] for c in job["status"]["conditions"] if c["status"] == "True"][-1] == "Succeeded"
    assert [code for pod, code in sim.history if pod == master] == [143, 0], sim.history
    run = sim_volume / "sweeps" / "llmft-sweep-t" / "trial-preempt"
    committed = [p for p in (run / "checkpoints").iterdir() if is_complete(p)]
    assert committed, "the preempted trainer committed a checkpoint"
    assert "resuming from" in metrics.read_text()


@pytest.mark.slow
def test_katibs_early_stop_still_ends_the_trial_as_stopped(sim, fake_cluster, sim_volume, tmp_path):
    """The collector marks the main process's pid file early-stopped and SIGTERMs its one child: the
    wrapper's check finds the mark and the container exits 0 (not 143: that would restart it)."""
    plan = sim_plan(sim_volume, run_id="sweep-stop")
    metrics = _metrics(tmp_path)
    metrics.parent.mkdir()
    sim.katib = {"early_stopping": True, "metrics_file": metrics}
    fake_cluster.create_custom_object(
        GROUP, VERSION, PLURAL, trial(plan, "trial-stop", early_stopping=True, data=f"{sim_volume}/tokenized/demo")
    )
    master = "trial-stop-master-0"
    _wait_for(metrics, "step=2 ", sim=sim)
    katib_early_stop(sim.containers[master], metrics.parent)
    wait_for_job(fake_cluster, "trial-stop", fake_cluster.namespace, timeout_s=300, poll_s=0.2, print_fn=lambda _: None)
    assert [code for pod, code in sim.history if pod == master] == [0]
    assert "Training Container was Early Stopped" in sim.containers[master].text()


@pytest.mark.slow
@pytest.mark.parametrize(("early_stopping", "code", "expected"), [(True, 200, 200), (True, 1, 1), (False, 137, 137),
                                                                   (True, 0, 0)])  # fmt: skip
def test_trainer_exit_codes_survive_the_wrapper(early_stopping, code, expected, sim_volume, tmp_path):
    """With a stand-in `llmft` that exits ``code``: a retryable code reaches the runtime as itself
    (the wrapper alone turns every failure into `exit 1` with early stopping), 1 stays 1, 0 completes."""
    stub = tmp_path / "bin" / "llmft"
    stub.parent.mkdir()
    stub.write_text(f"#!/bin/sh\nexit {code}\n")
    stub.chmod(0o755)
    plan = sim_plan(sim_volume)
    container = trial(plan, "t", early_stopping=early_stopping, data="/d")["spec"]["pytorchReplicaSpecs"]["Master"][
        "template"
    ]["spec"]["containers"][0]
    metrics = tmp_path / "katib" / "metrics.log"
    metrics.parent.mkdir()
    command, args = katib_wrap(container["command"], container["args"], early_stopping=early_stopping,
                               metrics_file=str(metrics))  # fmt: skip
    env = base_env(PATH=f"{stub.parent}:/usr/bin:/bin")
    done = subprocess.run([k8s_expand(a, env) for a in [*command, *args]], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == expected, done.stdout + done.stderr
    markers = [p.read_text().strip() for p in metrics.parent.glob("*.pid")]
    assert markers == (["completed"] if code == 0 else []), markers


def test_the_script_starts_one_child_for_katibs_collector():
    """Katib's collector stops a trial through the single child of the main process
    (file-metricscollector/main.go 286-290): the script must not fork anything else while training."""
    from llmft.components.lib.jobs.katib_trial import katib_trial_script
    from llmft.components.lib.jobs.pytorchjob_spec import JobSpec

    script = katib_trial_script(JobSpec(name="t"), early_stopping=True)
    assert script.startswith("{ ") and script.endswith("; }") and script.count(" & ") == 1
    assert "$(" not in script, "Kubernetes would try to expand $(...) as a variable"


@pytest.mark.slow
def test_katibs_stdout_collector_reads_the_trainers_real_eval_lines(sim, fake_cluster, sim_volume, tmp_path):
    """Issue 29.7: the metrics file of a real trial (the trainer's stdout and stderr, redirected by
    Katib's wrapper, utils.go 155-221) parsed as Katib v0.19.0's StdOut collector parses it
    (pkg/metricscollector/v1beta1/file-metricscollector/file-metricscollector.go 72-126, mirrored by
    llmft/katib/metrics.parse_metric_lines, with the Experiment's filter METRICS_FILTER) gives exactly the
    evaluations the trainer recorded in metrics.jsonl: none missed, none invented by other lines
    (train steps, warnings, progress), values to the printed 6 decimals."""
    from llmft.katib.metrics import ADDITIONAL_METRICS, METRICS_FILTER, OBJECTIVE_METRIC, parse_metric_lines

    plan = sim_plan(sim_volume, run_id="sweep-metrics")
    metrics = _metrics(tmp_path)
    metrics.parent.mkdir()
    sim.katib = {"early_stopping": True, "metrics_file": metrics}
    body = trial(plan, "trial-metrics", early_stopping=True, data=f"{sim_volume}/tokenized/demo", max_steps=4,
                 eval_every=2)  # fmt: skip
    fake_cluster.create_custom_object(GROUP, VERSION, PLURAL, body)
    wait_for_job(fake_cluster, "trial-metrics", fake_cluster.namespace, timeout_s=600, poll_s=0.2,
                 print_fn=lambda _: None)  # fmt: skip
    names = [OBJECTIVE_METRIC, *ADDITIONAL_METRICS]
    observed = parse_metric_lines(metrics.read_text(errors="replace"), names, METRICS_FILTER)
    run = sim_volume / "sweeps" / "llmft-sweep-t" / "trial-metrics"
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert len(evals) >= 2, events
    expected = [(name, round(e[name], 6)) for e in evals for name in names]
    assert observed == expected, metrics.read_text()[-2000:]


KATIB_CONFIG = """---
apiVersion: config.kubeflow.org/v1beta1
kind: KatibConfig
init:
  controller:
    webhookPort: 8443
    trialResources:
{listed}
runtime:
  metricsCollectors:
    - kind: StdOut
"""
"""katib-config.yaml as kubeflow/katib v0.19.0 ships it (manifests/v1beta1/installs/*/katib-config.yaml 1-15)."""
STANDALONE = ("TrainJob.v1alpha1.trainer.kubeflow.org", "Job.v1.batch", "TFJob.v1.kubeflow.org",
              "PyTorchJob.v1.kubeflow.org", "MPIJob.v1.kubeflow.org", "XGBoostJob.v1.kubeflow.org")  # fmt: skip
"""katib-standalone and katib-cert-manager; katib-external-db, -leader-election, -openshift and
-standalone-postgres list the same without the TrainJob."""


def _katib_config(fake_core_api, resources) -> None:
    listed = "\n".join(f"      - {r}" for r in resources)
    fake_core_api.config_maps[("kubeflow", "katib-config")] = {"katib-config.yaml": KATIB_CONFIG.format(listed=listed)}


@pytest.mark.parametrize("install", ["standalone", "standalone-postgres"])
def test_trainjob_trials_need_trainjob_in_katibs_trial_resources(install, fake_cluster, fake_core_api):
    """Issue 34.5: Katib's trial controller watches only the kinds in trialResources (v0.19.0
    pkg/controller.v1beta1/trial/trial_controller.go 103-131): a TrainJob trial elsewhere runs and its end
    is never seen. The sweep's preflight refuses it in one line naming the ConfigMap and the fix."""
    from llmft.katib.errors import SweepError
    from llmft.katib.trial_kinds import PYTORCHJOB, TRAINJOB, check_trial_resources

    resources = STANDALONE if install == "standalone" else STANDALONE[1:]
    _katib_config(fake_core_api, resources)
    check_trial_resources(fake_cluster, PYTORCHJOB)  # listed by every shipped config
    if install == "standalone":
        check_trial_resources(fake_cluster, TRAINJOB)
        return
    with pytest.raises(SweepError) as refused:
        check_trial_resources(fake_cluster, TRAINJOB)
    message = str(refused.value)
    assert "katib-config" in message and "does not list TrainJob.v1alpha1.trainer.kubeflow.org" in message
    assert "rollout restart deploy/katib-controller" in message and "\n" not in message


def test_an_unreadable_katib_config_is_a_stated_prerequisite_not_a_failure(fake_cluster):
    from llmft.katib.trial_kinds import TRAINJOB, check_trial_resources

    printed: list[str] = []
    check_trial_resources(fake_cluster, TRAINJOB, print_fn=printed.append)  # 404: not readable here
    assert (
        len(printed) == 1 and "make sure its trialResources list TrainJob.v1alpha1.trainer.kubeflow.org" in printed[0]
    )
