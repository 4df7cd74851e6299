"""`make mutation`'s report: the mutation score of each module mutmut mutated, from the verdicts it left in
mutants/**/*.meta (mutmut 3: ``exit_code_by_key``, one exit code of the test run per mutant).

Killed = the tests failed on the mutant (exit 1, or 3: pytest's internal error); survived = they passed (0);
a timeout counts as killed (the mutant hung the code: a test noticed); "no tests" and anything else count
against the score. Exit 1 when a module scores below --minimum (default 90%), so the command says so."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KILLED = {1, 3, 36, -24, 24, 152, 255}
SURVIVED = 0


def scores(root: Path) -> dict[str, tuple[int, int, list[str]]]:
    """module path -> (killed, mutants, surviving mutant names)."""
    found: dict[str, tuple[int, int, list[str]]] = {}
    for meta in sorted(root.rglob("*.py.meta")):
        verdicts = json.loads(meta.read_text()).get("exit_code_by_key") or {}
        if not verdicts:
            continue
        killed = sum(1 for code in verdicts.values() if code in KILLED)
        survivors = sorted(name for name, code in verdicts.items() if code not in KILLED)
        found[str(meta.relative_to(root)).removesuffix(".meta")] = (killed, len(verdicts), survivors)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", default="mutants", help="mutmut's working copy (default %(default)s)")
    parser.add_argument("--minimum", type=float, default=90.0, help="lowest score per module, percent")
    args = parser.parse_args(argv)
    table = scores(Path(args.mutants))
    if not table:
        print(f"no mutmut verdicts under {args.mutants}/: run `make mutation`", file=sys.stderr)
        return 1
    total_killed = total = 0
    low = []
    for module, (killed, count, survivors) in table.items():
        score = 100.0 * killed / count
        total_killed, total = total_killed + killed, total + count
        print(f"{score:6.1f}%  {killed:4d}/{count:<4d} {module}")
        for name in survivors:
            print(f"           survived: {name}  (mutmut show {name})")
        if score < args.minimum:
            low.append(module)
    print(f"{100.0 * total_killed / total:6.1f}%  {total_killed:4d}/{total:<4d} all")
    if low:
        print(f"below {args.minimum:g}%: {', '.join(low)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
