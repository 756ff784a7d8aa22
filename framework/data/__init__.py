"""Datasets, tokenizers and resumable samplers."""

from framework.data.build import DataBundle, build_data  # noqa: F401
from framework.data.loader import GlobalBatchLoader, SampleSource  # noqa: F401
