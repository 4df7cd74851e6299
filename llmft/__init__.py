"""kfp-llm-finetune: one import root for everything the distribution installs.

The project's top-level folders (``trainer/``, ``components/``, ``pipelines/``, ``katib/``,
``benchmarks/``) are imported as ``llmft.trainer``, ``llmft.components``, ... so that an
installed package never puts generic names such as ``trainer`` into site-packages (a
distribution named ``trainer`` exists on PyPI). In a wheel, setup.cfg's ``package_dir`` maps
each folder under ``llmft/``; in a source checkout (an editable install, a ``PYTHONPATH=.``
run on a GPU machine) the folders sit beside this one, so the checkout's root joins this
package's search path. docs/architecture.md says why.
"""

import os as _os

SUBPACKAGES = ("trainer", "components", "pipelines", "katib", "benchmarks")
"""Top-level folders of the checkout that are imported as ``llmft.<name>``."""

_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "setup.cfg")) and _os.path.isfile(
    _os.path.join(_checkout, "trainer", "__init__.py")
):
    __path__.append(_checkout)  # noqa: F821 - the package's own search path
