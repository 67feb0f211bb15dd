"""Mixed precision: fp32 master weights under bf16 compute, fp32 log-probs, a bf16 rollout copy and
the training/rollout mismatch metrics, the DeepSpeed mapping, and the 'auto' choice."""

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.stages.rollout import SamplingParams
from trajflow.stages.rollout_correction import rollout_mismatch_metrics
from trajflow.config import ActorConfig, MixedPrecisionConfig, ModelConfig, RolloutConfig, load_config
from trajflow.errors import ConfigError
from trajflow.modeling.backends import deepspeed_config
from trajflow.modeling.packed_linear import dense_parameters
from trajflow.modeling.forward import forward_micro_batch
from trajflow.modeling.packing import pack
from trajflow.modeling.precision import autocast, bf16_is_fast
from trajflow.workers.policy import PolicyWorker

ACTOR = dict(lr=1e-4, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0,
             grad_clip=1.0)
MODEL = ModelConfig(dtype="float32")


def _worker(model_dir, param_dtype="float32", rollout_dtype="float32"):
    actor = ActorConfig(**ACTOR, mixed_precision=MixedPrecisionConfig(param_dtype=param_dtype))
    rollout = RolloutConfig(micro_batch_size=4, temperature=1.0, dtype=rollout_dtype)
    return PolicyWorker(str(model_dir), actor, MODEL, rollout, seed=0, num_threads=1)


def _rollout_and_batch(worker):
    prompts = worker.tokenize_prompts([[{"role": "user", "content": "Calculate 3 + 4."}],
                                       [{"role": "user", "content": "Calculate 12 - 5 please."}]], 256)
    out = worker.generate_sequences(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=1))
    rows = [p for p in prompts for _ in range(2)]
    adv = [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(out.response_ids)]
    return rows, out, UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv), UpdateSettings(4))


# ---------------------------------------------------------------------------- master weights


def test_bf16_compute_keeps_sub_bf16_updates_in_the_fp32_master(tiny_model_dir):
    # RMSNorm weights start at exactly 1.0. AdamW's first step moves every weight with a non-zero
    # gradient by lr * m_hat / (sqrt(v_hat) + eps) = lr * g / (|g| + eps) ~ 1e-4 in magnitude (Kingma &
    # Ba 2015, alg. 1 with bias correction at t = 1). bf16 spacing next to 1.0 is 2^-7 = 0.0078 (below:
    # 2^-8), so a bf16 weight would stay 1.0; the fp32 master must move by ~1e-4.
    w = _worker(tiny_model_dir, param_dtype="bfloat16")
    norm = w.model.model.norm.weight
    assert norm.dtype == torch.float32 and torch.equal(norm, torch.ones_like(norm))
    _, _, batch = _rollout_and_batch(w)
    w.update_actor(batch)
    assert norm.dtype == torch.float32
    moved = (norm.detach() - 1.0).abs()
    assert moved.max() > 0.9e-4 and moved.max() < 1.1e-4, moved.max()
    assert int((moved > 0.5e-4).sum()) >= norm.numel() // 2  # most entries got a gradient
    # The same value stored in bf16 would have been rounded back to 1.0: the step is below bf16's resolution.
    assert torch.equal(norm.detach().to(torch.bfloat16).float(), torch.ones_like(norm))
    state = w.optimizer.state[norm]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


