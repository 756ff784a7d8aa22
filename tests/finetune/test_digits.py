"""The digits data: the file scikit-learn ships, split once, batched in the global sample order."""

from __future__ import annotations

import torch

from framework.data.digits import ImageBatchLoader, load_digits_tensors, split_digits


def test_digits_equal_scikit_learns_and_the_split_is_disjoint():
    from sklearn.datasets import load_digits

    images, labels = load_digits_tensors()
    ref = load_digits()
    assert torch.equal(images.squeeze(1) * 16, torch.tensor(ref.images, dtype=torch.float32))
    assert torch.equal(labels, torch.tensor(ref.target))
    train, test = split_digits(seed=1)
    assert (len(train), len(test)) == (1438, 359)
    assert torch.equal(torch.sort(torch.cat([train.labels, test.labels])).values, torch.sort(labels).values)
    # A step sees the same samples on 1 rank as on 2 (the [Note: global sample order]).
    one = ImageBatchLoader(train, micro_batch_size=4, global_batch_size=8, dp_rank=0, dp_size=1)
    two = [ImageBatchLoader(train, micro_batch_size=4, global_batch_size=8, dp_rank=r, dp_size=2) for r in (0, 1)]
    for _ in range(200):  # past the first epoch: reshuffled, still the same on both layouts
        a = torch.cat([one.next_batch()["labels"] for _ in range(2)])
        b = torch.cat([loader.next_batch()["labels"] for loader in two])
        assert torch.equal(a, b)
    # The whole test split, each image on exactly one rank, the same number of batches per rank.
    halves = [
        ImageBatchLoader(test, micro_batch_size=32, global_batch_size=64, dp_rank=r, dp_size=2).whole_split()
        for r in (0, 1)
    ]
    assert len(halves[0]) == len(halves[1])
    assert sum(len(b["labels"]) for h in halves for b in h) == 359
