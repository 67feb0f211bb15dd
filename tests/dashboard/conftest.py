"""Two real 3-iteration runs (tiny model, real Prefect/Ray/MLflow) shared by the compare and dashboard tests.

The runs differ only in ``actor.lr``. Their reward is a dense custom scorer (share of vowels among
the response's letters) so that scores vary inside each GRPO group, advantages are non-zero and the
two learning rates give visibly different curves; the random tiny model never earns the arithmetic
task's own reward. Gates are on, so every iteration has a ``gate.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides

REWARD_FILE = '''
def vowel_share(data_source, solution_str, ground_truth, extra_info=None):
    """Share of vowels among the ASCII letters of the response (0 when it has none)."""
    letters = [c for c in solution_str.lower() if "a" <= c <= "z"]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
'''

RUNS = {"lr-high": "0.1", "lr-low": "1e-05"}  # run id -> actor.lr, as the config prints it


@dataclass
class TwoRuns:
    root: Path                 # store root (run folders + mlflow.db)
    tracking_uri: str          # sqlite:///<root>/mlflow.db
    names: list                # trajflow run ids, in RUNS order
    mlflow_ids: dict           # run id -> MLflow run id
    train_s: dict              # run id -> seconds the train() call took


def _finished(root: Path) -> dict | None:
    metas = {n: root / n / "run.json" for n in RUNS}
    if not all(p.exists() for p in metas.values()):
        return None
    metas = {n: json.loads(p.read_text()) for n, p in metas.items()}
    if any(m.get("status") != "finished" for m in metas.values()):
        return None
    return {n: m["mlflow_run_id"] for n, m in metas.items()}


@pytest.fixture(scope="session")
def two_runs(request, tmp_path_factory) -> TwoRuns:
    """Train both runs (~1-2 min each on 2 busy cores).

    ``TRAJFLOW_TEST_REUSE_STORE=/some/dir`` (developers only) keeps the runs in that folder and reuses
    them in later sessions instead of training again.
    """
    reuse = os.environ.get("TRAJFLOW_TEST_REUSE_STORE")
    root = Path(reuse).resolve() if reuse else tmp_path_factory.mktemp("compare-store")
    ids = _finished(root) if reuse else None
    if ids is not None:
        return TwoRuns(root=root, tracking_uri=f"sqlite:///{root / 'mlflow.db'}", names=list(RUNS),
                       mlflow_ids=ids, train_s={})
    if reuse and root.exists():
        shutil.rmtree(root)
    request.getfixturevalue("ray_local")
    tiny_model_dir = request.getfixturevalue("tiny_model_dir")
    from trajflow.flows.train import train

    reward = tmp_path_factory.mktemp("reward") / "vowel_reward.py"
    reward.write_text(REWARD_FILE)
    ids, secs = {}, {}
    for name, lr in RUNS.items():
        t0 = time.perf_counter()
        summary = train(None, tiny_overrides(tiny_model_dir, root, **{
            "actor.lr": lr, "trainer.total_iterations": 3, "gates.enabled": "true",
            "reward.custom_function": f"{reward}:vowel_share"}), run_id=name)
        secs[name] = time.perf_counter() - t0
        ids[name] = summary["mlflow_run_id"]
    return TwoRuns(root=root, tracking_uri=f"sqlite:///{root.resolve() / 'mlflow.db'}", names=list(RUNS),
                   mlflow_ids=ids, train_s=secs)
