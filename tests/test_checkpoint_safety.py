"""A checkpoint folder cannot run code, and one that was changed is skipped on resume.

Old checkpoints held the optimizer and RNG state as a torch pickle (``actor_state.pt``) read with
``weights_only=False``: a payload planted there ran on ``resume``. Now nothing in a checkpoint is a
pickle, and every file is checked against the checkpoint's sha256 manifest before it is loaded.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import tiny_overrides
from tests.payloads import RunsCode


def test_state_files_round_trip_optimizer_and_rng_exactly(tmp_path):
    from trajflow.state_files import load_state, rng_state, save_state, set_rng_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    np.random.seed(3)
    files = save_state({"optimizer": opt.state_dict(), "steps": 7, "rng": rng_state()}, tmp_path, "s")
    assert sorted(p.name for p in files) == ["s.json", "s.safetensors"]
    expected = (torch.rand(3), np.random.rand(3), __import__("random").random())
    back = load_state(tmp_path, "s")
    assert back["steps"] == 7
    ref = opt.state_dict()
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    for pid, st in ref["state"].items():
        for k, v in st.items():
            got = back["optimizer"]["state"][pid][k]
            assert got.dtype == v.dtype and torch.equal(got, v), (pid, k)
    set_rng_state(back["rng"])
    again = (torch.rand(3), np.random.rand(3), __import__("random").random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and expected[2] == again[2]
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2.load_state_dict(back["optimizer"])  # the rebuilt state is one the optimizer accepts
    with pytest.raises(TypeError, match="without pickle"):
        save_state({"bad": object()}, tmp_path, "x")


def test_a_tampered_checkpoint_is_never_unpickled_and_is_skipped_on_resume(tiny_model_dir, ray_local, tmp_path,
                                                                           capfd):
    from trajflow.flows.train import resume, train

    old_mask = os.umask(0o022)
    try:
        summary = train(None, tiny_overrides(tiny_model_dir, tmp_path, **{"trainer.test_freq": 0}), run_id="tamper")
    finally:
        os.umask(old_mask)
    run = Path(summary["run_dir"])
    # files a user can share: every file follows the umask (022 -> 0644), none is 0600
    modes = {str(p.relative_to(run)): oct(p.stat().st_mode & 0o777) for p in run.rglob("*")
             if p.is_file()}
    assert {m for m in modes.values()} == {"0o644"}, {k: v for k, v in modes.items() if v != "0o644"}
    actor2 = run / "checkpoints" / "000002" / "actor"
    assert not list(run.rglob("*.pt")) and not list(run.rglob("*.pkl"))  # no pickle anywhere
    marker = tmp_path / "payload-ran"
    for d in (actor2, run / "checkpoints" / "000001" / "actor"):
        (d / "actor_state.pt").write_bytes(pickle.dumps(RunsCode(str(marker))))
    st = actor2 / "actor_state.safetensors"
    st.write_bytes(st.read_bytes()[:-64])  # truncated: fails the manifest

    capfd.readouterr()
    resumed = resume("tamper", [f"store.root={tmp_path}", "trainer.total_iterations=3"])
    err = capfd.readouterr().err
    assert not marker.exists()
    assert f"checkpoint 000002 skipped: {st} does not match the checkpoint's manifest" in err
    # A file the manifest does not list makes a checkpoint unloadable too (a manifest is an integrity
    # check, and what a checkpoint holds is exactly what trajflow wrote): checkpoint 1 is skipped as well,
    # and the run starts again from the initial model.
    stray = run / "checkpoints" / "000001" / "actor" / "actor_state.pt"
    assert f"checkpoint 000001 skipped: {stray} is not in the checkpoint's manifest" in err
    assert resumed["trained_iterations"] == [1, 2, 3]
    sessions = json.loads((run / "run.json").read_text())["sessions"]
    assert sessions[-1]["resumed_from_checkpoint"] is None


def _nan_gradient_worker():
    """A PolicyWorker whose every backward leaves a NaN in one gradient (a diverged step, on demand)."""
    from trajflow.workers.actor_update import PPOActor
    from trajflow.workers.policy import PolicyWorker

    class NaNGradientActor(PPOActor):
        def _micro_batch(self, *args, **kwargs):
            out = super()._micro_batch(*args, **kwargs)
            p = next(p for p in self.model.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")
            return out

    class NaNGradientWorker(PolicyWorker):
        actor_cls = NaNGradientActor

    return NaNGradientWorker


def test_non_finite_gradients_skip_the_step_and_stop_the_run(tiny_model_dir, ray_local, tmp_path):
    import trajflow.run.workers as workers
    from trajflow.flows.train import train
    from trajflow.errors import NonFiniteError

    workers.policy_worker_cls = _nan_gradient_worker()
    try:
        with pytest.raises(NonFiniteError, match=r"iteration 2: 2 optimizer steps in a row had a non-finite gradient"):
            train(None, tiny_overrides(tiny_model_dir, tmp_path, **{
                "trainer.total_iterations": 3, "trainer.max_nonfinite_steps": 2, "trainer.test_freq": 0}),
                run_id="nan")
    finally:
        workers.policy_worker_cls = None
    run = tmp_path / "nan"
    first = json.loads((run / "iterations" / "000001" / "update.json").read_text())
    assert first["actor/grad_norm_nonfinite"] == 1.0 and "actor/grad_norm" not in first
    assert not (run / "final").exists() and not (run / "iterations" / "000003").exists()
    # the skipped steps left the initial weights untouched: checkpoint 1 equals the initial model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    saved = load_file(str(run / "checkpoints" / "000001" / "actor" / "model.safetensors"))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(saved[k], initial[k]) for k in saved if k in initial)


REWARD = "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return {}\n"


def test_resume_refuses_a_custom_reward_function_the_run_did_not_record(tiny_model_dir, ray_local, tmp_path, capfd):
    from trajflow.flows.train import resume, train
    from trajflow.errors import ConfigError

    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("{}", "0.5"))
    over = tiny_overrides(tiny_model_dir, tmp_path, **{"trainer.test_freq": 0, "reward.custom_function": f"{fn}:score"})
    train(None, over, run_id="fn")
    meta = json.loads((tmp_path / "fn" / "run.json").read_text())
    import hashlib

    assert meta["custom_function"]["sha256"] == hashlib.sha256(fn.read_bytes()).hexdigest()
    fn.write_text(REWARD.replace("{}", "1.0"))  # someone changed the code after the run started
    with pytest.raises(ConfigError, match=r"names reward\.custom_function=.*reward\.py:score.*code named by a run "
                                          r"folder is not imported"):
        resume("fn", [f"store.root={tmp_path}", "trainer.total_iterations=3"])  # not named again: refused
    named = [f"store.root={tmp_path}", "trainer.total_iterations=3", f"reward.custom_function={fn}:score"]
    with pytest.raises(ConfigError, match=r"reward\.custom_function is .*reward\.py .* but the run recorded .*"
                                          r"reward\.trust_changed_custom_function=true"):
        resume("fn", named)  # named again, but the file is not the one the run started with
    capfd.readouterr()
    resumed = resume("fn", named + ["reward.trust_changed_custom_function=true"])
    assert f"reward.custom_function: importing {fn}" in capfd.readouterr().out
    assert resumed["trained_iterations"] == [3]


def test_reward_reuse_key_covers_the_custom_functions_code_and_the_prompt_text(tmp_path):
    from trajflow.config import load_config
    from trajflow.prompts import PromptRecord
    from trajflow.run.cache_keys import reward_inputs, rollout_inputs
    from trajflow.run.context import IterationState, RunContext
    from trajflow.store import RunStore, StageRef

    fn = tmp_path / "reward.py"
    fn.write_text(REWARD.replace("{}", "0.5"))
    cfg = load_config(None, [f"reward.custom_function={fn}:score"])
    ctx = RunContext(cfg=cfg, store=RunStore(tmp_path, "r"), model_path="m")
    ref = StageRef(iteration=1, stage="rollout", path=str(tmp_path / "rollout.parquet"), sha256="ab", rows=2)
    before = reward_inputs(ctx, 1, ref)
    fn.write_text(REWARD.replace("{}", "0.75"))  # same path, other code
    assert reward_inputs(ctx, 1, ref)["settings"] != before["settings"]

    def prompt(text):
        return PromptRecord(prompt_id="p0", data_source="s", messages=[{"role": "user", "content": text}],
                            ground_truth="1", extra_info={})

    ctx.iterations[1] = IterationState(iteration=1, prompts=[prompt("1+1?")], started=0.0)
    a = rollout_inputs(ctx, 1)
    ctx.iterations[1] = IterationState(iteration=1, prompts=[prompt("2+2?")], started=0.0)  # same id, new text
    assert rollout_inputs(ctx, 1) != a


def test_a_checkpoint_in_the_old_pickle_format_is_refused_not_loaded(tmp_path):
    from trajflow import checkpoint as ckpt
    from trajflow.store import RunStore

    store = RunStore(tmp_path, "old")
    d = ckpt.checkpoint_dir(store, 4)
    (d / "actor").mkdir(parents=True)
    (d / "actor" / "actor_state.pt").write_bytes(pickle.dumps(RunsCode(str(tmp_path / "ran"))))
    (d / ckpt.STATE_FILE).write_text(json.dumps({"policy_version": 4, "iteration": 4}))
    assert ckpt.newest_verified_checkpoint(store) == (None, [(4, f"{d / 'actor' / 'actor_state.pt'} is a pickle "
                                                          "(an older checkpoint format); it is not loaded, since a "
                                                          "pickle can run code")])
    assert not (tmp_path / "ran").exists()
