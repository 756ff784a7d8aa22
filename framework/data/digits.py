"""scikit-learn's bundled handwritten digits (1,797 images of 8x8 pixels, 10 classes): no download.

The images are scaled to [0, 1] and split once, deterministically (a seeded permutation), into a
training set and a held-out test set. The training order is reshuffled every epoch with a
generator seeded by (seed, epoch), so the order depends on neither the rank nor the world size;
batching follows the same global sample order as the token loaders ([Note: global sample order]
in `framework/data/loader.py`): the loader's whole state is the number of samples consumed.
"""

from __future__ import annotations

import os

import torch

from framework.data.loader import DataBundle, GlobalBatchLoader
from framework.errors import UserInputError

NUM_CLASSES = 10
IMAGE_SIZE = 8


def load_digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """All images as (N, 1, 8, 8) float32 in [0, 1], and their labels (N,) int64.

    Read straight from the CSV file scikit-learn ships (`sklearn/datasets/data/digits.csv.gz`: 64
    pixel values then the label per line), without importing scikit-learn: its native libraries
    (its own OpenMP runtime) would be loaded into every training rank for one small file."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UserInputError(
            "data=digits needs scikit-learn installed (it ships the digits file); "
            "pip install the version pinned in requirements.lock"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        rows = [[int(v) for v in line.split(",")] for line in f if line.strip()]
    table = torch.tensor(rows, dtype=torch.float32)
    images = table[:, :64].reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE) / 16.0
    return images, table[:, 64].long()


class DigitsSplit:
    """One split of the digits: `source[i]` is (image, label) of the i-th sample of the epoch's
    order (i may run past one epoch; each epoch has its own shuffle when `shuffle`)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, seed: int, shuffle: bool):
        self.images, self.labels = images, labels
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._order = -1, torch.arange(len(labels))

    def __len__(self) -> int:
        return len(self.labels)

    def _order_of(self, epoch: int) -> torch.Tensor:
        if self.shuffle and epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(len(self.labels), generator=gen)
        return self._order

    def item(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, offset = divmod(index, len(self.labels))
        sample = int(self._order_of(epoch)[offset])
        return self.images[sample], self.labels[sample]


def split_digits(seed: int, test_fraction: float = 0.2) -> tuple[DigitsSplit, DigitsSplit]:
    """(train, test): the same split for every seed of training, chosen by a fixed permutation so
    the test set never changes between runs that compare settings."""
    images, labels = load_digits_tensors()
    perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_test = round(len(labels) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return (
        DigitsSplit(images[train], labels[train], seed, shuffle=True),
        DigitsSplit(images[test], labels[test], seed, shuffle=False),
    )


class ImageBatchLoader(GlobalBatchLoader):
    """`GlobalBatchLoader` over (image, label) samples: `next_batch` gives {"inputs", "labels"}."""

    def next_batch(self) -> dict:
        indices = self.sample_indices()
        self._micro_step += 1
        if self._micro_step == self.accum_steps:
            self._micro_step = 0
            self.consumed += self.global_batch
        images, labels = zip(*(self.source.item(i) for i in indices))
        return {"inputs": torch.stack(images), "labels": torch.stack(labels)}

    def sample_indices(self) -> list:
        # Indices run on past the end: DigitsSplit maps them to the next epoch's order.
        start = self.consumed + (self._micro_step * self.dp_size + self.dp_rank) * self.micro
        return [start + i for i in range(self.micro)]

    def whole_split(self) -> list:
        """This data-parallel rank's share of the whole split in micro-batches, every sample seen
        by exactly one rank (a full evaluation). Ranks get the same number of batches (the last
        ones may be empty), so collectives inside the model's forward stay matched."""
        n = len(self.source)
        per_rank = -(-n // self.dp_size)
        batches = []
        for start in range(0, per_rank, self.micro):
            indices = [i * self.dp_size + self.dp_rank for i in range(start, min(start + self.micro, per_rank))]
            indices = [i for i in indices if i < n]
            if indices:
                images, labels = zip(*(self.source.item(i) for i in indices))
                batches.append({"inputs": torch.stack(images), "labels": torch.stack(labels)})
            else:
                batches.append(
                    {"inputs": torch.empty(0, 1, IMAGE_SIZE, IMAGE_SIZE), "labels": torch.empty(0, dtype=torch.long)}
                )
        return batches


def build_digits_data(*, micro_batch_size: int, global_batch_size: int, dp_rank: int, dp_size: int, seed: int):
    """data=digits: the training split and the held-out test split (the validation loader)."""
    train, test = split_digits(seed)
    kw = {
        "micro_batch_size": micro_batch_size,
        "global_batch_size": global_batch_size,
        "dp_rank": dp_rank,
        "dp_size": dp_size,
    }
    return DataBundle(ImageBatchLoader(train, **kw), ImageBatchLoader(test, **kw), vocab_size=NUM_CLASSES)
