"""Check that two runs stored the same trajectories: rollout, reward and advantage files, column by column.

Used to show that a refactoring changed no behaviour: train the same recipe for a few iterations
with the code before and after (same seed, same machine), then compare the two run folders::

    git worktree add /tmp/before <commit>
    (cd /tmp/before && PYTHONPATH=. python -c 'from trajflow.cli import main; main()' train --run-id sync \
        trainer.total_iterations=3 trainer.test_freq=0 trainer.save_freq=0 store.root=/tmp/runs-before)
    trajflow train --run-id sync trainer.total_iterations=3 trainer.test_freq=0 trainer.save_freq=0 \
        store.root=/tmp/runs-after
    python benchmarks/same_trajectories.py /tmp/runs-before/sync /tmp/runs-after/sync

How files are compared: each stage file is read with pyarrow, with today's column names
(:func:`trajflow.batch.upgrade_stage_table`: a schema-2 ``old_logprobs`` reads as
``rollout_logprobs``); the columns both files have must be equal value for value
(``pa.Table.equals`` on those columns, types included: float log-probs bit for bit); a column only
in the newer file must be one a later schema added (``temperature``, ``top_p``, ``top_k``); a
column only in the older file is a failure. Prints one line per file and ``PASS`` or ``MISS``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

from trajflow.batch import upgrade_stage_table

#: Columns a newer schema adds to a stage file (the sampling settings of schema 3).
ADDED = {"rollout": {"temperature", "top_p", "top_k"}, "reward": set(), "advantage": set()}


def compare_file(before: Path, after: Path, stage: str) -> tuple[bool, str]:
    """Compare one stage file of two runs; returns (same, one line saying how)."""
    a, b = upgrade_stage_table(pq.read_table(before)), upgrade_stage_table(pq.read_table(after))
    shared = [c for c in a.column_names if c in b.column_names]
    lost = sorted(set(a.column_names) - set(b.column_names))
    extra = sorted(set(b.column_names) - set(a.column_names))
    unexpected = sorted(set(extra) - ADDED[stage])
    differ = [c for c in shared if not a.column(c).equals(b.column(c))]
    ok = a.num_rows == b.num_rows and not lost and not unexpected and not differ
    what = (f"{a.num_rows} rows, {len(shared)} shared columns equal" if ok else
            f"rows {a.num_rows} vs {b.num_rows}, differ {differ}, lost {lost}, unexpected {unexpected}")
    return ok, f"{what}; added {extra}" if extra else what


def compare_runs(before: Path, after: Path, iterations: list[int] | None = None) -> bool:
    """Compare every stored iteration (or ``iterations``) of two run folders; prints a line per file."""
    its = iterations or sorted(int(p.name) for p in (before / "iterations").iterdir() if p.name.isdigit())
    same = bool(its)
    for it in its:
        for stage in ("rollout", "reward", "advantage"):
            name = f"iterations/{it:06d}/{stage}.parquet"
            if not (before / name).exists() or not (after / name).exists():
                print(f"{name}: missing in {'before' if not (before / name).exists() else 'after'}")
                same = False
                continue
            ok, line = compare_file(before / name, after / name, stage)
            print(f"{name}: {line}")
            same &= ok
    return same


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="run folder written by the code before the change")
    ap.add_argument("after", type=Path, help="run folder written by the code after it")
    ap.add_argument("--iterations", type=int, nargs="*", help="iterations to compare (default: all stored)")
    args = ap.parse_args(argv)
    same = compare_runs(args.before, args.after, args.iterations)
    print("PASS: same trajectories" if same else "MISS: the trajectories differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
