"""Response masks, finish reasons and temperature-scaled log-probs, checked by hand."""

import math

import torch

from stages.rollout import logprobs_from_logits, response_lengths_and_finish, response_mask

EOS = 2


def test_mask_eos_inside_keeps_eos_and_drops_tail():
    ids = torch.tensor([[5, 6, EOS, 7, 8]])
    assert response_mask(ids, [EOS]).tolist() == [[True, True, True, False, False]]


def test_mask_eos_at_end():
    ids = torch.tensor([[5, 6, 7, 8, EOS]])
    assert response_mask(ids, [EOS]).tolist() == [[True] * 5]


def test_mask_without_eos_keeps_everything_and_finishes_by_length():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    lengths, reasons = response_lengths_and_finish(ids, [EOS])
    assert response_mask(ids, [EOS]).tolist() == [[True] * 5]
    assert lengths.tolist() == [5] and reasons == ["length"]


def test_mask_pad_equal_to_eos_counts_only_the_first():
    # SmolLM2 pads with <|im_end|>, its EOS: the padding after the first EOS must not count.
    ids = torch.tensor([[5, EOS, EOS, EOS], [EOS, EOS, EOS, EOS], [5, 6, 7, EOS]])
    mask = response_mask(ids, [EOS])
    assert mask.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]
    lengths, reasons = response_lengths_and_finish(ids, [EOS])
    assert lengths.tolist() == [2, 1, 4] and reasons == ["stop", "stop", "stop"]


def test_mask_several_eos_ids():
    ids = torch.tensor([[5, 9, 6, EOS]])
    assert response_mask(ids, [EOS, 9]).tolist() == [[True, True, False, False]]


def test_logprobs_use_the_sampling_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    label = torch.tensor([0])
    t = 0.5
    # by hand: softmax([4, 2, 0])[0] = e^4 / (e^4 + e^2 + 1)
    expected = 4 - math.log(math.exp(4) + math.exp(2) + 1)
    got = logprobs_from_logits(logits, label, temperature=t).item()
    assert abs(got - expected) < 1e-6
    chunked = logprobs_from_logits(logits.repeat(5, 1), label.repeat(5), temperature=t, chunk_size=2)
    assert torch.allclose(chunked, torch.full((5,), expected))
