"""`llmft bench ...`: the benchmarks' code. What they measured is data, kept outside the package.

The committed results and GPU logs live in the checkout's top-level ``benchmarks/`` folder
(``benchmarks/README.md``), not here: no wheel or image carries them.
"""

from pathlib import Path

RESULTS_DIR = Path("benchmarks/results")
"""Where every ``llmft bench`` command writes by default: ``benchmarks/results`` under the current directory,
so a run from the checkout's root (``make bench``) lands beside the committed results."""
