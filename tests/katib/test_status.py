"""Submit, status and best, through the real Cluster with a fake at the kubernetes-client boundary."""

from __future__ import annotations

import pytest
from katib_helpers import BEST, FakeKatibApi, katib_status, trial_words

from llmft.cli import main as llmft_main
from llmft.components.lib.cluster import Cluster
from llmft.katib import status as katib_status_mod
from llmft.katib.errors import ExperimentFailed, SweepError
from llmft.katib.status import parse_state

EXPECTED_BEST = ["optim.lr=0.00031", "lora.r=32", "lora.alpha=64", "lora.dropout=0.02", "schedule.warmup_ratio=0.05"]


def test_parse_state_succeeded(body):
    body["status"] = katib_status(
        "Succeeded",
        best=BEST,
        reason="ExperimentMaxTrialsReached",
        message="Experiment has succeeded because max trial count has reached",
        trials={"trials": 12, "trialsSucceeded": 11, "trialsFailed": 1},
    )
    state = parse_state(body)
    assert (state.phase, state.reason, state.done) == ("Succeeded", "ExperimentMaxTrialsReached", True)
    assert state.trials["succeeded"] == 11 and state.trials["failed"] == 1 and state.trials["total"] == 12
    assert state.best_trial == "llmft-sweep-x7k2p9qd"
    assert state.best_metrics == {"eval_loss": 1.25, "perplexity": 3.49}  # the min (the objective's strategy)
    assert state.best_overrides() == EXPECTED_BEST
    assert "best trial: llmft-sweep-x7k2p9qd eval_loss=1.25" in state.summary()


def test_parse_state_running_and_pending(body):
    assert parse_state(body).phase == "Pending"
    body["status"] = katib_status("Running", trials={"trials": 3, "trialsRunning": 3})
    state = parse_state(body)
    assert (state.phase, state.done, state.best_parameters) == ("Running", False, {})
    with pytest.raises(SweepError, match="no optimal trial yet"):
        katib_status_mod.best_overrides(body)


def test_an_assignment_bound_to_no_trainer_key_is_refused(body):
    body["spec"]["parameters"] = [p for p in body["spec"]["parameters"] if p["name"] != "warmup_ratio"]
    body["status"] = katib_status("Succeeded", best=BEST)
    assert parse_state(body).unbound == ("warmup_ratio",)
    with pytest.raises(SweepError, match=r"\['warmup_ratio'\] are not bound to a trainer key"):
        katib_status_mod.best_overrides(body)


def test_failed_beats_an_older_running_condition(body):
    body["status"] = katib_status(
        "Failed",
        reason="ExperimentMaxFailedTrialsReached",
        message="Experiment has failed because max failed count has reached",
    )
    state = parse_state(body)
    assert state.phase == "Failed" and "max failed count" in state.message


def _fake_cluster(statuses):
    api = FakeKatibApi(statuses)
    return Cluster("team-a", custom_api=api, core_api=object()), api


def test_submit_wait_best_through_the_cluster(body):
    cluster, api = _fake_cluster(
        [
            katib_status("Created"),
            katib_status("Running"),
            katib_status("Succeeded", best=BEST, reason="ExperimentMaxTrialsReached"),
        ]
    )
    katib_status_mod.submit(cluster, body)
    namespace, sent = api.created[0]
    assert namespace == "team-a" and sent["spec"] == body["spec"]
    seen, sleeps = [], []
    state = katib_status_mod.wait(cluster, "llmft-sweep", poll_s=7, on_update=seen.append, sleep=sleeps.append)
    assert state.phase == "Succeeded" and [s.phase for s in seen] == ["Created", "Running", "Succeeded"]
    assert sleeps == [7, 7]
    assert (
        katib_status_mod.best_overrides(
            cluster.get_custom_object("kubeflow.org", "v1beta1", "experiments", "llmft-sweep")
        )
        == EXPECTED_BEST
    )


