"""Real data that ships with every installation, so runs never download anything.

- digits: scikit-learn's 1797 8x8 handwritten digits (`load_digits`), pixels scaled to [0, 1].
- stdlib: the Python standard library's own .py sources, read in sorted order up to a size cap,
  as character-level language-model data: windows of `context + 1` characters.

The train/held-out split uses a fixed seed so held-out figures compare across job seeds; the
job seed decides which worker gets which training samples and in what order it visits them.
"""

from __future__ import annotations

import functools
import gzip
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from netem.extras import locate

SPLIT_SEED = 0
HELD_OUT = 0.2
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # in scikit-learn's package
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class Dataset:
    """One task's tensors: `classes` is the number of labels, or the vocabulary size."""

    task: Literal["classify", "language"]
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int


@functools.cache
def digits() -> Dataset:
    """scikit-learn's digits: 64 pixel features, 10 classes, 20% held out. Read from its file
    as `sklearn.datasets.load_digits` reads it, without importing scikit-learn (seconds of
    imports: 4.5 s in the guest)."""
    package = locate("sklearn", "digits", "the digits data (models mlp and cnn)")
    with gzip.open(package.joinpath(*DIGITS_FILE), "rt") as rows:
        table = np.loadtxt(rows, delimiter=",")  # 64 pixels (0..16), then the label
    x = torch.from_numpy(table[:, :-1] / 16.0).float()
    y = torch.from_numpy(table[:, -1].astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(y)))
    held = int(len(y) * HELD_OUT)
    test, train = order[:held], order[held:]
    return Dataset("classify", x[train], y[train], x[test], y[test], classes=10)


def _python_sources(directory: Path) -> Iterator[Path]:
    """.py files under `directory`, depth first in name order; third-party folders skipped."""
    for entry in sorted(os.scandir(directory), key=lambda entry: entry.name):
        if entry.is_dir(follow_symlinks=False) and entry.name not in SKIPPED_DIRS:
            yield from _python_sources(Path(entry.path))
        elif entry.is_file() and entry.name.endswith(".py"):
            yield Path(entry.path)


@functools.cache
def stdlib_corpus(max_chars: int = 2_000_000) -> str:
    """The first `max_chars` characters of the standard library's sources (files that are not
    valid UTF-8, a few deliberate test cases, are skipped). Same Python, same corpus."""
    parts: list[str] = []
    total = 0
    for path in _python_sources(Path(sysconfig.get_paths()["stdlib"])):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def encode(text: str) -> tuple[torch.Tensor, str]:
    """Character ids and the vocabulary (the sorted distinct characters), without a loop."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocabulary, ids = np.unique(codes, return_inverse=True)
    return torch.from_numpy(ids.astype(np.int64)), "".join(map(chr, vocabulary))


@functools.cache
def characters(context: int = 64, max_chars: int = 2_000_000) -> Dataset:
    """Next-character prediction on the stdlib corpus; the last 20% of it is held out.

    Windows of `context + 1` characters overlap by one, so every character transition in a
    split is a target exactly once; x is a window's first `context` ids, y the next ones."""
    ids, vocabulary = encode(stdlib_corpus(max_chars))
    cut = int(len(ids) * (1 - HELD_OUT))

    def windows(part: torch.Tensor) -> torch.Tensor:
        return part.unfold(0, context + 1, context)

    train, test = windows(ids[:cut]), windows(ids[cut:])
    return Dataset(
        "language", train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:], len(vocabulary)
    )


class Shard:
    """This worker's disjoint part of the training set (a seeded permutation dealt round-robin),
    visited in a fresh order each epoch seeded from (seed, rank, epoch)."""

    def __init__(self, size: int, rank: int, world: int, seed: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank: needs 0 <= rank < world ({world}), got {rank}")
        order = np.random.default_rng(seed).permutation(size)
        self.indices = torch.from_numpy(order[rank::world].copy())
        self.rank = rank
        self.seed = seed

    def batch(self, step: int, size: int) -> torch.Tensor:
        """Training-set indices of this worker's samples for `step`."""
        per_epoch = len(self.indices) // size
        if per_epoch == 0:
            raise ValueError(
                f"batch: {size} samples exceed this worker's shard of {len(self.indices)}"
            )
        epoch, position = divmod(step, per_epoch)
        order = np.random.default_rng([self.seed, self.rank, epoch]).permutation(len(self.indices))
        return self.indices[torch.from_numpy(order[position * size : (position + 1) * size])]
