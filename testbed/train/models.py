"""Small real models: an MLP and a CNN for digits, a character-level transformer for text.

They are sized to train in seconds on one CPU thread, so a testbed run measures the network
and the collectives, not the model. Dropout is off: a step is a pure function of parameters and
data, which is what lets data-parallel training be checked against single-process training.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from testbed.train.data import Dataset

_INIT_LOCK = threading.Lock()


class MLP(nn.Sequential):
    def __init__(self, features: int = 64, hidden: int = 64, classes: int = 10) -> None:
        super().__init__(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and a pooling on the 8x8 image, then a linear classifier."""

    def __init__(self, classes: int = 10, channels: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


class CharTransformer(nn.Module):
    """A causal (decoder-only) transformer over characters: logits for the next character."""

    def __init__(
        self, vocabulary: int, context: int = 64, width: int = 64, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        hidden = self.embed(ids) + self.position[:length]
        return self.head(self.norm(self.blocks(hidden, mask=mask, is_causal=True)))


def build_model(name: str, data: Dataset, context: int, seed: int, width: int = 64,
                layers: int = 2) -> nn.Module:
    """The named model with weights drawn from `seed`: the same on every worker (`width` and
    `layers`: char-lm's size; width 160 and 4 layers make 1.28M parameters).

    Initialisation uses torch's global generator; the lock keeps workers that share a process
    (threads in tests) from interleaving their draws."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "mlp":
            return MLP(data.train_x.shape[1], classes=data.classes)
        if name == "cnn":
            return DigitsCNN(data.classes)
        if name == "char-lm":
            return CharTransformer(data.classes, context, width, layers=layers)
    raise ValueError(f"model: expected mlp, cnn or char-lm, got {name!r}")


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (classification) or characters (language)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Dataset, samples: int = 512, batch: int = 128
) -> dict[str, float]:
    """Held-out loss and accuracy over the first `samples` held-out samples; for language
    also perplexity, exp of the mean cross-entropy per character."""
    x, y = data.test_x[:samples], data.test_y[:samples]
    total_loss = 0.0
    correct = 0
    for start in range(0, len(x), batch):
        logits = model(x[start : start + batch]).reshape(-1, data.classes)
        targets = y[start : start + batch].reshape(-1)
        total_loss += F.cross_entropy(logits, targets, reduction="sum").item()
        correct += int((logits.argmax(-1) == targets).sum())
    count = y.numel()
    result = {"loss": total_loss / count, "accuracy": correct / count}
    if data.task == "language":
        result["perplexity"] = math.exp(result["loss"])
    return result
