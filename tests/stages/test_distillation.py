"""On-policy distillation (stages/distillation.py; Lu et al. 2025, Agarwal et al. 2024): the per-token
reverse-KL advantage and its metrics against values worked by hand, and a tiny teacher/student pair
whose log-probs come from a plain forward of each model."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from trajflow.stages.advantage import advantage_table
from trajflow.stages.distillation import opd_advantage, reverse_kl_metrics

# teacher - student per token: row 0 [ln 2, -ln 4, 0.5], row 1 [1.0, masked]
T_LP = torch.tensor([[math.log(0.4), math.log(0.05), -1.0], [-0.5, 7.0, float("nan")]], dtype=torch.float64)
S_LP = torch.tensor([[math.log(0.2), math.log(0.2), -1.5], [-1.5, -3.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_opd_advantage_by_hand():
    t, s = T_LP, S_LP
    adv, ret = opd_advantage(t, s, MASK, coef=0.5)
    want = 0.5 * torch.tensor([[math.log(2), -math.log(4), 0.5], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, want.float())
    assert torch.equal(adv, ret) and adv.dtype == torch.float32
    # mixed with the task reward's advantage: + mu * A_task on valid tokens only
    task = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    mixed, _ = opd_advantage(t, s, MASK, coef=0.5, task_advantages=task, task_coef=0.25)
    torch.testing.assert_close(mixed, (want + 0.25 * task * MASK).float())
    with pytest.raises(ValueError, match="opd_task_coef > 0 needs the task advantages"):
        opd_advantage(t, s, MASK, task_coef=1.0)
    with pytest.raises(ValueError, match="student_log_probs must have the shape"):
        opd_advantage(t, s[:, :2], MASK)


def test_reverse_kl_metrics_by_hand():
    m = reverse_kl_metrics(T_LP, S_LP, MASK)
    d = [-math.log(2), math.log(4), -0.5, -1.0]  # student - teacher on the 4 valid tokens
    assert m["distill/reverse_kl"] == pytest.approx(sum(d) / 4)
    assert m["distill/reverse_kl_seq"] == pytest.approx((sum(d[:3]) + d[3]) / 2)
    assert m["distill/teacher_logprob"] == pytest.approx((math.log(0.4) + math.log(0.05) - 1.0 - 0.5) / 4)
    assert m["distill/student_logprob"] == pytest.approx((2 * math.log(0.2) - 1.5 - 1.5) / 4)


def _plain_logprobs(model, prompt, response, temperature=1.0):
    """log p(response_t | prompt, response_<t) from the model's own full forward (no trajflow code)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, -1)
    return np.array([float(logp[len(prompt) - 1 + j, tok]) for j, tok in enumerate(response)])


