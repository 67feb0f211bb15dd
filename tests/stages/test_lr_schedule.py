"""Learning-rate warmup and cosine decay as verl schedules them: factors by hand, against
transformers' schedules, carried by the update batch, and applied by the backend's optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from tests.stages.test_multi_turn_masks import rollout
from trajflow.config import load_config
from trajflow.stages.lr_schedule import lr_factor, warmup_steps
from trajflow.stages.policy_update import update_batch, update_batch_options


def test_warmup_length_follows_verl():
    assert warmup_steps(10, -1, 0.3) == 3          # int(0.3 * 10)
    assert warmup_steps(10, 2, 0.3) == 2           # lr_warmup_steps > 0 wins
    assert warmup_steps(7, -1, 0.5) == 3           # int(3.5)
    assert warmup_steps(10, 0, 0.0) == 0


def test_constant_and_cosine_factors_by_hand():
    assert [lr_factor(s, 10, 3) for s in range(5)] == [0.0, 1 / 3, 2 / 3, 1.0, 1.0]
    # cosine, warmup 2 of 10, floor 0.1: p = (s - 2) / 8; 0.1 + 0.9 * (1 + cos(pi p)) / 2
    assert lr_factor(1, 10, 2, "cosine", 0.1) == 0.5
    assert lr_factor(2, 10, 2, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_factor(6, 10, 2, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_factor(10, 10, 2, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(4, 10, 2, "cosine", 0.0) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    with pytest.raises(ValueError, match="warmup_style"):
        lr_factor(0, 10, 2, "linear")


def test_factors_match_transformers_schedules():
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    for make, style in ((lambda o: get_constant_schedule_with_warmup(o, 3), "constant"),
                        (lambda o: get_cosine_schedule_with_warmup(o, 3, 12), "cosine")):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = make(opt)
        for step in range(13):
            assert lr_factor(step, 12, 3, style) == pytest.approx(opt.param_groups[0]["lr"]), (style, step)
            opt.step()
            sched.step()


def test_the_update_batch_carries_each_iterations_rate():
    table = rollout([[1, 1], [1, 1, 1]])
    cfg = load_config(None, ["trainer.total_iterations=4", "actor.lr=1e-5", "actor.lr_warmup_steps_ratio=0.5"])
    lrs = [update_batch(table, it, **update_batch_options(cfg)).settings.lr for it in (1, 2, 3, 4)]
    assert lrs == pytest.approx([0.0, 0.5e-5, 1e-5, 1e-5])  # warmup int(0.5 * 4) = 2 steps
    cfg = load_config(None, ["trainer.total_iterations=4", "actor.warmup_style=cosine"])
    # no warmup, step 2 of 4: (1 + cos(pi * 2 / 4)) / 2 = 0.5
    assert update_batch(table, 3, **update_batch_options(cfg)).settings.lr == pytest.approx(1e-5 * 0.5)
    assert update_batch(table, 3, **update_batch_options(load_config(None, []))).settings.lr is None  # no schedule


def test_the_backend_steps_at_the_scheduled_rate():
    from trajflow.modeling.backends import LocalBackend, adamw

    p = torch.nn.Parameter(torch.zeros(4))
    backend = LocalBackend(torch.nn.Linear(1, 1), adamw([p], 1e-3, (0.9, 0.999), 0.0, "cpu"))
    backend.set_lr(2.5e-4)
    assert backend.lr() == 2.5e-4
    p.grad = torch.tensor([1.0, -2.0, 3.0, -4.0])
    backend.optimizer.step()
    # Adam's first step: m / (sqrt(v) + eps) = g / |g| (bias-corrected), so each weight moves by lr
    assert p.detach().tolist() == pytest.approx([-2.5e-4, 2.5e-4, -2.5e-4, 2.5e-4], rel=1e-4)
