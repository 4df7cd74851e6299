"""Each rank's exit code, for `llmft train --nproc N` (llmft/commands/train.py): torchrun reports any rank's failure
as 1, so each rank records its own code in a folder the launcher names, and the launcher tells a failed rank from
one stopped by a signal. No torch here: the launcher imports this before torchrun starts."""

from __future__ import annotations

import os

EXIT_DIR_ENV = "LLMFT_EXIT_DIR"
"""Set by `llmft train --nproc N`: each rank writes its exit code there, so the launcher can tell
a failed rank from one stopped by a signal (torchrun reports any rank's failure as 1)."""


def write_rank_exit(code: int) -> None:
    directory = os.environ.get(EXIT_DIR_ENV)
    if directory and os.path.isdir(directory):
        rank = int(os.environ.get("RANK", "").strip() or 0)
        with open(os.path.join(directory, f"rank-{rank}"), "w") as fh:
            fh.write(f"{code}\n")


def read_rank_exits(directory: str) -> dict[int, int]:
    """{rank: exit code} of the ranks that recorded one (a rank killed by a signal records none)."""
    codes = {}
    for name in os.listdir(directory):
        try:
            with open(os.path.join(directory, name)) as fh:
                codes[int(name.removeprefix("rank-"))] = int(fh.read().strip())
        except (OSError, ValueError):
            continue
    return codes
