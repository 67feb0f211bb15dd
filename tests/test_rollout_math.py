"""Response masks, finish reasons, temperature-scaled log-probs and inverse-CDF sampling, checked by hand."""

import math

import pytest
import torch

from trajflow.stages.rollout import logprobs_from_logits, response_lengths_and_finish, response_mask, sample_tokens

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


def _logits(probs):
    return torch.log(torch.tensor([probs], dtype=torch.float32))


def test_sample_tokens_inverts_the_cdf():
    # p = (0.1, 0.2, 0.7): CDF 0.1, 0.3, 1.0. Token i is drawn for u in [CDF_{i-1}, CDF_i).
    logits = _logits([0.1, 0.2, 0.7]).repeat(5, 1)
    u = torch.tensor([0.0, 0.05, 0.1, 0.29, 0.31])
    tokens, logprobs = sample_tokens(logits, 1.0, u)
    assert tokens.tolist() == [0, 0, 1, 1, 2]
    expected = [math.log(p) for p in (0.1, 0.1, 0.2, 0.2, 0.7)]
    assert torch.allclose(logprobs, torch.tensor(expected), atol=1e-6)


def test_sample_tokens_temperature_reshapes_and_logprobs_follow_it():
    # T = 0.5 squares the probabilities: (0.2^2, 0.8^2) / (0.04 + 0.64) = (1/17, 16/17).
    logits = _logits([0.2, 0.8]).repeat(2, 1)
    tokens, logprobs = sample_tokens(logits, 0.5, torch.tensor([1 / 17 - 1e-4, 1 / 17 + 1e-4]))
    assert tokens.tolist() == [0, 1]
    assert torch.allclose(logprobs, torch.tensor([math.log(1 / 17), math.log(16 / 17)]), atol=1e-6)


def test_sample_tokens_top_k_and_top_p_renormalise_but_logprobs_stay_unfiltered():
    probs = [0.05, 0.5, 0.15, 0.3]
    logits = _logits(probs).repeat(3, 1)
    u = torch.tensor([0.0, 0.62, 0.99])
    # top_k = 2 keeps tokens 1 and 3 (0.5, 0.3): token 1 for u < 0.5 / 0.8 = 0.625, else token 3.
    tokens, logprobs = sample_tokens(logits, 1.0, u, top_k=2)
    assert tokens.tolist() == [1, 1, 3]
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.5, 0.5, 0.3])), atol=1e-6)
    # top_p = 0.7: the most likely tokens until their mass reaches 0.7 are 1 (0.5) and 3 (0.8 > 0.7).
    assert sample_tokens(logits, 1.0, u, top_p=0.7)[0].tolist() == [1, 1, 3]
    # top_p = 0.85 also keeps token 2 (mass before it 0.8 < 0.85): kept mass 0.95, CDF 0.5/0.65/0.95
    # in vocabulary order, so u = 0.62 -> 0.589 falls in token 2's slice and u = 0.0 -> token 1.
    assert sample_tokens(logits, 1.0, u, top_p=0.85)[0].tolist() == [1, 2, 3]


def test_sample_tokens_frequencies_match_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0]])
    draws = 200_000
    tokens, _ = sample_tokens(logits.repeat(draws, 1), 0.8, torch.rand(draws, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=4).double() / draws
    e = [math.exp(x / 0.8) for x in (1.0, 0.0, -1.0, 2.0)]
    expected = torch.tensor([x / sum(e) for x in e], dtype=torch.float64)
    sigma = (expected * (1 - expected) / draws).sqrt()
    assert ((freq - expected).abs() < 5 * sigma).all(), (freq, expected)


@pytest.mark.parametrize("kwargs, match", [(dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                                           (dict(top_k=-1), "top_k")])
def test_sample_tokens_rejects_bad_settings(kwargs, match):
    args = dict(temperature=1.0, top_p=1.0, top_k=0) | kwargs
    with pytest.raises(ValueError, match=match):
        sample_tokens(torch.zeros(1, 3), args["temperature"], torch.zeros(1), args["top_p"], args["top_k"])
