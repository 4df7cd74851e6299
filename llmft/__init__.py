"""kfp-llm-finetune: one import root for everything the distribution installs.

The project's packages live under ``llmft/`` (``llmft/trainer/``, ``llmft/components/``,
``llmft/pipelines/``, ``llmft/katib/``, ``llmft/benchmarks/``): the path on disk is the import
path, so Python, setuptools, mypy and any tool that reads imports from the files see one tree,
and an installed package never puts generic names such as ``trainer`` into site-packages (a
distribution named ``trainer`` exists on PyPI). The top-level ``trainer``, ``components``, ...
of the checkout are committed relative links into ``llmft/``, for readers of the layout only.
docs/architecture.md says why.
"""

SUBPACKAGES = ("trainer", "components", "pipelines", "katib", "benchmarks")
"""The folders under ``llmft/`` imported as ``llmft.<name>`` (the checkout's top-level ``<name>`` links to each)."""