def test_wait_raises_on_failed_and_on_timeout(body):
    cluster, _ = _fake_cluster(
        [
            katib_status("Running"),
            katib_status("Failed", reason="ExperimentMaxFailedTrialsReached", message="max failed count has reached"),
        ]
    )
    katib_status_mod.submit(cluster, body)
    with pytest.raises(ExperimentFailed, match="ExperimentMaxFailedTrialsReached") as err:
        katib_status_mod.wait(cluster, "llmft-sweep", sleep=lambda s: None)
    assert err.value.state.phase == "Failed"
    cluster, _ = _fake_cluster([katib_status("Running")])
    katib_status_mod.submit(cluster, body)
    clock = iter(range(0, 10_000, 60))
    with pytest.raises(TimeoutError, match="still Running after 300s"):
        katib_status_mod.wait(
            cluster, "llmft-sweep", timeout_s=300, poll_s=60, sleep=lambda s: None, clock=lambda: next(clock)
        )


def test_resubmitting_the_same_experiment_is_idempotent(body):
    cluster, api = _fake_cluster([katib_status("Running")])
    katib_status_mod.submit(cluster, body)
    again = katib_status_mod.submit(cluster, body)  # a retried pipeline task
    assert again["metadata"]["name"] == "llmft-sweep" and len(api.created) == 1
    body["spec"]["algorithm"]["algorithmName"] = "random"
    with pytest.raises(SweepError, match="already exists .* with a different search"):
        katib_status_mod.submit(cluster, body)


@pytest.fixture
def cli_cluster(monkeypatch):
    """`llmft sweep` commands talk to this fake (the Cluster in between is real)."""
    holder = {}

    def install(statuses):
        cluster, api = _fake_cluster(statuses)
        monkeypatch.setattr("llmft.commands.sweep.make_cluster", lambda args: cluster)
        holder["api"] = api
        return api

    return install


def test_cli_create_status_best(cli_cluster, capsys, tmp_path):
    api = cli_cluster(
        [
            katib_status("Running", trials={"trials": 2, "trialsRunning": 2}),
            katib_status("Succeeded", best=BEST, reason="ExperimentMaxTrialsReached"),
        ]
    )
    out = tmp_path / "exp.yaml"
    assert (
        llmft_main(
            [
                "sweep",
                "create",
                "data=/data/tokenized/abc",
                "algorithm=random",
                "max_trials=6",
                "train.max_steps=50",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    namespace, sent = api.created[0]
    assert namespace == "team-a" and sent["spec"]["algorithm"]["algorithmName"] == "random"
    args = trial_words(
        sent["spec"]["trialTemplate"]["trialSpec"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ][0]
    )
    assert "max_steps=50" in args and "max_steps=200" not in args and "data=/data/tokenized/abc" in args
    assert out.read_text().splitlines()[1].startswith("# Katib Experiment")  # after the owned-file mark
    assert llmft_main(["sweep", "status", "llmft-sweep"]) == 0
    assert "experiment llmft-sweep: Running" in capsys.readouterr().out
    assert llmft_main(["sweep", "best", "llmft-sweep"]) == 0
    assert capsys.readouterr().out.splitlines() == EXPECTED_BEST


def test_cli_failed_experiment(cli_cluster, capsys):
    cli_cluster(
        [
            katib_status(
                "Failed",
                reason="ExperimentMaxFailedTrialsReached",
                message="max failed count",
                trials={"trials": 4, "trialsFailed": 4},
            )
        ]
    )
    assert llmft_main(["sweep", "create", "data=/data/tokenized/abc", "--wait"]) == 1
    err = capsys.readouterr().err
    assert "experiment llmft-sweep failed: ExperimentMaxFailedTrialsReached" in err and "failed 4" in err
    assert llmft_main(["sweep", "status", "llmft-sweep"]) == 1
    assert llmft_main(["sweep", "best", "llmft-sweep"]) == 1
    assert "no optimal trial yet (Failed" in capsys.readouterr().err


def test_cli_status_of_a_missing_experiment(cli_cluster, capsys):
    cli_cluster([{}])
    assert llmft_main(["sweep", "status", "nope"]) == 1
    assert "HTTP 404" in capsys.readouterr().err


def test_cli_dry_run_refuses_what_katib_would(capsys):
    assert llmft_main(["sweep", "create", "--dry-run", "data=/d", "parallel_trials=20"]) == 1
    assert "spec.parallelTrialCount: 20 should be <= spec.maxTrialCount 12 [webhook]" in capsys.readouterr().err
    assert llmft_main(["sweep", "create", "--dry-run", "algorithm=grid"]) == 1
    assert "data= is required" in capsys.readouterr().err