def test_tiny_teacher_and_student_give_the_hand_computed_reverse_kl(tiny_model_dir, tmp_path):
    """Student = the tiny model, teacher = another tiny model (other weights, same tokenizer). The teacher
    worker's log-probs, the reward stage's distill/* metrics and the opd advantages match a plain forward
    of each model: A_t = lambda (log p_T - log p_S), KL estimate = mean_t (log p_S - log p_T)."""
    from tests.conftest import make_tiny_model
    from trajflow.config import ModelConfig, RolloutConfig
    from trajflow.models import load_causal_lm
    from trajflow.workers.reference import ReferenceWorker
    from trajflow.stages.reward import reward_table

    teacher_dir = make_tiny_model(tmp_path / "teacher", seed=7)
    student = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa").eval()
    teacher = load_causal_lm(str(teacher_dir), "float32", "cpu", "sdpa").eval()
    prompts = [[1, 504, 1045, 30], [1, 504, 1045, 30], [1, 88, 9]]
    responses = [[260, 314, 2], [99, 5000, 77, 2], [42]]
    temp = 0.7
    s_lp = [_plain_logprobs(student, p, r, temp) for p, r in zip(prompts, responses)]
    t_lp = [_plain_logprobs(teacher, p, r, temp) for p, r in zip(prompts, responses)]
    assert max(abs(a - b).max() for a, b in zip(s_lp, t_lp)) > 0.1  # the two models really differ

    worker = ReferenceWorker(str(teacher_dir), ModelConfig(dtype="float32"), RolloutConfig(temperature=temp), "cpu", 1)
    served = worker.compute_ref_log_prob(prompts, responses)
    for got, want in zip(served, t_lp):
        np.testing.assert_allclose(got, want, atol=1e-5)

    rollout = pa.table({
        "sample_id": ["a", "b", "c"], "group_id": ["g0", "g0", "g1"],
        "prompt_ids": pa.array(prompts, pa.list_(pa.int32())), "response_ids": pa.array(responses, pa.list_(pa.int32())),
        "rollout_logprobs": pa.array([x.astype(np.float32) for x in s_lp], pa.list_(pa.float32())),
        "finish_reason": ["stop", "stop", "length"]})
    out, metrics = reward_table(rollout, np.array([1.0, 0.0, 0.0], np.float32), [{}, {}, {}], ref_logprobs=None,
                                reward_cfg={"overlong_buffer": {"enable": False}}, algorithm_cfg={}, max_new_tokens=8,
                                kl_coef=0.0, teacher_logprobs=served)
    d = np.concatenate([s - t for s, t in zip(s_lp, t_lp)])
    assert metrics["distill/reverse_kl"] == pytest.approx(d.mean(), abs=1e-5)
    assert metrics["distill/reverse_kl_seq"] == pytest.approx(np.mean([(s - t).sum() for s, t in zip(s_lp, t_lp)]),
                                                              abs=1e-5)
    joined = rollout.append_column("token_rewards", out.column("token_rewards")).append_column(
        "teacher_logprobs", out.column("teacher_logprobs"))
    alg = {"adv_estimator": "opd", "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True, "opd_coef": 2.0,
           "opd_task_coef": 0.0}
    adv = advantage_table(joined, alg).column("advantages").to_pylist()
    for got, s, t in zip(adv, s_lp, t_lp):
        np.testing.assert_allclose(got, 2.0 * (t - s), atol=1e-4)
    # + the task reward's GRPO advantage: group g0 scores (1, 0): mean 0.5, unbiased std sqrt(0.5), so
    # (1 - 0.5) / sqrt(0.5) = +-0.7071; g1 is a group of one -> 0
    mixed = advantage_table(joined, {**alg, "opd_task_coef": 0.5}).column("advantages").to_pylist()
    grpo = [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.0]
    for got, s, t, g in zip(mixed, s_lp, t_lp, grpo):
        np.testing.assert_allclose(got, 2.0 * (t - s) + 0.5 * g, atol=1e-4)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from trajflow.errors import ConfigError
    from trajflow.models import same_tokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_tokens(["<teacher_only>"])
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(ConfigError, match="teacher.path=.*its tokenizer differs from the policy's.*'<teacher_only>'"):
        same_tokenizer(tiny_model_dir, tmp_path / "other", "teacher.path")
    same_tokenizer(tiny_model_dir, tiny_model_dir, "teacher.path")  # the same one passes


def test_opd_config_rules():
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match="adv_estimator=opd .* needs teacher.path"):
        load_config(None, ["algorithm.adv_estimator=opd"])
    with pytest.raises(ConfigError, match="teacher.path='t' is only used by on-policy distillation"):
        load_config(None, ["teacher.path=t"])
    with pytest.raises(ConfigError, match="opd_task_coef=0.5 .* needs rollout.n >= 2"):
        load_config(None, ["algorithm.adv_estimator=opd", "teacher.path=t", "algorithm.opd_task_coef=0.5",
                           "rollout.n=1"])
    cfg = load_config(None, ["algorithm.adv_estimator=opd", "teacher.path=t", "rollout.n=1"])
    assert cfg.algorithm.opd_coef == 1.0 and cfg.algorithm.opd_task_coef == 0.0
