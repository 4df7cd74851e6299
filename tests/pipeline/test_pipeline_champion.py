"""The ``champion`` alias under concurrent registrations (issue 29.5), against a real `mlflow server`.

MLflow has no compare-and-set on aliases (mlflow 3.17 ``MlflowClient.set_registered_model_alias(name,
alias, version)``, ``mlflow/tracking/client.py`` 5549), so two runs that read the champion and then each
set it race. The interleavings are forced: each registration runs in its own thread with its own
MlflowClient; a wrapper holds chosen calls until the other thread has made others."""

from __future__ import annotations

import threading
import uuid

import pytest
from test_pipeline_registry import registration

from llmft.components.lib.registry.mlflow_registry import CHAMPION_ALIAS, WITHDRAWN_TAG, is_champion, register_adapter

WAIT_S = 60  # a hook that waits longer than this means the interleaving did not happen: fail, never hang


def once(hook):
    """Run ``hook`` before the first call of the wrapped method only."""

    def wrap(method):
        pending = [hook]

        def paced(*args, **kwargs):
            if pending:
                pending.pop()()
            return method(*args, **kwargs)

        return paced

    return wrap


def then(method, after):
    """``method``, then ``after()`` (every call)."""

    def wrapped(*args, **kwargs):
        result = method(*args, **kwargs)
        after()
        return result

    return wrapped


def _wait(event: threading.Event) -> None:
    assert event.wait(WAIT_S), "the forced interleaving did not happen"


def _run(*jobs) -> list:
    results, errors = [None] * len(jobs), []

    def target(i, job):
        try:
            results[i] = job()
        except Exception as exc:  # noqa: BLE001 - re-raised below in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(i, job)) for i, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * 2)
    assert not errors, errors
    return results


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


