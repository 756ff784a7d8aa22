"""Datasets, tokenizers and resumable samplers."""

from framework.data.build import build_data  # noqa: F401
from framework.data.loader import DataBundle, GlobalBatchLoader, SampleSource  # noqa: F401
