"""megatron-core's index cache (`<data.cache_dir>/index/*.npy`) read without unpickling.

GPTDataset and BlendedDataset load their cached sample/document/shuffle indices with
`numpy.load(..., allow_pickle=True)`. numpy then unpickles any file that is not a `.npy` array,
so a crafted file in a shared cache directory would run code. `no_pickle_in_megatron_indices()`
gives those two modules a `numpy` whose `load` always passes `allow_pickle=False` (their indices
are plain integer arrays: nothing legitimate is lost); a file that is not such an array is
refused in one line naming it.
"""

from __future__ import annotations

import numpy

from framework.errors import UserInputError


class _NumpyWithoutPickle:
    """The numpy module, except that `load` never unpickles."""

    def __getattr__(self, name: str):
        return getattr(numpy, name)

    @staticmethod
    def load(file, *args, **kwargs):
        kwargs["allow_pickle"] = False
        try:
            return numpy.load(file, *args, **kwargs)
        except ValueError as exc:
            text = str(exc)
            if "pickle" not in text and "Python objects" not in text:
                raise
            raise UserInputError(
                f"data.cache_dir: {file} is not an index array megatron-core wrote (it holds "
                "pickled Python objects, which are never loaded: they can run code); delete "
                "it and the index is rebuilt"
            ) from None


def no_pickle_in_megatron_indices() -> None:
    """Make megatron-core's dataset modules load their index cache with allow_pickle=False."""
    from megatron.core.datasets import blended_dataset, gpt_dataset

    for module in (gpt_dataset, blended_dataset):
        if not isinstance(module.numpy, _NumpyWithoutPickle):
            module.numpy = _NumpyWithoutPickle()


# [Note: cached indices checked against their dataset]
# A cache hit is loaded as it is: megatron-core never compares the arrays with the documents they
# index, so a value out of range (an altered file, or one from another dataset under the same name)
# is an IndexError at some later batch, or a sample made of the wrong tokens. `check_indices` holds
# every array of a built dataset to what megatron-core's builder writes, and refuses in one line
# naming the file otherwise, as `check_index` does for a `.idx`:
#   document_index  1-D integers, each a document of the split (the ids megatron drew them from);
#   sample_index    (samples + 1) x 2 integers: a position in document_index, never decreasing, and
#                   a token offset inside that document (0 <= offset < its length);
#   shuffle_index   one integer per sample, each a sample (0 <= i < samples);
#   a blend's dataset_index / dataset_sample_index: a dataset of the blend and one of its samples.
# The arrays are read in chunks of _CHUNK rows, so a large index is checked in bounded memory.
_CHUNK = 1 << 22


