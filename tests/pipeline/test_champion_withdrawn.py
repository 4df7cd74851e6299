"""The withdrawn-version rule of the champion choice, in milliseconds (test_pipeline_champion.py shows it against a
real `mlflow server` in about a minute): a version tagged llmft.withdrawn is never the best, whatever its metric.
The client is the one call best_version makes, answering with versions as MLflow returns them (version, tags)."""

from __future__ import annotations

from types import SimpleNamespace

from llmft.components.lib.registry.mlflow_registry import PERPLEXITY_TAG, WITHDRAWN_TAG, best_version


class _Registry:
    def __init__(self, *versions):
        self.versions = versions
        self.filters: list[str] = []

    def search_model_versions(self, filter_string):
        self.filters.append(filter_string)
        return list(self.versions)


def _version(number: int, perplexity: float, **tags):
    return SimpleNamespace(version=str(number), tags={PERPLEXITY_TAG: str(perplexity), **tags})


def test_a_withdrawn_version_is_never_the_best():
    withdrawn = _version(2, 1.5, **{WITHDRAWN_TAG: "answers in the wrong language"})
    registry = _Registry(_version(1, 20.0), withdrawn, _version(3, 12.0))
    assert best_version(registry, "it's").version == "3"
    assert registry.filters == ["name = 'it\\'s'"]


def test_without_withdrawals_the_lowest_perplexity_then_the_lowest_version_wins():
    assert best_version(_Registry(_version(1, 20.0), _version(2, 5.0), _version(3, 12.0)), "m").version == "2"
    assert best_version(_Registry(_version(4, 5.0), _version(2, 5.0)), "m").version == "2"
    only_withdrawn = _Registry(_version(1, 1.0, **{WITHDRAWN_TAG: "bad"}))
    assert best_version(only_withdrawn, "m") is None
