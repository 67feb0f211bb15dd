"""Overlapped rollout and training (``trainer.max_staleness``): config rules, the sync pipeline kept
bit for bit at 0, the off-policy schedules at 1 and 2, and exact resume after a crash with
rollouts in flight, plus replay of a stored off-policy iteration.

The runs use the tiny random model with real Ray, real Prefect and MLflow on SQLite: in-process
for the synchronous comparison, ``python -m trajflow.cli`` subprocesses (the module-scoped Prefect
server of ``test_resume_replay_audit``) where a run is killed with SIGKILL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from tests.test_resume_replay_audit import STAGE_FILES, assert_same_weights, lab, ok, sha  # noqa: F401
from trajflow.config import load_config
from trajflow.errors import ConfigError

pytestmark = pytest.mark.timeout(1800)

POOLS = "{train: {num_cpus_per_worker: 1}, gen: {num_cpus_per_worker: 1}}"
SPLIT = {"resources.placement": "split", "resources.pools": POOLS, "actor.pool": "train", "rollout.pool": "gen",
         "trainer.num_threads": 1, "rollout.dtype": "float32", "actor.mixed_precision.param_dtype": "float32"}


def _ov(**extra) -> list[str]:
    return [f"{k}={v}" for k, v in {**SPLIT, **extra}.items()]


# ---------------------------------------------------------------------------- config


def test_max_staleness_defaults_to_zero_and_leaves_rollout_is_alone():
    cfg = load_config(None, ["rollout.dtype=float32"])  # a bf16 sampler would turn the correction on
    assert cfg.trainer.max_staleness == 0 and cfg.algorithm.rollout_is is None


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.max_staleness=-1"], r"trainer.max_staleness=-1 is out of range: must be >= 0"),
    (["trainer.max_staleness=1"], r"trainer.max_staleness=1 needs a separate rollout worker group .* set rollout.pool"),
    (_ov(**{"trainer.max_staleness": 2, "rollout.multi_turn.enable": True}),
     r"trainer.max_staleness=2 does not support rollout.multi_turn.enable=true"),
    (_ov(**{"trainer.max_staleness": 1, "algorithm.adv_estimator": "remax"}),
     r"trainer.max_staleness=1 does not support algorithm.adv_estimator='remax'"),
    (_ov(**{"trainer.max_staleness": 1, "algorithm.filter_groups.enable": True}),
     r"does not support algorithm.filter_groups.enable=true"),
])
def test_bad_max_staleness_is_one_line_naming_the_key_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_staleness_turns_the_rollout_correction_on_unless_the_user_chose():
    from stages.policy_update import update_batch_options

    on = load_config(None, _ov(**{"trainer.max_staleness": 1}))
    assert on.algorithm.rollout_is == "token"
    assert update_batch_options(on)["rollout_is"] == "token" and update_batch_options(on)["defer_weight_sync"]
    seq = load_config(None, _ov(**{"trainer.max_staleness": 1, "algorithm.rollout_is": "sequence"}))
    assert update_batch_options(seq)["rollout_is"] == "sequence"
    off = load_config(None, _ov(**{"trainer.max_staleness": 1, "algorithm.rollout_is": "disable"}))
    assert off.algorithm.rollout_is == "disable" and update_batch_options(off)["rollout_is"] is None
    deep = load_config(None, _ov(**{"trainer.max_staleness": 3}))
    assert deep.algorithm.rollout_is == "token" and update_batch_options(deep)["defer_weight_sync"]
    sync = load_config(None, _ov())
    assert update_batch_options(sync)["rollout_is"] is None and not update_batch_options(sync)["defer_weight_sync"]


def test_row_staleness_and_its_metrics_by_hand():
    from stages.staleness import row_staleness, staleness_metrics

    s = row_staleness([3, 2, 3, 1], 3)
    assert s.tolist() == [0, 1, 0, 2] and s.dtype == np.int64
    assert staleness_metrics(s) == {"rollout_corr/staleness_mean": 0.75, "rollout_corr/staleness_max": 2.0}
    assert staleness_metrics([]) == {"rollout_corr/staleness_mean": 0.0, "rollout_corr/staleness_max": 0.0}
    with pytest.raises(ValueError, match="row 1 has policy_version 5, newer than the trainer's 4"):
        row_staleness([4, 5], 4)


# ---------------------------------------------------------------------------- 0 = today's pipeline


def test_max_staleness_zero_stores_the_same_files_as_before(tiny_model_dir, ray_local, tmp_path):
    """An explicit ``trainer.max_staleness=0`` runs the synchronous pipeline: the same Parquet bytes
    as a run that does not set the key, and no staleness column or metric."""
    from flows.train import train

    runs = {}
    for name, extra in (("unset", {}), ("zero", {"trainer.max_staleness": 0})):
        runs[name] = Path(train(None, tiny_overrides(tiny_model_dir, tmp_path / name, **{"trainer.test_freq": 0},
                                                     **extra), run_id=name)["run_dir"])
    for it in (1, 2):
        for f in STAGE_FILES:
            a, b = (runs[n] / "iterations" / f"{it:06d}" / f for n in ("unset", "zero"))
            assert sha(a) == sha(b), f"iteration {it} {f} differs"
        d = runs["zero"] / "iterations" / f"{it:06d}"
        assert "staleness" not in pq.read_table(d / "advantage.parquet").column_names
        update = json.loads((d / "update.json").read_text())
        assert not any("staleness" in k for k in update) and update["policy_version"] == it
        rollout = pq.read_table(d / "rollout.parquet")
        assert set(rollout.column("policy_version").to_pylist()) == {it - 1}  # synchronous: on-policy


# ---------------------------------------------------------------------------- 1: schedule, resume, replay


def _written_at(run: Path, it: int) -> float:
    return json.loads((run / "iterations" / f"{it:06d}" / "manifest.json").read_text())["files"]["rollout"]["written_at"]


def _stage(run: Path, it: int, f: str):
    return pq.read_table(run / "iterations" / f"{it:06d}" / f)


@pytest.fixture(scope="module")
def overlap_runs(lab):
    """An uninterrupted ``max_staleness=1`` run of 4 iterations (``ref``), the same run killed with a
    rollout in flight and resumed twice (``k``), and a replay of ``ref``'s iteration 3."""
    store = lab.store("overlap")
    root = f"store.root={store}"
    ov = {**SPLIT, "trainer.max_staleness": 1, "trainer.total_iterations": 4}
    out = {"store": store}
    out["ref"] = lab.cli("ov-ref", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "ref")
    # Killed right after iteration 3's rollout went to the rollout workers, while update 2 trains:
    # checkpoint 1 is the newest, iteration 2's rollout (stored before checkpoint 1 completed) is reused.
    out["k1"] = lab.cli("ov-k1", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "k",
                        fault="rollout:3")
    out["k1_checkpoints"] = sorted(p.name for p in (store / "k" / "checkpoints").iterdir())
    out["k1_rollout2_written"] = _written_at(store / "k", 2)
    # Killed in update 3 (iteration 4's rollout in flight or done); checkpoint 2 is the newest.
    out["k2"] = lab.cli("ov-k2", "resume", "k", root, fault="update:3")
    out["k3"] = lab.cli("ov-k3", "resume", "k", root)
    out["replay"] = lab.cli("ov-replay", "replay", "ref", "--iteration", "3", "--from-stage", "reward", root,
                            "--run-id", "ref-it3")
    return out