def check_indices(dataset) -> None:
    """Refuse a GPTDataset's or BlendedDataset's index arrays (and those of the datasets it blends)
    that do not fit the documents they index: see [Note: cached indices checked against their dataset]."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.gpt_dataset import GPTDataset

    if isinstance(dataset, BlendedDataset):
        _check_blend(dataset)
        for part in dataset.datasets:
            check_indices(part)
    elif isinstance(dataset, GPTDataset):
        _check_gpt(dataset)


def _refuse(dataset, split: str, affix: str, what: str) -> UserInputError:
    import os

    name = f"{dataset.unique_description_hash}-{type(dataset).__name__}-{split}-{affix}.npy"
    path = os.path.join(dataset.config.path_to_cache or "", name)
    return UserInputError(
        f"data.cache_dir: {path} {what}: it is not the index megatron-core builds for this data (altered, "
        "or written for another dataset); delete it and the index is rebuilt"
    )


def _shape(dataset, split: str, affix: str, array, ndim: int) -> None:
    if not isinstance(array, numpy.ndarray) or array.dtype.kind not in "iu" or array.ndim != ndim:
        what = f"{getattr(array, 'ndim', '?')}-D {getattr(array, 'dtype', type(array).__name__)}"
        raise _refuse(dataset, split, affix, f"holds a {what} array, not {ndim}-D integers")
    if ndim == 2 and array.shape[1] != 2:  # noqa: PLR2004 - (position, offset) pairs
        raise _refuse(dataset, split, affix, f"has {array.shape[1]} columns, not 2")
    if len(array) == 0:
        raise _refuse(dataset, split, affix, "is empty")


def _chunks(n: int):
    for start in range(0, n, _CHUNK):
        yield start, min(n, start + _CHUNK)


def _check_gpt(ds) -> None:
    split = ds.index_split.name
    documents, samples, shuffle = ds.document_index, ds.sample_index, ds.shuffle_index
    _shape(ds, split, "document_index", documents, 1)
    _shape(ds, split, "sample_index", samples, 2)
    _shape(ds, split, "shuffle_index", shuffle, 1)
    first, last = int(ds.indices[0]), int(ds.indices[-1])
    for lo, hi in _chunks(len(documents)):
        part = documents[lo:hi]
        bad = part[(part < first) | (part > last)]
        if len(bad):
            what = f"holds document id {int(bad[0])}, not one of the {split} split's {first}-{last}"
            raise _refuse(ds, split, "document_index", what)
    lengths = ds.dataset.sequence_lengths
    previous = 0
    for lo, hi in _chunks(len(samples)):
        positions, offsets = samples[lo:hi, 0].astype(numpy.int64), samples[lo:hi, 1].astype(numpy.int64)
        outside = (positions < 0) | (positions >= len(documents))
        if outside.any():
            where = int(positions[numpy.argmax(outside)])
            what = f"points at position {where} of a {len(documents)}-entry document index"
            raise _refuse(ds, split, "sample_index", what)
        steps = numpy.diff(positions, prepend=previous if lo else positions[0])
        if (steps < 0).any():
            what = f"goes back in the document index at sample {lo + int(numpy.argmax(steps < 0))}"
            raise _refuse(ds, split, "sample_index", what)
        previous = positions[-1]
        limits = lengths[documents[positions]]
        past = (offsets < 0) | (offsets >= limits)
        if past.any():
            row = int(numpy.argmax(past))
            raise _refuse(
                ds,
                split,
                "sample_index",
                f"starts sample {lo + row} at token {int(offsets[row])} of a document of {int(limits[row])} tokens",
            )
    n = len(samples) - 1
    if len(shuffle) != n:
        raise _refuse(ds, split, "shuffle_index", f"has {len(shuffle)} entries for {n} samples")
    for lo, hi in _chunks(n):
        part = shuffle[lo:hi].astype(numpy.int64)
        bad = part[(part < 0) | (part >= n)]
        if len(bad):
            raise _refuse(ds, split, "shuffle_index", f"names sample {int(bad[0])}, not one of its {n}")


def _check_blend(ds) -> None:
    split = ds.split.name
    which, within = ds.dataset_index, ds.dataset_sample_index
    _shape(ds, split, "dataset_index", which, 1)
    _shape(ds, split, "dataset_sample_index", within, 1)
    if len(which) != len(within):
        raise _refuse(ds, split, "dataset_sample_index", f"has {len(within)} entries for {len(which)} samples")
    sizes = numpy.array([len(d) for d in ds.datasets], dtype=numpy.int64)
    for lo, hi in _chunks(len(which)):
        part = which[lo:hi].astype(numpy.int64)
        if int(part.min()) < 0 or int(part.max()) >= len(sizes):
            bad = int(part.max()) if int(part.max()) >= len(sizes) else int(part.min())
            raise _refuse(ds, split, "dataset_index", f"names dataset {bad} of a blend of {len(sizes)}")
        samples = within[lo:hi].astype(numpy.int64)
        past = (samples < 0) | (samples >= sizes[part])
        if past.any():
            row = int(numpy.argmax(past))
            raise _refuse(
                ds,
                split,
                "dataset_sample_index",
                f"names sample {int(samples[row])} of dataset {int(part[row])}, which has {int(sizes[part[row]])}",
            )
