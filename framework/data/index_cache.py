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