def test_one_step_off_policy_schedule(overlap_runs):
    """Rollout k+1 is submitted before update k: it is generated by the weights after update k-1.
    By hand: rollouts of iterations 1..4 by versions 0, 0, 1, 2; the updates start from versions
    0, 1, 2, 3, so staleness 0, 1, 1, 1."""
    ok(overlap_runs["ref"])
    run = overlap_runs["store"] / "ref"
    versions, stale = [], []
    for it in (1, 2, 3, 4):
        r, a = _stage(run, it, "rollout.parquet"), _stage(run, it, "advantage.parquet")
        assert r.column("sample_id").equals(a.column("sample_id"))
        versions.append(sorted(set(r.column("policy_version").to_pylist())))
        stale.append(sorted(set(a.column("staleness").to_pylist())))
        update = json.loads((run / "iterations" / f"{it:06d}" / "update.json").read_text())
        assert update["policy_version"] == it
        assert update["rollout_corr/staleness_mean"] == update["rollout_corr/staleness_max"] == stale[-1][0]
        assert "rollout_corr/rollout_is_mean" in update  # the correction is on by default
        if it >= 2:  # stale rows: the trainer's log-probs differ from the behaviour policy's
            assert update["rollout_corr/rollout_is_max"] != pytest.approx(1.0, abs=1e-4)
            assert update["actor/rollout_logprob_diff"] > 1e-4
    assert versions == [[0], [0], [1], [2]]
    assert stale == [[0], [1], [1], [1]]
    assert "rollout_is: token" in (run / "config.yaml").read_text()


