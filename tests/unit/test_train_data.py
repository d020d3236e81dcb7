"""Data: the stdlib corpus is deterministic and capped, character windows chain, workers' shards
are disjoint and cover the training set, and batches replay under a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from testbed.train.data import Shard, characters, digits, encode, stdlib_corpus


def test_corpus_is_deterministic_capped_and_starts_with_the_first_sorted_file():
    first = stdlib_corpus(50_000)
    stdlib_corpus.cache_clear()
    assert stdlib_corpus(50_000) == first
    assert len(first) == 50_000
    assert stdlib_corpus(20_000) == first[:20_000]
    assert first.startswith('"""Record of phased-in incompatible language changes.')  # __future__


def test_encoding_round_trips_through_the_sorted_vocabulary():
    ids, vocabulary = encode("hello, wörld\n")
    assert vocabulary == "".join(sorted(set("hello, wörld\n")))
    assert "".join(np.array(list(vocabulary))[ids.numpy()]) == "hello, wörld\n"


def test_character_windows_predict_the_next_character_and_chain():
    data = characters(context=16, max_chars=20_000)
    assert data.task == "language"
    assert data.train_x.shape[1] == data.train_y.shape[1] == 16
    assert torch.equal(data.train_y[:, :-1], data.train_x[:, 1:])
    assert torch.equal(data.train_x[1:, 0], data.train_y[:-1, -1])
    assert data.classes == len(set(stdlib_corpus(20_000)))
    # 80% train, 20% held out; every transition inside a split is a target once.
    assert data.train_y.numel() == (16_000 - 1) // 16 * 16
    assert data.test_y.numel() == (4_000 - 1) // 16 * 16


@pytest.mark.parametrize("world", [1, 3, 8])
def test_shards_are_disjoint_and_cover_the_training_set(world):
    shards = [Shard(1000, rank, world, seed=5) for rank in range(world)]
    everything = torch.cat([shard.indices for shard in shards])
    assert sorted(everything.tolist()) == list(range(1000))
    assert max(len(s.indices) for s in shards) - min(len(s.indices) for s in shards) <= 1


def test_a_shard_serves_each_of_its_samples_once_per_epoch_in_a_seeded_order():
    shard = Shard(1000, rank=1, world=4, seed=5)  # 250 samples: 10 batches of 25 per epoch
    epoch = torch.cat([shard.batch(step, 25) for step in range(10)])
    assert sorted(epoch.tolist()) == sorted(shard.indices.tolist())
    next_epoch = torch.cat([shard.batch(step, 25) for step in range(10, 20)])
    assert sorted(next_epoch.tolist()) == sorted(epoch.tolist())
    assert not torch.equal(next_epoch, epoch)
    assert torch.equal(Shard(1000, 1, 4, seed=5).batch(3, 25), shard.batch(3, 25))
    assert not torch.equal(Shard(1000, 1, 4, seed=6).batch(3, 25), shard.batch(3, 25))


def test_a_batch_larger_than_the_shard_is_refused():
    with pytest.raises(ValueError, match="batch: 300 samples exceed this worker's shard of 250"):
        Shard(1000, rank=0, world=4, seed=0).batch(0, 300)


def test_digits_split_is_fixed_and_scaled():
    data = digits()
    assert data.task == "classify" and data.classes == 10
    assert data.train_x.shape == (1438, 64) and data.test_x.shape == (359, 64)
    assert float(data.train_x.min()) >= 0 and float(data.train_x.max()) <= 1
    assert set(data.test_y.tolist()) == set(range(10))


def test_digits_are_scikit_learns_own():
    """Read from scikit-learn's file without importing it: its loader's samples and labels, in
    its order, split as before."""
    from sklearn.datasets import load_digits

    data, bunch = digits(), load_digits()
    x = torch.from_numpy(bunch.data / 16.0).float()
    y = torch.from_numpy(bunch.target).long()
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    held = len(data.test_y)
    assert torch.equal(data.train_x, x[order[held:]]) and torch.equal(data.test_x, x[order[:held]])
    assert torch.equal(data.train_y, y[order[held:]]) and torch.equal(data.test_y, y[order[:held]])
