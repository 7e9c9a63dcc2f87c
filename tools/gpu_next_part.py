"""The next part of tools/gpu_check.sh to run: the first, in tools/gpu_parts.tsv's order of
value, never measured or whose code changed after the commit it was measured at.

    python tools/gpu_next_part.py          # prints the part, or "none" when all are current
    python tools/gpu_next_part.py --why    # one line per part: why it is (not) due

Needs git; tools/gpu_carry.sh writes its answer to .gpu/next_part for a checkout without
.git (the GPU machine gets the working tree only).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "tools", "gpu_parts.tsv")


def read_table(path: str = TABLE) -> list[tuple[str, str, list[str]]]:
    """(part, commit or "-", paths) per row, in the file's order."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            part, commit, _date, paths = line.rstrip("\n").split("\t")
            rows.append((part, commit, paths.split()))
    return rows


def why_due(commit: str, paths: list[str], *, root: str = ROOT) -> str | None:
    """Why a part measured at ``commit`` is due again (None: it is current)."""
    if commit == "-":
        return "never measured"
    changed = subprocess.run(["git", "-C", root, "log", "--format=%h", f"{commit}..HEAD", "--",
                              *paths], capture_output=True, text=True, check=True).stdout.split()
    if changed:
        return f"{len(changed)} commit(s) changed its code since {commit} (newest {changed[0]})"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--why", action="store_true", help="one line per part")
    args = parser.parse_args(argv)
    due = []
    for part, commit, paths in read_table():
        reason = why_due(commit, paths)
        if args.why:
            print(f"{part}: {reason or 'current (measured at ' + commit + ')'}")
        if reason:
            due.append(part)
    if not args.why:
        print(due[0] if due else "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