def _resumed_like_ref(runs: dict, iterations: int) -> Path:
    """Check that ``k``'s two sessions were SIGKILLed, its last one finished, and every stored
    rollout, reward and advantage file and the final weights equal ``ref``'s; returns the store."""
    import signal

    for name in ("k1", "k2"):
        step = runs[name]
        assert step.rc == -signal.SIGKILL, f"{name} exited {step.rc}:\n{step.stderr[-3000:]}"
    ok(runs["k3"])
    store = runs["store"]
    for it in range(1, iterations + 1):
        for f in STAGE_FILES:
            assert sha(store / "k" / "iterations" / f"{it:06d}" / f) == \
                sha(store / "ref" / "iterations" / f"{it:06d}" / f), f"iteration {it} {f} differs"
    assert_same_weights(store / "k" / "final" / "model.safetensors", store / "ref" / "final" / "model.safetensors")
    return store


def test_crash_with_a_rollout_in_flight_resumes_to_the_uninterrupted_run(overlap_runs):
    assert overlap_runs["k1_checkpoints"] == ["000001"]
    store = _resumed_like_ref(overlap_runs, 4)
    # The resumed session reused the rollout stored before checkpoint 1 instead of regenerating it.
    assert _written_at(store / "k", 2) == overlap_runs["k1_rollout2_written"]
    assert "resuming run k from checkpoint 000001" in overlap_runs["k2"].stdout
    assert "resuming run k from checkpoint 000002" in overlap_runs["k3"].stdout


def _replayed_update(runs: dict, child_id: str, it: int) -> tuple[Path, Path, dict]:
    """Check that a replay from the reward stage rewrote iteration ``it``'s stage files byte for byte and
    its update's metrics (``actor/*``, ``rollout_corr/*``, ``policy_version``) exactly; returns the
    parent and child run folders and the parent's ``update.json``."""
    ok(runs["ref"])
    ok(runs["replay"])
    parent, child = runs["store"] / "ref", runs["store"] / child_id
    d = f"{it:06d}"
    for f in STAGE_FILES:
        assert sha(child / "iterations" / d / f) == sha(parent / "iterations" / d / f)
    pm = json.loads((parent / "iterations" / d / "update.json").read_text())
    cm = json.loads((child / "iterations" / d / "update.json").read_text())
    compared = [k for k in pm if k.startswith(("actor/", "rollout_corr/")) or k == "policy_version"]
    assert "rollout_corr/staleness_max" in compared
    assert {k: cm[k] for k in compared} == {k: pm[k] for k in compared}
    return parent, child, pm


def test_replay_of_an_off_policy_iteration_reproduces_it(overlap_runs):
    parent, child, _ = _replayed_update(overlap_runs, "ref-it3", 3)
    assert_same_weights(child / "checkpoints" / "000003" / "actor" / "model.safetensors",
                        parent / "checkpoints" / "000003" / "actor" / "model.safetensors")


# ---------------------------------------------------------------------------- 2: a queue of two rollouts


@pytest.fixture(scope="module")
def overlap2_runs(lab):
    """An uninterrupted ``max_staleness=2`` run of 7 iterations with a checkpoint every 3 (``ref``),
    the same run killed twice with rollouts in flight and resumed (``k``), and a replay of ``ref``'s
    iteration 4. With a checkpoint after every iteration the driver would push the weights each
    time; every 3 leaves iterations whose rollouts load a snapshot taken when they were submitted."""
    store = lab.store("overlap2")
    root = f"store.root={store}"
    ov = {**SPLIT, "trainer.max_staleness": 2, "trainer.total_iterations": 7, "trainer.save_freq": 3}
    out = {"store": store}
    out["ref"] = lab.cli("ov2-ref", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "ref")
    # Rollout 6 is submitted at the top of iteration 4, after checkpoint 3 stored rollouts 4 and 5.
    out["k1"] = lab.cli("ov2-k1", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "k",
                        fault="rollout:6")
    out["k1_checkpoints"] = sorted(p.name for p in (store / "k" / "checkpoints").iterdir())
    out["k1_written"] = {it: _written_at(store / "k", it) for it in (4, 5)}
    # Killed in update 6: checkpoint 3 is still the newest; iterations 4 and 5 are complete, rollout 6
    # stored, rollout 7 (a snapshot of version 4) in flight or stored.
    out["k2"] = lab.cli("ov2-k2", "resume", "k", root, fault="update:6")
    out["k3"] = lab.cli("ov2-k3", "resume", "k", root)
    out["replay"] = lab.cli("ov2-replay", "replay", "ref", "--iteration", "4", "--from-stage", "reward", root,
                            "--run-id", "ref-it4")
    return out


