"""Progress bars for the long data steps (tqdm on stderr).

On a terminal the bar refreshes twice a second; in a pod log (no TTY) it prints
a line every 15 s instead of flooding the log. ``LLMFT_PROGRESS=0`` turns bars off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import tqdm


def progress(iterable: Iterable | None = None, *, desc: str, total: int | None = None, unit: str = "rows"):
    tty = sys.stderr.isatty()
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=f" {unit}",
        unit_scale=True,
        disable=os.environ.get("LLMFT_PROGRESS", "1") == "0",
        mininterval=0.5 if tty else 15.0,
        leave=False,
        dynamic_ncols=True,
        file=sys.stderr,
    )
