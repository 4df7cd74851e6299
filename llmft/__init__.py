"""kfp-llm-finetune: one import root for everything the distribution installs.

The project's packages live under ``llmft/`` (``llmft/trainer/``, ``llmft/components/``,
``llmft/pipelines/``, ``llmft/katib/``, ``llmft/benchmarks/``, ``llmft/demo/``): the path on disk is the import
path, so Python, setuptools, mypy and any tool that reads imports from the files see one tree,
and an installed package never puts generic names such as ``trainer`` into site-packages (a
distribution named ``trainer`` exists on PyPI). The checkout's top-level ``trainer/``, ``components/``,
``pipelines/``, ``katib/`` and ``benchmarks/`` are not packages: they hold what a user takes from the
repository (trainer configs, component specs, compiled pipelines, Katib Experiments, benchmark results),
and no Python file. docs/architecture.md says why.
"""

SUBPACKAGES = ("trainer", "components", "pipelines", "katib", "benchmarks", "demo")
"""The folders under ``llmft/`` imported as ``llmft.<name>`` (never as ``<name>``: the checkout's top-level
``<name>/`` holds no Python file)."""
