"""Models: output shapes, identical weights under a seed, a few steps reduce the loss, and
perplexity is exp of the mean cross-entropy (a uniform model scores the vocabulary size)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from testbed.train.data import Shard, characters, digits
from testbed.train.models import MLP, CharTransformer, DigitsCNN, build_model, evaluate, loss_fn

torch.set_num_threads(1)


@pytest.mark.parametrize("model", [MLP(), DigitsCNN()], ids=["mlp", "cnn"])
def test_digit_models_map_64_pixels_to_10_logits(model):
    assert model(torch.rand(5, 64)).shape == (5, 10)


def test_char_transformer_gives_next_character_logits_and_is_causal():
    model = CharTransformer(vocabulary=30, context=16)
    ids = torch.randint(0, 30, (2, 16))
    logits = model(ids)
    assert logits.shape == (2, 16, 30)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 30
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])


def test_weights_depend_only_on_the_seed():
    data = characters(context=8, max_chars=20_000)

    def weights(seed: int) -> torch.Tensor:
        model = build_model("char-lm", data, 8, seed)
        return nn.utils.parameters_to_vector(model.parameters())

    assert torch.equal(weights(1), weights(1))
    assert not torch.equal(weights(1), weights(2))


def _train(name: str, data, steps: int, lr: float) -> tuple[float, float]:
    """Held-out loss before and after `steps` Adam steps of batch 32."""
    model = build_model(name, data, data.train_x.shape[-1], seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    shard = Shard(len(data.train_y), 0, 1, seed=0)
    before = evaluate(model, data, samples=256)["loss"]
    for step in range(steps):
        batch = shard.batch(step, 32)
        optimizer.zero_grad()
        loss_fn(model(data.train_x[batch]), data.train_y[batch]).backward()
        optimizer.step()
    return before, evaluate(model, data, samples=256)["loss"]


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_a_few_steps_on_digits_reduce_the_held_out_loss(name):
    before, after = _train(name, digits(), steps=40, lr=0.01)
    assert after < 0.5 * before


def test_a_few_steps_on_the_corpus_reduce_the_held_out_loss():
    before, after = _train("char-lm", characters(context=16, max_chars=20_000), steps=30, lr=0.01)
    assert after < 0.8 * before


class Uniform(nn.Module):
    """Every character equally likely."""

    def __init__(self, vocabulary: int) -> None:
        super().__init__()
        self.vocabulary = vocabulary

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.vocabulary)


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    data = characters(context=16, max_chars=20_000)
    result = evaluate(Uniform(data.classes), data, samples=100, batch=32)
    assert result["perplexity"] == pytest.approx(data.classes, rel=1e-5)


def test_perplexity_is_exp_of_the_mean_cross_entropy_per_character():
    data = characters(context=16, max_chars=20_000)
    model = build_model("char-lm", data, 16, seed=0)
    result = evaluate(model, data, samples=50, batch=7)
    with torch.no_grad():
        expected = loss_fn(model(data.test_x[:50]), data.test_y[:50])
    assert result["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert result["perplexity"] == pytest.approx(float(expected.exp()), rel=1e-5)
