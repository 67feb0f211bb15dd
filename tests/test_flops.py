"""Model FLOPs of an update and perf/mfu/actor (trajflow/modeling/flops.py), against the PaLM count
(Chowdhery et al. 2022, Appendix B: 6 N + 12 L H Q T per token) worked out from the tiny config by hand."""

from __future__ import annotations

import pytest

from trajflow.config import ModelConfig
from trajflow.modeling import lora
from trajflow.modeling.flops import device_peak_tflops, mfu, train_flops
from trajflow.models import load_causal_lm


def _tiny_counts(vocab):
    # tests/conftest.py's tiny Llama: hidden 32, intermediate 64, 2 layers, 2 heads of 16, 1 KV head, tied head
    h, i, layers, heads, kv, q = 32, 64, 2, 2, 1, 16
    per_layer = h * heads * q + 2 * h * kv * q + heads * q * h + 3 * h * i  # q, k, v, o, gate/up/down
    return layers * per_layer + vocab * h, layers, heads, q  # + the output head (the embedding is a lookup)


def test_train_flops_full_and_lora_by_hand(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    n, layers, heads, q = _tiny_counts(model.config.vocab_size)
    lens = [5, 7]
    attn = 12 * layers * heads * q * (5 * 5 + 7 * 7)
    assert train_flops(model, lens) == pytest.approx(6 * n * 12 + attn)
    # LoRA rank 4 on every linear layer but the head: the base is frozen (4 FLOPs per parameter per token),
    # the adapters (r * (in + out) per layer) train (6)
    h, i = 32, 64
    shapes = [(h, 32), (h, 16), (h, 16), (32, h), (h, i), (h, i), (i, h)]  # (in, out): q, k, v, o, gate, up, down
    adapters = 2 * sum(4 * (a + b) for a, b in shapes)
    peft = lora.apply_lora(model, ModelConfig(lora_rank=4, lora_alpha=8.0))
    assert train_flops(peft, lens) == pytest.approx((4 * n + 6 * adapters) * 12 + attn)


def test_mfu_and_peaks():
    assert mfu(2e12, 4.0, 1.0) == pytest.approx(0.5)           # 0.5 TFLOP/s of a 1 TFLOP/s device
    assert mfu(2e12, 4.0, 1.0, devices=2) == pytest.approx(0.25)
    assert device_peak_tflops("cpu") is None
    with pytest.raises(ValueError, match="seconds > 0"):
        mfu(1.0, 0.0, 1.0)
