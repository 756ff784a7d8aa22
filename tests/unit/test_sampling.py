"""Sampling the next token (`next_token` in framework/models/tasks.py, which `stage=generate` and
the training samples call): temperature, then top-k, then top-p, each changing what is drawn as it
should. Every draw is seeded, so each test is deterministic; the frequency bounds below are ~5
binomial standard deviations of their draw counts, so a different seed passes them too."""

import math

import pytest
import torch

from framework.models.tasks import next_token

# Distinct logits, not in order: the most likely token is 3, then 0, 5, 1, 4, 2.
LOGITS = torch.tensor([2.0, 0.0, -3.0, 2.5, -1.0, 1.0])
ORDER = [3, 0, 5, 1, 4, 2]
GREEDY = ORDER[0]


def draws(n: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [next_token(LOGITS, temperature, top_k, top_p, gen) for _ in range(n)]


def frequencies(tokens: list) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double() / len(tokens)


def test_without_sampling_settings_every_token_is_drawn_as_often_as_softmax_says():
    """The baseline the other tests change: temperature 1, all tokens, all the mass."""
    tokens = draws(20000)
    freq, want = frequencies(tokens), torch.softmax(LOGITS.double(), -1)
    assert (freq - want).abs().max() < 0.02, (freq, want)  # std of a frequency <= 0.0036
    assert set(tokens) == set(range(LOGITS.numel()))


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_sharpens_or_flattens_the_distribution(temperature):
    """Frequencies follow softmax(logits / temperature): below 1 the most likely token is drawn
    more often than at 1, above 1 less often."""
    freq = frequencies(draws(20000, temperature=temperature))
    want = torch.softmax(LOGITS.double() / temperature, -1)
    assert (freq - want).abs().max() < 0.02, (freq, want)
    at_one = torch.softmax(LOGITS.double(), -1)[GREEDY]
    assert (freq[GREEDY] > at_one + 0.05) if temperature < 1 else (freq[GREEDY] < at_one - 0.05), freq


@pytest.mark.parametrize("temperature", [0.0, 1e-3, 1e-40])
def test_zero_or_a_tiny_temperature_is_greedy(temperature):
    """0 is argmax; a tiny positive temperature (1e-40 overflows logits / temperature in fp32)
    puts all the mass on the most likely token: the same text as greedy decoding."""
    assert set(draws(500, temperature=temperature)) == {GREEDY}


@pytest.mark.parametrize("temperature", [1.0, 5.0])
def test_top_k_one_and_a_tiny_top_p_are_greedy(temperature):
    assert set(draws(500, temperature=temperature, top_k=1)) == {GREEDY}
    assert set(draws(500, temperature=temperature, top_p=1e-6)) == {GREEDY}


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_draws_only_the_k_most_likely_tokens_in_their_proportions(k):
    """Over many seeds exactly the k most likely tokens appear, in the ratios of their softmax
    renormalised over the k (the others' mass is not spread over them unevenly)."""
    seen = set()
    for seed in range(200):
        seen |= set(draws(10, temperature=2.0, top_k=k, seed=seed))
    assert seen == set(ORDER[:k])
    freq = frequencies(draws(20000, temperature=2.0, top_k=k))
    head = torch.tensor(ORDER[:k])
    want = torch.zeros_like(freq)
    want[head] = torch.softmax(LOGITS.double()[head] / 2.0, -1)
    assert (freq - want).abs().max() < 0.02, (freq, want)


def test_top_k_beyond_the_vocabulary_is_all_tokens():
    assert set(draws(5000, temperature=2.0, top_k=100)) == set(range(LOGITS.numel()))


@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_top_p_draws_the_smallest_head_holding_that_mass(temperature):
    """top_p keeps the most likely tokens until their mass (after the temperature) reaches p: just
    below a head's cumulative mass keeps that head, just above it the next token too."""
    probs = torch.softmax(LOGITS.double() / temperature, -1)[ORDER]
    cumulative = torch.cumsum(probs, -1).tolist()
    for size in (1, 2, 3):
        for p, expected in ((cumulative[size - 1] - 1e-3, size), (cumulative[size - 1] + 1e-3, size + 1)):
            seen = set()
            for seed in range(100):
                seen |= set(draws(20, temperature=temperature, top_p=p, seed=seed))
            assert seen == set(ORDER[:expected]), (temperature, p, seen)


def test_top_k_then_top_p():
    """top_p applies to the top_k tokens' renormalised mass: with top_k=2 the first token holds
    e^2.5 / (e^2.5 + e^2) = 0.62 of it, so top_p=0.6 keeps it alone and top_p=0.7 both."""
    first = math.exp(2.5) / (math.exp(2.5) + math.exp(2.0))
    assert 0.6 < first < 0.7
    assert set(draws(500, top_k=2, top_p=0.6)) == {GREEDY}
    assert set(draws(500, top_k=2, top_p=0.7)) == set(ORDER[:2])


def test_the_same_seed_draws_the_same_tokens_another_seed_others():
    assert draws(50, seed=1) == draws(50, seed=1)
    assert draws(50, seed=1) != draws(50, seed=2)
