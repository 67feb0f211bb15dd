"""Every shipped algorithm recipe runs 2 iterations through the real train flow (Prefect, Ray, MLflow)
with the tiny model, and its stored outputs show the recipe's algorithm, checked by hand.

Rewards come from a hash bit of the response text (tests/algo_helpers.py), so groups have reward
variance and advantages are not trivially 0. One Ray (the ``ray_local`` fixture) serves all runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.algo_helpers import make_tiny_reward_model, write_hash_scorer
from tests.conftest import tiny_overrides

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("recipes")
    return SimpleNamespace(root=root, model=tiny_model_dir, scorer=write_hash_scorer(root))


def run(env, recipe: str, **extra):
    from trajflow.flows.train import train

    over = {"trainer.test_freq": 0, "trainer.log_samples": 0, "reward.custom_function": env.scorer, **extra}
    summary = train(recipe, tiny_overrides(env.model, env.root / "runs", **over))
    return Path(summary["run_dir"])


def stage(run_dir: Path, it: int, name: str):
    return pq.read_table(run_dir / "iterations" / f"{it:06d}" / f"{name}.parquet")


def it_json(run_dir: Path, it: int, name: str) -> dict:
    return json.loads((run_dir / "iterations" / f"{it:06d}" / name).read_text())


def joined(run_dir: Path, it: int) -> dict:
    """rollout + reward + advantage columns of one iteration as Python lists (rows line up by sample_id)."""
    out: dict = {}
    ids = None
    for name in ("rollout", "reward", "advantage"):
        t = stage(run_dir, it, name)
        if ids is None:
            ids = t.column("sample_id").to_pylist()
        assert t.column("sample_id").to_pylist() == ids
        out.update({c: t.column(c).to_pylist() for c in t.column_names})
    return out


def by_group(rows: dict) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(rows["group_id"]):
        groups.setdefault(g, []).append(i)
    return groups


def hash_bit(text: str) -> float:
    import hashlib

    return float(int(hashlib.sha256(text.encode()).hexdigest(), 16) % 2)


@pytest.fixture(scope="module")
def ppo_run(env):
    # adaptive KL controller with a short horizon, so its checkpointed state visibly moves
    return run(env, "ppo_gae", **{"rollout.n": 1, "algorithm.kl_ctrl.type": "adaptive",
                                  "algorithm.kl_ctrl.horizon": 10, "algorithm.kl_ctrl.target_kl": 0.1})


def test_ppo_gae(env, ppo_run):
    d = ppo_run
    for it in (1, 2):
        rows = joined(d, it)
        assert [len(v) for v in rows["values"]] == [len(r) for r in rows["response_ids"]]
        upd = it_json(d, it, "update.json")
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var",
                    "critic/grad_norm", "critic/kl", "actor/pg_loss"):
            assert key in upd, key
        # GAE with gamma 1: the critic's target is the sum of the remaining token rewards (incl. KL penalty)
        for tr, ret, v in zip(rows["token_rewards"], rows["returns"], rows["values"]):
            lam = 0.95  # returns = A(gamma=1, lam) + V; check the last token: A_T = r_T - V_T
            assert ret[-1] == pytest.approx(tr[-1], abs=1e-5)
            deltas = [tr[t] + (v[t + 1] if t + 1 < len(v) else 0.0) - v[t] for t in range(len(v))]
            adv, a = [], 0.0
            for delta in reversed(deltas):
                a = delta + lam * a
                adv.append(a)
            np.testing.assert_allclose(ret, np.array(adv[::-1]) + np.array(v), rtol=1e-4, atol=1e-5)
    # the value head starts at 0: iteration 1 reads V = 0 everywhere, iteration 2 the updated critic
    assert all(x == 0.0 for v in joined(d, 1)["values"] for x in v)
    assert any(x != 0.0 for v in joined(d, 2)["values"] for x in v)
    ckpt = d / "checkpoints" / "000002"
    assert (ckpt / "critic" / "model.safetensors").exists() and (ckpt / "critic" / "critic_state.safetensors").exists()
    # adaptive controller (Ziegler et al. 2019): beta *= 1 + clip(KL / target - 1, +-0.2) * n / horizon,
    # n = 2 prompts x 1 sample, starting from 0.001; iteration 2's reward used the beta after iteration 1
    beta = 0.001
    for it in (1, 2):
        upd = it_json(d, it, "update.json")
        assert upd["critic/kl_coef"] == pytest.approx(beta, rel=1e-9)
        beta *= 1 + min(max(upd["critic/kl"] / 0.1 - 1, -0.2), 0.2) * 2 / 10
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["kl_ctrl"]["type"] == "adaptive"
    assert state["kl_ctrl"]["value"] == pytest.approx(beta, rel=1e-9) and beta != 0.001


def test_lost_critic_is_rebuilt_from_the_stored_updates(env, ppo_run):
    """A recreated critic (worker died) = the newest checkpoint at or before the iteration + the stored
    critic updates since, re-applied: bit for bit the critic the run had (here: no checkpoint, one update)."""
    import ray
    from omegaconf import OmegaConf

    from trajflow.run import recovery, workers
    from trajflow.run.context import RunContext
    from trajflow.config import load_config
    from trajflow.store import RunStore

    d = ppo_run
    saved = env.root / "critic-after-it1"
    shutil.move(str(d / "checkpoints" / "000001"), saved)  # no checkpoint at or before iteration 1 now
    cfg = load_config(base=OmegaConf.load(d / "config.yaml"))
    ctx = RunContext(cfg=cfg, store=RunStore(cfg.store.root, d.name), model_path=str(env.model))
    truth = RunContext(cfg=cfg, store=ctx.store, model_path=str(env.model))
    try:
        workers.create_critic_worker(ctx)
        assert recovery.restore_critic(ctx, through=1) == 1
        workers.create_critic_worker(truth)
        ray.get(truth.critic.load_checkpoint.remote(str(saved / "critic")))
        assert ray.get(ctx.critic.weights_digest.remote()) == ray.get(truth.critic.weights_digest.remote())
    finally:
        for c in (ctx, truth):
            if c.critic is not None:
                ray.kill(c.critic)


def test_grpo(env):
    # rollout IS on: the hf engine's log-probs are the trainer's up to kernel noise, so the weights are ~1
    d = run(env, "grpo", **{"algorithm.rollout_is": "token"})
    for it in (1, 2):
        rows = joined(d, it)
        for idx in by_group(rows).values():
            s = np.array([rows["score"][i] for i in idx], dtype=np.float64)
            want = (s - s.mean()) / (s.std(ddof=1) + 1e-6) if s.max() > s.min() else np.zeros_like(s)
            for i, a in zip(idx, want):
                np.testing.assert_allclose(rows["advantages"][i], a, rtol=1e-5, atol=1e-6)
        assert "ref_logprobs" in rows  # KL as a loss needs the reference
        upd = it_json(d, it, "update.json")
        assert "actor/kl_loss" in upd
        assert upd["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert upd["rollout_corr/rollout_is_clipfrac"] == 0.0
    assert "loss_agg_mode: seq-mean-token-mean" in (d / "config.yaml").read_text()


def test_grpo_bf16_rollout(env):
    # bf16 compute over fp32 masters, a bf16 sampler, token-level rollout IS (C = 2).
    from trajflow.config import load_config

    shipped = load_config("grpo_bf16_rollout")
    assert shipped.actor.mixed_precision.param_dtype == "bfloat16" and shipped.rollout.dtype == "bfloat16"
    assert shipped.algorithm.rollout_is == "token"
    # tiny_overrides pins the dtypes to float32 for machine independence: give the recipe's back.
    d = run(env, "grpo_bf16_rollout", **{"actor.mixed_precision.param_dtype": "bfloat16", "rollout.dtype": "bfloat16"})
    assert json.loads((d / "run.json").read_text())["precision"]["rollout"] == "bfloat16"
    for it in (1, 2):
        upd = it_json(d, it, "update.json")
        # The trainer's pi_old is its own forward: the first PPO ratio is exactly 1 even so.
        assert upd["actor/ratio_first_step_max_abs_dev"] == 0.0
        # The bf16 sampler's log-probs differ from the fp32-master trainer's, a little.
        assert 0 < upd["rollout_corr/max_abs_diff"] < 1.0
        assert 0 < upd["rollout_corr/k3_kl"] < 0.05
        assert upd["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.05)
        # Both count the tokens with pi_old / pi_rollout > C (one from the IS weights, one from the diagnostics).
        assert upd["rollout_corr/truncated_frac"] == pytest.approx(upd["rollout_corr/rollout_is_clipfrac"])


def test_dr_grpo(env):
    d = run(env, "dr_grpo")
    for it in (1, 2):
        rows = joined(d, it)
        assert "ref_logprobs" not in rows  # no KL term: no reference model
        for idx in by_group(rows).values():
            s = np.array([rows["score"][i] for i in idx])
            for i in idx:  # Dr. GRPO: r_i - mean(r), no std division
                np.testing.assert_allclose(rows["advantages"][i], rows["score"][i] - s.mean(), rtol=1e-5, atol=1e-6)
    assert "loss_agg_mode: seq-mean-token-sum-norm" in (d / "config.yaml").read_text()


def test_rloo(env):
    d = run(env, "rloo")
    for it in (1, 2):
        rows = joined(d, it)
        for idx in by_group(rows).values():
            adv = np.array([rows["advantages"][i][0] for i in idx])
            assert adv.sum() == pytest.approx(0.0, abs=1e-5)  # leave-one-out advantages sum to 0 per group
            r = np.array([sum(rows["token_rewards"][i]) for i in idx])  # scores shaped by the KL penalty
            for k, i in enumerate(idx):
                loo = (r.sum() - r[k]) / (len(r) - 1)
                want = r[k] - loo if r.max() > r.min() else 0.0
                np.testing.assert_allclose(rows["advantages"][i], want, rtol=1e-4, atol=1e-5)
        assert "critic/kl" in it_json(d, it, "update.json")  # KL in the reward


def test_reinforce_pp(env):
    d = run(env, "reinforce_pp")
    for it in (1, 2):
        rows = joined(d, it)
        flat_ret = []
        for tr, ret in zip(rows["token_rewards"], rows["returns"]):
            np.testing.assert_allclose(ret, np.cumsum(tr[::-1])[::-1], rtol=1e-5, atol=1e-6)  # gamma 1 returns-to-go
            flat_ret.extend(ret)
        flat_ret = np.array(flat_ret, dtype=np.float64)
        want = (flat_ret - flat_ret.mean()) / np.sqrt(flat_ret.var(ddof=1) + 1e-8)  # batch whitening
        np.testing.assert_allclose(np.concatenate(rows["advantages"]), want, rtol=1e-4, atol=1e-5)
        assert "actor/kl_loss" in it_json(d, it, "update.json")


@pytest.fixture(scope="module")
def dapo_run(env):
    return run(env, "dapo", **{"reward.overlong_buffer.enable": True})  # tiny_overrides turns it off


def test_dapo(env, dapo_run):
    d = dapo_run
    total_batches = 0
    for it in (1, 2):
        rows = joined(d, it)
        record = it_json(d, it, "dynamic_sampling.json")
        upd = it_json(d, it, "update.json")
        total_batches += record["num_gen_batches"]
        assert upd["batch/num_gen_batches"] == record["num_gen_batches"] >= 1
        assert upd["batch/kept_groups"] == record["kept_groups"] == len(by_group(rows)) == 2
        assert record["extra_draws"] == record["num_gen_batches"] - 1
        for idx in by_group(rows).values():  # every kept group has accuracy variance
            acc = {json.loads(rows["reward_extra"][i])["acc"] for i in idx}
            assert acc == {0.0, 1.0}
        # overlong shaping: all tiny responses hit the 8-token cap, buffer 8 -> penalty -1 on the hash bit
        for text, n, score in zip(rows["response_text"], rows["response_ids"], rows["score"]):
            pen = -min(max((len(n) - (8 - 8)) / 8, 0.0), 1.0)
            assert score == pytest.approx(hash_bit(text) + pen)
        dropped_path = d / "iterations" / f"{it:06d}" / "dropped.parquet"
        if record["filtered_groups"] + record["surplus_groups"]:
            dropped = pq.read_table(dropped_path)
            assert len({g for g in dropped.column("group_id").to_pylist()}) == record["filtered_groups"] + record["surplus_groups"]
            assert not set(dropped.column("sample_id").to_pylist()) & set(rows["sample_id"])
        # clip-higher reached the policy loss config
    assert "clip_ratio_high: 0.28" in (d / "config.yaml").read_text()
    assert total_batches > 2, "the seeded test data should make dynamic sampling refill at least once"


def test_dapo_resume_replays_the_extra_prompt_draws(env, dapo_run):
    """A resumed iteration whose rollout is already stored moves the data cursor exactly as generating it did."""
    from trajflow.flows.train import train

    d = dapo_run
    it2 = d / "iterations" / "000002"
    record = it_json(d, 2, "dynamic_sampling.json")
    before = json.loads((d / "checkpoints" / "000002" / "trainer_state.json").read_text())["sampler"]
    rollout_bytes = (it2 / "rollout.parquet").read_bytes()
    # a crash after iteration 2's stages, before its checkpoint
    shutil.rmtree(d / "checkpoints" / "000002")
    over = {"trainer.test_freq": 0, "trainer.log_samples": 0, "reward.custom_function": env.scorer,
            "trainer.resume": "auto", "trainer.run_id": d.name, "reward.overlong_buffer.enable": True}
    train("dapo", tiny_overrides(env.model, env.root / "runs", **over))
    after = json.loads((d / "checkpoints" / "000002" / "trainer_state.json").read_text())["sampler"]
    assert (it2 / "rollout.parquet").read_bytes() == rollout_bytes  # reused, not regenerated
    assert after == before
    assert it_json(d, 2, "update.json")["batch/num_gen_batches"] == record["num_gen_batches"]


def test_remax_with_reward_model_and_truncation_mask(env, tmp_path_factory):
    """ReMax's greedy baseline, a reward model combined with the rule score, truncated-response masking."""
    from trajflow.config import ModelConfig, RewardModelConfig
    from trajflow.workers.reward_model import RewardModelWorker

    rm_dir = make_tiny_reward_model(tmp_path_factory.mktemp("recipe-rm"))
    d = run(env, "grpo_default", **{"algorithm.adv_estimator": "remax", "reward.reward_model.enable": True,
                                    "reward.reward_model.path": str(rm_dir), "reward.reward_model.rule_weight": 1.0,
                                    "reward.reward_model.rm_weight": 0.5, "algorithm.mask_truncated_samples": True})
    rm = RewardModelWorker(str(rm_dir), RewardModelConfig(micro_batch_size=4, max_length=2048),
                           ModelConfig(dtype="float32", attn_implementation="sdpa"), "cpu", 1)
    for it in (1, 2):
        rows = joined(d, it)
        prompts = list(rows["prompt"])  # chat messages: a list<struct<role, content>> column
        rm_scores = rm.compute_rm_score(prompts, rows["response_text"])
        np.testing.assert_allclose(rows["rm_score"], rm_scores, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(rows["rule_score"], [hash_bit(t) for t in rows["response_text"]])
        np.testing.assert_allclose(rows["score"], np.array(rows["rule_score"]) + 0.5 * rm_scores, rtol=1e-4, atol=1e-5)
        for idx in by_group(rows).values():  # one greedy baseline per prompt
            assert len({tuple(rows["baseline_response_ids"][i]) for i in idx}) == 1
        b_rm = rm.compute_rm_score(prompts, rows["baseline_response_text"])
        b_want = np.array([hash_bit(t) for t in rows["baseline_response_text"]]) + 0.5 * b_rm
        np.testing.assert_allclose(rows["reward_baseline"], b_want, rtol=1e-4, atol=1e-5)
        for adv, score, base in zip(rows["advantages"], rows["score"], rows["reward_baseline"]):
            np.testing.assert_allclose(adv, score - base, rtol=1e-4, atol=1e-5)  # ReMax: r - r(greedy)
        upd = it_json(d, it, "update.json")
        n_trunc = sum(f == "length" for f in rows["finish_reason"])
        assert upd["batch/masked_truncated"] == n_trunc
        if n_trunc == len(rows["finish_reason"]):  # everything masked: no policy step was taken
            assert "actor/pg_loss" not in upd


def test_dynamic_sampling_without_any_signal_stops_with_a_clear_error(env):
    """The built-in arithmetic scorer gives a random-weight policy 0 everywhere: no group has accuracy
    variance, so after max_num_gen_batches the iteration stops and says which keys to change."""
    from trajflow.errors import DynamicSamplingError
    from trajflow.flows.train import train

    over = {"trainer.test_freq": 0, "trainer.log_samples": 0, "algorithm.filter_groups.enable": True,
            "algorithm.filter_groups.max_num_gen_batches": 2, "trainer.total_iterations": 1}
    with pytest.raises(DynamicSamplingError, match=r"kept no group after 2 generation batch\(es\).*"
                                                   r"algorithm.filter_groups.max_num_gen_batches"):
        train("grpo_default", tiny_overrides(env.model, env.root / "runs", **over))


def test_on_policy_distillation_with_a_teacher_worker(env, tmp_path_factory):
    """adv_estimator=opd through the real flow: a teacher worker (another tiny model, same tokenizer) scores
    the sampled tokens; stored teacher_logprobs match a plain forward of the teacher, and every token's
    advantage is lambda (teacher - student) + mu * the task score's GRPO advantage."""
    import torch

    from tests.conftest import make_tiny_model
    from trajflow.models import load_causal_lm

    teacher_dir = make_tiny_model(tmp_path_factory.mktemp("teacher"), seed=7)
    d = run(env, "grpo_default", **{"algorithm.adv_estimator": "opd", "teacher.path": str(teacher_dir),
                                    "algorithm.opd_coef": 2.0, "algorithm.opd_task_coef": 0.5,
                                    "trainer.total_iterations": 1})
    teacher = load_causal_lm(str(teacher_dir), "float32", "cpu", "sdpa").eval()
    rows = joined(d, 1)
    from omegaconf import OmegaConf

    temp = float(OmegaConf.load(d / "config.yaml").rollout.temperature)
    kl = []
    for p, r, t_lp, s_lp in zip(rows["prompt_ids"], rows["response_ids"], rows["teacher_logprobs"], rows["rollout_logprobs"]):
        with torch.no_grad():
            logp = torch.log_softmax(teacher(input_ids=torch.tensor([p + r])).logits[0].double() / temp, -1)
        want = [float(logp[len(p) - 1 + j, tok]) for j, tok in enumerate(r)]
        np.testing.assert_allclose(t_lp, want, atol=1e-4)
        kl.extend(np.array(s_lp) - np.array(want))
    upd = it_json(d, 1, "update.json")
    assert upd["distill/reverse_kl"] == pytest.approx(float(np.mean(kl)), abs=1e-4)
    for idx in by_group(rows).values():
        scores = np.array([rows["score"][i] for i in idx])
        std = scores.std(ddof=1)
        for i in idx:
            g = 0.0 if std == 0 else (scores[idx.index(i)] - scores.mean()) / (std + 1e-6)
            want = 2.0 * (np.array(rows["teacher_logprobs"][i]) - np.array(rows["rollout_logprobs"][i])) + 0.5 * g
            np.testing.assert_allclose(rows["advantages"][i], want, rtol=1e-4, atol=1e-4)