def test_pure_bf16_parameters_would_lose_the_same_update():
    # The contrast the master weights exist for: the same AdamW step applied to a bf16 parameter.
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.0)
    p.grad = torch.full_like(p, 0.5)
    opt.step()
    assert torch.equal(p.detach(), torch.ones(4, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([q], lr=1e-4, weight_decay=0.0)
    q.grad = torch.full_like(q, 0.5)
    opt.step()
    assert torch.allclose(q.detach(), torch.full((4,), 1.0 - 1e-4), atol=1e-7)


def test_log_probs_under_bf16_compute_are_fp32_and_close_to_fp32(tiny_model_dir):
    w = _worker(tiny_model_dir)
    rows, out, _ = _rollout_and_batch(w)
    packed = pack(rows, out.response_ids, w.pad_id)
    with torch.no_grad():
        ref, _ = forward_micro_batch(w.model, packed, 1.0, compute_entropy=True)
        with autocast("bfloat16", "cpu"):
            lp, ent = forward_micro_batch(w.model, packed, 1.0, compute_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    m = packed.response_mask
    diff = (lp - ref).abs()[m]
    assert float(diff.max()) > 0  # the forward really ran in bf16
    # Tolerance: bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 0.002 per rounding). A log-prob
    # is z_y - logsumexp(z); each logit z = h . w_y carries a relative error of a few u (inputs and weights
    # rounded once, fp32 accumulation), and |z| <= ~1 for this random 32-wide model, so the log-prob moves
    # by ~2 * few * u * |z| <= 0.02; 0.05 leaves room, while any fp32 fallback bug or wrong token would
    # show up as errors of order 1 (log 49k vocabulary = 10.8).
    assert float(diff.max()) < 0.05, float(diff.max())
    # The worker's own compute_log_prob runs under its policy and returns fp32 arrays.
    wb = _worker(tiny_model_dir, param_dtype="bfloat16")
    got = wb.compute_log_prob(rows, out.response_ids, 1.0)
    assert all(g.dtype == np.float32 for g in got)
    for j, g in enumerate(got):
        n = len(out.response_ids[j])
        assert np.allclose(g, lp[j, :n].numpy(), atol=1e-6)


# ---------------------------------------------------------------------------- bf16 rollout


def test_bf16_rollout_samples_from_its_own_copy_resynced_after_each_update(tiny_model_dir):
    w = _worker(tiny_model_dir, rollout_dtype="bfloat16")
    eng = w.engine
    assert eng.own_copy and eng.model is not w.model
    assert all(p.dtype == torch.bfloat16 for p in eng.model.parameters())
    assert all(p.dtype == torch.float32 for p in w.model.parameters())
    _, out, batch = _rollout_and_batch(w)
    metrics = w.update_actor(batch)
    trained = dict(w.model.named_parameters())
    for name, p in dense_parameters(eng.model).items():  # a packed bf16 linear's weight read back
        assert torch.equal(p, trained[name].detach().to(torch.bfloat16)), name
    # The sampler's log-probs differ from the trainer's: the mismatch is measured, and is small.
    assert metrics["rollout_corr/max_abs_diff"] > 0
    assert 0 < metrics["rollout_corr/k3_kl"] < 0.05
    assert metrics["actor/ratio_first_step_max_abs_dev"] == 0.0  # ratio pi/pi_old is still exactly 1


def test_fp32_rollout_shares_the_module_and_reports_near_zero_mismatch(tiny_model_dir):
    w = _worker(tiny_model_dir)
    assert not w.engine.own_copy and w.engine.model is w.model
    _, _, batch = _rollout_and_batch(w)
    metrics = w.update_actor(batch)
    assert metrics["rollout_corr/max_abs_diff"] < 1e-4
    assert abs(metrics["rollout_corr/kl"]) < 1e-5


def test_mismatch_metrics_match_hand_computed_values():
    # Two rows; row 0 has 2 valid tokens, row 1 has 1 (its second column is padding).
    old = torch.tensor([[-1.0, -2.0], [-0.5, 9.0]])
    eng = torch.tensor([[-1.5, -1.0], [-0.5, -7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    m = rollout_mismatch_metrics(old, eng, mask, threshold=1.5)
    # d = eng - old on valid tokens: -0.5, +1.0, 0.0
    assert m["rollout_corr/kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)
    # rho = exp(-d): e^0.5, e^-1, 1 ; k3 = rho - log rho - 1
    k3 = [(math.exp(0.5) - 0.5 - 1), (math.exp(-1) + 1 - 1), 0.0]
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(k3) / 3)
    # row means: D_0 = (-0.5 + 1.0) / 2 = 0.25, D_1 = 0
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(0.125)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(0.125)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(0.25)
    assert m["rollout_corr/log_ppl_diff_min"] == pytest.approx(0.0)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((math.exp(0.25) + 1) / 2)
    # log PPL of row i = -mean log pi: trainer rows 1.5 and 0.5, engine rows 1.25 and 0.5
    assert m["rollout_corr/training_log_ppl"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_log_ppl"] == pytest.approx(0.875)
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(1.5) + math.exp(0.5)) / 2)
    assert m["rollout_corr/chi2_token"] == pytest.approx((math.exp(1.0) + math.exp(-2.0) + 1) / 3 - 1)
    assert m["rollout_corr/max_abs_diff"] == pytest.approx(1.0)
    # rho > 1.5: only e^0.5 = 1.65
    assert m["rollout_corr/truncated_frac"] == pytest.approx(1 / 3)
    pd = [abs(math.exp(-1) - math.exp(-1.5)), abs(math.exp(-2) - math.exp(-1)), 0.0]
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(sum(pd) / 3)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(max(pd))


def test_mismatch_metrics_of_an_empty_mask_are_neutral():
    z = torch.zeros(1, 2)
    m = rollout_mismatch_metrics(z, z, torch.zeros(1, 2, dtype=torch.bool), threshold=2.0)
    assert m["rollout_corr/kl"] == 0.0 and m["rollout_corr/ppl_ratio"] == 1.0


# ---------------------------------------------------------------------------- config, DeepSpeed, auto


def test_model_dtype_bfloat16_is_rejected_with_the_keys_to_use():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.dtype=bfloat16"])
    msg = str(e.value)
    assert "model.dtype='bfloat16'" in msg
    assert "actor.mixed_precision.param_dtype=bfloat16" in msg and "rollout.dtype=bfloat16" in msg


def test_float16_and_bf16_reduction_need_deepspeed():
    with pytest.raises(ConfigError, match=r"actor.mixed_precision.param_dtype='float16' needs loss scaling"):
        load_config(None, ["actor.mixed_precision.param_dtype=float16"])
    with pytest.raises(ConfigError, match=r"critic.mixed_precision.reduce_dtype='bfloat16'"):
        load_config(None, ["critic.mixed_precision.reduce_dtype=bfloat16"])


def test_deepspeed_config_maps_the_policy_onto_its_mixed_precision():
    bf16 = ActorConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bfloat16"))
    cfg = deepspeed_config(bf16, world_size=2)
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["communication_data_type"] == "fp32"
    fp16 = ActorConfig(mixed_precision=MixedPrecisionConfig(param_dtype="float16", reduce_dtype="bfloat16"))
    cfg = deepspeed_config(fp16, world_size=2)
    assert cfg["fp16"]["enabled"] is True and cfg["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    assert cfg["communication_data_type"] == "bf16"
    cfg = deepspeed_config(ActorConfig(), world_size=1)
    assert "bf16" not in cfg and "fp16" not in cfg and "communication_data_type" not in cfg


def test_bf16_is_fast_reads_the_cpu_flags(tmp_path):
    amx = tmp_path / "amx"
    amx.write_text("processor : 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor : 0\nflags\t\t: fpu sse avx2 fma\n")
    assert bf16_is_fast("cpu", amx) == (True, "cpu has amx_bf16")
    fast, why = bf16_is_fast("cpu", avx2)
    assert not fast and "amx_bf16" in why
    assert bf16_is_fast("cpu", tmp_path / "missing")[0] is False


def test_auto_resolves_per_this_machine_and_is_recorded(monkeypatch):
    monkeypatch.delenv("TRAJFLOW_AUTO_PRECISION")  # the suite's pin
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    expected = "bfloat16" if flags & {"amx_bf16", "avx512_bf16"} else "float32"
    cfg = load_config(None, ["actor.mixed_precision.param_dtype=auto", "rollout.dtype=auto"])
    assert cfg.actor.mixed_precision.param_dtype == expected and cfg.rollout.dtype == expected
    assert cfg.critic.mixed_precision.param_dtype == "float32"  # not 'auto': left alone
    assert cfg.trainer.precision_auto.startswith(f"auto -> {expected}")
    assert "actor.mixed_precision.param_dtype" in cfg.trainer.precision_auto
    pinned = load_config(None, ["actor.mixed_precision.param_dtype=float32", "rollout.dtype=float32"])
    assert pinned.trainer.precision_auto is None


def test_the_environment_fixes_what_auto_means(monkeypatch):
    monkeypatch.setenv("TRAJFLOW_AUTO_PRECISION", "bfloat16")
    cfg = load_config(None, ["actor.mixed_precision.param_dtype=auto", "rollout.dtype=auto"])
    assert cfg.actor.mixed_precision.param_dtype == "bfloat16" and cfg.rollout.dtype == "bfloat16"
    assert "TRAJFLOW_AUTO_PRECISION=bfloat16" in cfg.trainer.precision_auto
    # every role's compute dtype takes 'auto', the on-policy distillation teacher's too (it was left 'auto')
    roles = ["critic", "reference", "teacher", "reward.reward_model"]
    cfg = load_config(None, [f"{r}.mixed_precision.param_dtype=auto" for r in roles])
    assert [OmegaConf.select(cfg, f"{r}.mixed_precision.param_dtype") for r in roles] == ["bfloat16"] * 4
    monkeypatch.setenv("TRAJFLOW_AUTO_PRECISION", "fp32")
    with pytest.raises(ConfigError, match=r"TRAJFLOW_AUTO_PRECISION='fp32': expected 'float32' or 'bfloat16'"):
        load_config(None, [])


def test_a_low_precision_sampler_turns_the_rollout_correction_on_unless_the_user_chose():
    fp32 = ["actor.mixed_precision.param_dtype=float32"]
    assert load_config(None, fp32 + ["rollout.dtype=float32"]).algorithm.rollout_is is None
    assert load_config(None, fp32 + ["rollout.dtype=bfloat16"]).algorithm.rollout_is == "token"
    chosen = load_config(None, fp32 + ["rollout.dtype=bfloat16", "algorithm.rollout_is=sequence"])
    assert chosen.algorithm.rollout_is == "sequence"
    off = load_config(None, fp32 + ["rollout.dtype=bfloat16", "algorithm.rollout_is=disable"])
    assert off.algorithm.rollout_is == "disable"


def test_a_run_prints_records_and_logs_its_precision(tiny_model_dir, ray_local, tmp_path, capsys, monkeypatch):
    import json

    from mlflow.tracking import MlflowClient

    from trajflow.flows.train import train
    from tests.conftest import tiny_overrides

    monkeypatch.delenv("TRAJFLOW_AUTO_PRECISION")  # the suite's pin: this test is about the hardware's answer
    fast, why = bf16_is_fast("cpu")
    expected = "bfloat16" if fast else "float32"
    summary = train(None, tiny_overrides(tiny_model_dir, tmp_path, **{
        "actor.mixed_precision.param_dtype": "auto", "rollout.dtype": "bfloat16", "trainer.total_iterations": 1,
        "trainer.test_freq": 0, "tracking.log_model": False}))
    out = capsys.readouterr().out
    head = out.splitlines()[:5]
    line = f"precision: float32 master weights, actor compute {expected}, rollout bfloat16"
    assert any(h.startswith(line) and why in h for h in head), head
    meta = json.loads((tmp_path / summary["run_id"] / "run.json").read_text())
    assert meta["precision"]["actor"] == expected and meta["precision"]["rollout"] == "bfloat16"
    assert meta["precision"]["master"] == "float32" and why in meta["precision"]["auto"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlrun = client.get_run(summary["mlflow_run_id"])
    assert mlrun.data.params["actor.mixed_precision.param_dtype"] == expected
    assert mlrun.data.params["rollout.dtype"] == "bfloat16"
    assert why in mlrun.data.params["trainer.precision_auto"]
    assert mlrun.data.metrics["rollout_corr/max_abs_diff"] > 0  # a bf16 sampler differs from the fp32 trainer


def test_bf16_rollout_copy_holds_no_weights_during_the_update_and_samples_as_before(tiny_model_dir):
    w = _worker(tiny_model_dir, rollout_dtype="bfloat16")
    eng = w.engine
    tied = w.model.get_output_embeddings().weight is w.model.get_input_embeddings().weight
    assert (eng.model.get_output_embeddings().weight is eng.model.get_input_embeddings().weight) == tied
    seen = []
    forward = w.backend.forward

    def recording_forward(*args, **kwargs):
        seen.append(sum(p.numel() for p in eng.model.parameters()))
        return forward(*args, **kwargs)

    w.backend.forward = recording_forward
    _, _, batch = _rollout_and_batch(w)
    w.update_actor(batch)
    assert seen and all(n == 0 for n in seen)  # every micro-batch of the update ran without the copy
    trained = dict(w.model.named_parameters())
    for name, p in dense_parameters(eng.model).items():  # a packed bf16 linear's weight read back
        assert torch.equal(p, trained[name].detach().to(torch.bfloat16)), name

    # Released and rebuilt without an update in between: the same weights, so the same samples.
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=7)
    prompts = w.tokenize_prompts([[{"role": "user", "content": "Calculate 2 + 9."}]], 256)
    kept = w.generate_sequences(prompts, params)
    eng.release()
    assert sum(p.numel() for p in eng.model.parameters()) == 0
    rebuilt = w.generate_sequences(prompts, params)
    assert rebuilt.response_ids == kept.response_ids
    assert np.array_equal(np.concatenate(rebuilt.rollout_logprobs), np.concatenate(kept.rollout_logprobs))
