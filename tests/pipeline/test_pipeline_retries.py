"""Issue 42 (Low: exit codes never reach Argo) and issue 45's probe: what the messages promise about retries is
true. KFP's launcher exits 1 whatever the component returned (kubeflow/pipelines 2.4.1
backend/src/v2/cmd/launcher-v2/main.go 46-50) and set_retry has no retryPolicy, so every failed attempt is
retried; kfp.local retries whatever the exit code (kfp 2.17.3 kfp/local/orchestrator/task_executor.py 124-175).
So: prepare and tokenize, which print "exit 200 is retried by the pipeline", have set_retry; kfp.local retries
nothing; a cluster-only backend is refused by the plan step under kfp.local; a retried attempt of a task that
failed permanently ends at once (llmft/components/lib/task_attempts.py)."""

from __future__ import annotations

import json
import sys

import pytest
from kubernetes import client
from plan_helpers import parameters

from llmft.components.lib.cluster import Cluster
from llmft.components.lib.task_attempts import record_path, task_attempt
from llmft.trainer.errors import ConfigError, DataError, TransientError

RETRIED = {"prepare-dataset", "tokenize-dataset", "train-model", "register-model"}


def _retry_policies(pipeline) -> dict[str, int]:
    spec = pipeline.pipeline_spec
    found = {}
    for component in [spec.root, *spec.components.values()]:
        for name, task in component.dag.tasks.items():
            if task.HasField("retry_policy"):
                found[name] = task.retry_policy.max_retry_count
    return found


def test_the_cluster_pipeline_retries_the_data_steps_and_kfp_local_retries_nothing():
    from llmft.pipelines.llm_finetune import DATA_RETRIES, llm_finetune_pipeline, local_pipeline

    cluster = _retry_policies(llm_finetune_pipeline)
    assert set(cluster) == RETRIED and cluster["prepare-dataset"] == cluster["tokenize-dataset"] == DATA_RETRIES
    assert _retry_policies(local_pipeline()) == {}
    assert _retry_policies(llm_finetune_pipeline) == cluster, "building the local pipeline changed the shared one"


@pytest.mark.parametrize(
    ("changes", "shown"),
    [
        (
            {"training_backend": "pytorchjob"},
            "`training_backend`='pytorchjob': `pytorchjob` creates a PyTorchJob, which runs",
        ),
        ({"training_backend": "trainjob"}, "`training_backend`='trainjob': `trainjob` creates a TrainJob, which runs"),
    ],
    ids=["pytorchjob", "trainjob"],
)
def test_a_cluster_only_backend_is_refused_by_the_plan_step_under_kfp_local(changes, shown, tmp_path, monkeypatch):
    """Before: the plan passed, prepare and tokenize ran, then train exited 1 and was retried twice (60 s, 120 s)."""
    from kfp import dsl

    from llmft.components.plan import plan_run

    monkeypatch.delenv("KFP_POD_NAME", raising=False)
    artifact = dsl.Artifact(uri=str(tmp_path / "plan"))
    with pytest.raises(ConfigError) as refused:
        plan_run.python_func(
            plan=artifact, **parameters(volume_path=str(tmp_path), **changes), run_id="r1", compiled=""
        )
    message = str(refused.value)
    assert shown in message and "use training_backend=local" in message and "\n" not in message


def test_a_katib_sweep_is_refused_under_kfp_local():
    from plan_helpers import make_plan

    from llmft.components.lib.plan.checks import check_runs_here

    plan = make_plan(hpo=True, environ={}, training_backend="local", hpo_backend="katib")
    with pytest.raises(
        ConfigError, match="`hpo_backend`='katib': `katib` creates a Katib Experiment.*hpo_backend=local"
    ):
        check_runs_here(plan)
    check_runs_here(make_plan(hpo=True, environ={}, training_backend="local", hpo_backend="local"))


# --- a retried attempt of a permanent failure --------------------------------------------------------------

WF, RUN, TASK = "llm-finetune-a1b2c", "4e2f8a1c-0d3b-4c5e-9f6a-7b8c9d0e1f2a", "prepare-dataset"


class _Api:
    """The pod and the run's Workflow, as the attempt reads them."""

    def __init__(self, failed_nodes: dict):
        self.failed_nodes = failed_nodes

    def read_namespaced_pod(self, name, namespace, **_):
        owner = client.V1OwnerReference(api_version="argoproj.io/v1alpha1", kind="Workflow", name=WF, uid="u",
                                        controller=True)  # fmt: skip
        return client.V1Pod(metadata=client.V1ObjectMeta(name=name, owner_references=[owner]),
                            spec=client.V1PodSpec(containers=[]), status=client.V1PodStatus())  # fmt: skip

    def get_namespaced_custom_object(self, group, version, namespace, plural, name, **_):
        return {"metadata": {"name": WF}, "status": {"nodes": self.failed_nodes}}


def _attempt(root, pod: str, nodes: dict, body, capsys) -> tuple[int | None, str]:
    api = _Api(nodes)
    cluster = Cluster("team-a", custom_api=api, core_api=api)
    code = None
    try:
        with task_attempt(str(root), RUN, TASK, environ={"KFP_POD_NAME": pod}, cluster=cluster):
            body()
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


def _pod(n: int) -> str:
    return f"{WF}-system-container-impl-{1000 + n}"


def _node(n: int, phase: str) -> dict:
    return {f"{WF}-{1000 + n}": {"phase": phase, "type": "Pod"}}


def test_a_retry_of_a_permanent_failure_ends_at_once_and_a_runs_retry_runs_again(tmp_path, capsys):
    ran = []

    def bad_data():
        ran.append(1)
        raise DataError("train.jsonl:3: no assistant turn")

    code, err = _attempt(tmp_path, _pod(1), {}, bad_data, capsys)
    assert code == 1 and err.strip() == "error (exit 1): train.jsonl:3: no assistant turn" and ran == [1]
    assert json.loads(record_path(str(tmp_path), RUN, TASK).read_text())["pod"] == _pod(1)

    code, err = _attempt(tmp_path, _pod(2), _node(1, "Failed"), bad_data, capsys)  # Argo's retry of it
    assert code == 1 and ran == [1], "the retried attempt did the work again"
    assert "an earlier attempt of this task" in err and "no assistant turn" in err

    fixed = []
    code, _ = _attempt(tmp_path, _pod(1), {}, lambda: fixed.append(1), capsys)  # a run's Retry dropped the node
    assert code is None and fixed == [1] and not record_path(str(tmp_path), RUN, TASK).exists()


def test_a_transient_failure_is_retried_in_full(tmp_path, capsys):
    ran = []

    def hub_down():
        ran.append(1)
        raise TransientError("the Hugging Face hub did not answer")

    assert _attempt(tmp_path, _pod(1), {}, hub_down, capsys)[0] == 200
    assert not record_path(str(tmp_path), RUN, TASK).exists()
    assert _attempt(tmp_path, _pod(2), _node(1, "Failed"), hub_down, capsys)[0] == 200 and ran == [1, 1]


def test_a_bug_is_one_line_exit_3_and_off_a_cluster_nothing_is_recorded(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KFP_POD_NAME", raising=False)
    with pytest.raises(SystemExit) as stopped:
        with task_attempt(str(tmp_path), RUN, TASK):
            {}["missing"]  # noqa: B018 - a bug
    err = capsys.readouterr().err
    assert (
        stopped.value.code == 3
        and err.startswith("error (exit 3): internal error: KeyError")
        and "Traceback" not in err
    )
    assert not record_path(str(tmp_path), RUN, TASK).exists()
    assert sys.exc_info() == (None, None, None)