def test_two_step_off_policy_schedule(overlap2_runs):
    """Rollout j is submitted before update j-2 and generated by the weights after update j-3. By
    hand: rollouts of iterations 1..7 by versions 0, 0, 0, 1, 2, 3, 4; the updates start from
    versions 0..6, so staleness 0, 1, 2, 2, 2, 2, 2. Rollouts 4, 5 and 7 load a snapshot (no
    checkpoint pushed their version), rollout 6 the weights pushed at checkpoint 3."""
    ok(overlap2_runs["ref"])
    run = overlap2_runs["store"] / "ref"
    versions, stale = [], []
    for it in range(1, 8):
        r, a = _stage(run, it, "rollout.parquet"), _stage(run, it, "advantage.parquet")
        versions.append(sorted(set(r.column("policy_version").to_pylist())))
        stale.append(sorted(set(a.column("staleness").to_pylist())))
        update = json.loads((run / "iterations" / f"{it:06d}" / "update.json").read_text())
        assert update["policy_version"] == it
        assert update["rollout_corr/staleness_max"] == stale[-1][0]
    assert versions == [[0], [0], [0], [1], [2], [3], [4]]
    assert stale == [[0], [1], [2], [2], [2], [2], [2]]
    # The driver draws iteration j's prompts while earlier rollouts run: the draws must still follow
    # one another as in a synchronous run, each prompt at most once per epoch (2 batches of 2 here).
    drawn = [sorted(set(_stage(run, it, "rollout.parquet").column("prompt_id").to_pylist())) for it in range(1, 7)]
    assert all(len(d) == 2 for d in drawn)
    for a, b in zip(drawn[0::2], drawn[1::2]):
        assert not set(a) & set(b), f"a prompt drawn twice in one epoch: {drawn}"


def test_crash_with_two_rollouts_in_flight_resumes_to_the_uninterrupted_run(overlap2_runs):
    assert overlap2_runs["k1_checkpoints"] == ["000003"]
    store = _resumed_like_ref(overlap2_runs, 7)
    # The resumed sessions reused the rollouts stored before checkpoint 3 instead of regenerating them.
    assert {it: _written_at(store / "k", it) for it in (4, 5)} == overlap2_runs["k1_written"]
    for name in ("k2", "k3"):
        assert "resuming run k from checkpoint 000003" in overlap2_runs[name].stdout


def test_replay_of_a_two_step_stale_iteration_reproduces_it(overlap2_runs):
    # ``ref`` keeps no checkpoint 4 to compare weights with: the update's metrics above stand for them.
    _, _, pm = _replayed_update(overlap2_runs, "ref-it4", 4)
    assert pm["rollout_corr/staleness_max"] == 2


def test_a_failed_gate_stops_before_the_update_and_lets_the_rollout_in_flight_finish(tiny_model_dir, ray_local,
                                                                                     tmp_path):
    """The gate still runs before the update that would use the batch: a NaN score stops the run in
    iteration 1 with no advantages and no update, and the rollout of iteration 2 (submitted before
    the gate ran) ends and is stored before the workers close."""
    from flows.train import train
    from trajflow.errors import GateFailed
    from trajflow.store import RunStore

    scorer = tmp_path / "nan.py"
    scorer.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float('nan')\n")
    over = tiny_overrides(tiny_model_dir, tmp_path / "store", **{"gates.enabled": True, "trainer.test_freq": 0,
                                                                "reward.custom_function": f"{scorer}:score",
                                                                "trainer.max_staleness": 1, **SPLIT})
    with pytest.raises(GateFailed, match="score_not_null|score_finite"):
        train(None, over, run_id="gated")
    store = RunStore(tmp_path / "store", "gated")
    assert store.read_manifest(1)["status"] == "gated"
    assert not store.stage_path(1, "advantage").exists()
    assert not (store.iteration_dir(1) / "update.json").exists()
    assert store.verified_stage(2, "rollout") is not None
    assert set(store.read_stage(2, "rollout").column("policy_version").to_pylist()) == {0}
    assert store.read_run_meta()["status"] == "failed"
