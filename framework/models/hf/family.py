"""The Hugging Face family's record (`model=hf`)."""

from framework.models.hf.args import NAMES, HFArgs
from framework.models.hf.model import (
    HFAdapter,
    blocks,
    build_hf,
    check_config,
    flops_per_token,
    hf_config,
    init_weights,
    num_labels,
    task_of,
    weights_dir,
)
from framework.models.hf.pipeline import check_pipeline, pipeline_stage
from framework.models.record import ModelFamily
from framework.models.tasks import get_task


def _context_parallel(model, cp: int) -> None:
    from framework.models.hf.context import prepare_context_parallel

    prepare_context_parallel(model, cp)


def _plan(model, sequence_parallel: bool):
    from framework.models.hf.parallelize import hf_tp_plan

    return hf_tp_plan(model, sequence_parallel)


FAMILY = ModelFamily(
    names=NAMES,
    build=build_hf,
    check=check_config,
    blocks=blocks,
    task=lambda cfg: get_task(task_of(cfg)),
    num_labels=num_labels,
    init_weights=init_weights,
    adapter=HFAdapter,
    flops_per_token=flops_per_token,
    vocab_size=lambda cfg: int(hf_config(cfg).vocab_size),
    weights_dir=weights_dir,
    args_type=HFArgs,
    tp_plan=lambda model, sequence_parallel: _plan(model, sequence_parallel),
    pipeline_stage=pipeline_stage,
    check_pipeline=check_pipeline,
    context_parallel=_context_parallel,
)