@pytest.fixture
def uri(mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    return mlflow_server


@pytest.mark.slow
def test_two_runs_that_read_the_same_champion_leave_the_better_one_as_champion(uri, adapter_dir):
    """Both read champion v1 (a barrier), the better run sets the alias first, the worse one last: with
    read-then-set the worse version ends as champion and both runs deploy."""
    name = f"model-{uuid.uuid4().hex[:8]}"
    register_adapter(registration(name, adapter_dir, "run-0", 20.0), client=_client(uri))
    both_read, better_set = threading.Barrier(2, timeout=WAIT_S), threading.Event()
    worse, better = _client(uri), _client(uri)
    for client in (worse, better):  # both read the champion (v1) before either sets it
        client.get_model_version_by_alias = once(both_read.wait)(client.get_model_version_by_alias)
    better.set_registered_model_alias = then(better.set_registered_model_alias, better_set.set)
    worse.set_registered_model_alias = once(lambda: _wait(better_set))(worse.set_registered_model_alias)
    facts_worse, facts_better = _run(
        lambda: register_adapter(registration(name, adapter_dir, "run-worse", 15.0), client=worse),
        lambda: register_adapter(registration(name, adapter_dir, "run-better", 10.0), client=better),
    )
    champion = _client(uri).get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert champion.version == facts_better["version"], "the better version is the champion"
    assert facts_better["is_champion"] and not facts_worse["is_champion"], "only the better run deploys"
    assert facts_worse["champion_version"] == facts_better["version"]


@pytest.mark.slow
def test_a_stale_write_from_a_run_that_never_saw_the_better_version_is_undone(uri, adapter_dir):
    """The worse run decides before the better version exists and writes after the better run did: its own
    check after the write finds the better version and moves the alias back."""
    name = f"model-{uuid.uuid4().hex[:8]}"
    register_adapter(registration(name, adapter_dir, "run-0", 20.0), client=_client(uri))
    worse_decided, better_set = threading.Event(), threading.Event()
    worse, better = _client(uri), _client(uri)

    def signal_once_decided(found):
        if any((v.tags or {}).get("llmft.pipeline_run_id") == "run-worse" for v in found):
            worse_decided.set()  # it ranked the versions, the better one not among them yet
        return found

    search = worse.search_model_versions
    worse.search_model_versions = lambda *a, **k: signal_once_decided(search(*a, **k))
    worse.set_registered_model_alias = once(lambda: _wait(better_set))(worse.set_registered_model_alias)
    better.create_model_version = once(lambda: _wait(worse_decided))(better.create_model_version)
    better.set_registered_model_alias = then(better.set_registered_model_alias, better_set.set)
    facts_worse, facts_better = _run(
        lambda: register_adapter(registration(name, adapter_dir, "run-worse", 15.0), client=worse),
        lambda: register_adapter(registration(name, adapter_dir, "run-better", 10.0), client=better),
    )
    champion = _client(uri).get_model_version_by_alias(name, CHAMPION_ALIAS)
    assert champion.version == facts_better["version"]
    assert not facts_worse["is_champion"] and facts_worse["champion_version"] == facts_better["version"]


@pytest.mark.slow
def test_a_withdrawn_version_never_becomes_champion_again(uri, adapter_dir):
    """The documented rollback: tag the bad version; the next registration crowns the best of the rest."""
    name = f"model-{uuid.uuid4().hex[:8]}"
    client = _client(uri)
    register_adapter(registration(name, adapter_dir, "run-1", 20.0), client=client)
    bad = register_adapter(registration(name, adapter_dir, "run-2", 5.0), client=client)
    client.set_model_version_tag(name, bad["version"], WITHDRAWN_TAG, "answers in the wrong language")
    third = register_adapter(registration(name, adapter_dir, "run-3", 12.0), client=client)
    assert third["is_champion"] and client.get_model_version_by_alias(name, CHAMPION_ALIAS).version == "3"


def test_a_registration_without_the_is_champion_key_is_not_the_champion():
    """llmft/components/deploy.py reads registration.json through is_champion: a missing key never deploys."""
    assert is_champion({"is_champion": True})
    assert not is_champion({}) and not is_champion({"is_champion": False}) and not is_champion({"is_champion": "yes"})


def test_the_deploy_request_decides_with_is_champion():
    """The one DeployRequest builder (the deploy step's and make demo-real's) reads registration.json
    through is_champion: a missing key never deploys under deploy_policy=champion."""
    import inspect

    from plan_helpers import make_plan

    from llmft.components.deploy import deploy_adapter
    from llmft.components.lib.serving.deployment import plan_deploy_request

    assert "plan_deploy_request(" in inspect.getsource(deploy_adapter.python_func)
    plan = make_plan()
    kwargs = {"adapter_dir": "/data/models/m/r", "form": "lora"}
    old = plan_deploy_request(plan, registered={"model_name": "m", "version": 2}, **kwargs)
    champion = plan_deploy_request(plan, registered={"model_name": "m", "version": 3, "is_champion": True}, **kwargs)
    assert not old.is_champion and champion.is_champion and champion.version == "3"
    assert champion.base_model == plan.trainer.model and champion.max_lora_rank == plan.serving.max_lora_rank


def test_a_run_without_mlflow_deploys_its_promoted_adapter_under_the_champion_policy():
    """registration.json ``registered: false`` (no MLflow): no registry, no champion to compare with; the request
    serves the promoted adapter, labelled as unregistered (never a version 'None')."""
    from plan_helpers import make_plan

    from llmft.components.lib.registry.register_step import not_registered
    from llmft.components.lib.serving.deployment import UNREGISTERED, plan_deploy_request

    plan = make_plan(mlflow_tracking_uri="")
    request = plan_deploy_request(plan, adapter_dir="/data/models/m/r", registered=not_registered("m"), form="lora")
    assert request.is_champion and not request.registered and request.version == UNREGISTERED
    registered = {"model_name": "m", "version": "4", "is_champion": False}
    assert not plan_deploy_request(plan, adapter_dir="/x", registered=registered, form="lora").is_champion
