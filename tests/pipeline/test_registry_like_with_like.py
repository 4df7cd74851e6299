"""The champion is chosen only among versions scored alike, and under a higher-is-better metric the highest wins
(issue 43 item 4; issue 45's survivor `sign = 1.0` in best_version). A fake MLflow client keeps these fast; the
MLflow-server tests (test_pipeline_task_eval.py, test_pipeline_registry.py) run the same code against mlflow."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from llmft.components.lib.registry.mlflow_registry import (
    CHAMPION_ALIAS,
    EVAL_SET_TAG_PREFIX,
    WITHDRAWN_TAG,
    best_version,
    eval_set_identity,
    update_champion,
)


@dataclass
class Version:
    version: str
    tags: dict = field(default_factory=dict)
    run_id: str = ""
    source: str = ""


class FakeRegistry:
    """What update_champion calls of MlflowClient (mlflow 3.17): search_model_versions, get_model_version,
    get_model_version_by_alias (MlflowException RESOURCE_DOES_NOT_EXIST when unset), set_registered_model_alias."""

    def __init__(self):
        self.versions: list[Version] = []
        self.alias: str | None = None

    def add(self, metric: str, value: float, identity: str, promote_metric: str | None = None) -> str:
        tag = "llmft.eval_perplexity" if metric == "perplexity" else f"llmft.eval.{metric}"
        key = "perplexity" if metric == "perplexity" else metric.partition(".")[0]
        tags = {tag: repr(value), EVAL_SET_TAG_PREFIX + key: identity, "llmft.promote_metric": promote_metric or metric}
        self.versions.append(Version(str(len(self.versions) + 1), tags))
        return self.versions[-1].version

    def search_model_versions(self, _filter):
        return list(self.versions)

    def get_model_version(self, _name, version):
        return next(v for v in self.versions if v.version == str(version))

    def get_model_version_by_alias(self, _name, _alias):
        if self.alias is None:
            from mlflow.exceptions import MlflowException
            from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

            raise MlflowException("no alias", error_code=RESOURCE_DOES_NOT_EXIST)
        return self.get_model_version(_name, self.alias)

    def set_registered_model_alias(self, _name, alias, version):
        assert alias == CHAMPION_ALIAS
        self.alias = str(version)


SET_A = eval_set_identity({"hash": "a" * 64, "size": 16})
SET_B = eval_set_identity({"hash": "b" * 64, "size": 20})


def _register(reg: FakeRegistry, metric: str, value: float, identity: str = SET_A) -> dict:
    version = reg.add(metric, value, identity)
    return update_champion(reg, "m", version, value, metric=metric, identity=identity)


def test_under_a_higher_is_better_metric_the_highest_score_is_the_champion():
    reg = FakeRegistry()
    for value in (0.5, 0.9, 0.2):
        reg.add("heldout.contains", value, SET_A)
    assert best_version(reg, "m", "heldout.contains", SET_A).version == "2", "0.9 is the best contains"
    assert best_version(reg, "m", "perplexity") is None
    reg = FakeRegistry()
    first, better, worse = (_register(reg, "heldout.contains", v) for v in (0.5, 0.75, 0.25))
    assert first["is_champion"] and better["is_champion"] and not worse["is_champion"]
    assert reg.alias == "2" and "does not beat champion v2" in worse["alias_reason"]


def test_a_lower_perplexity_wins_under_perplexity():
    reg = FakeRegistry()
    facts = [_register(reg, "perplexity", v) for v in (3.0, 2.0, 9.0)]
    assert [f["is_champion"] for f in facts] == [True, True, False] and reg.alias == "2"


def test_a_champion_scored_on_another_metric_is_not_compared_and_stays():
    reg = FakeRegistry()
    _register(reg, "perplexity", 3.0)  # v1 on perplexity
    facts = _register(reg, "heldout.contains", 0.9)  # v2 on contains, perplexity unrecorded as its metric
    assert not facts["is_champion"] and reg.alias == "1", "the issue's flip: v2 must not take the alias"
    assert "not compared with champion v1: it has no recorded heldout.contains" in facts["alias_reason"]
    assert "\n" not in facts["alias_reason"] and WITHDRAWN_TAG in facts["alias_reason"]
    again = _register(reg, "perplexity", 2.5, identity=SET_A)  # a later perplexity run: compared with v1, wins
    assert again["is_champion"] and reg.alias == "3"


def test_a_champion_scored_on_another_question_set_is_not_compared():
    reg = FakeRegistry()
    _register(reg, "heldout.contains", 0.5, identity=SET_A)
    facts = _register(reg, "heldout.contains", 0.9, identity=SET_B)  # more questions, another file
    assert not facts["is_champion"] and reg.alias == "1"
    assert f"scored on {SET_A}, this version's on {SET_B}" in facts["alias_reason"]
    reg.versions[0].tags[WITHDRAWN_TAG] = "old question set"  # the user retires it: like versions compete
    assert _register(reg, "heldout.contains", 0.7, identity=SET_B)["is_champion"] is False
    assert reg.alias == "2", "the best of the versions scored on SET_B"


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        ({"hash": "ab" * 32, "size": 16}, f"sha:{'ab' * 8};n:16"),
        ({"hash": "c" * 64, "size": 8, "version": "1.0", "num_fewshot": -1, "limit": 500},
         f"sha:{'c' * 16};n:8;v:1.0;fewshot:-1;limit:500"),
    ],
)  # fmt: skip
def test_the_identity_names_hash_size_version_and_settings(found, expected):
    assert eval_set_identity(found) == expected
