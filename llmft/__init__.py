"""kfp-llm-finetune: one import root for everything the distribution installs.

The project's top-level folders (``trainer/``, ``components/``, ``pipelines/``, ``katib/``,
``benchmarks/``) are imported as ``llmft.trainer``, ``llmft.components``, ... so that an
installed package never puts generic names such as ``trainer`` into site-packages (a
distribution named ``trainer`` exists on PyPI). ``llmft/<name>`` is a committed relative
symlink to ``../<name>``: Python, setuptools, mypy and structure tools read a plain package
tree, and a wheel holds the files themselves. docs/architecture.md says why.
"""

SUBPACKAGES = ("trainer", "components", "pipelines", "katib", "benchmarks")
"""Top-level folders of the checkout that are imported as ``llmft.<name>`` (``llmft/<name>`` links to each)."""
