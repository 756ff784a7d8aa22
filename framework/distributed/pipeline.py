"""Pipeline parallelism (`parallelism.pp`): a model cut into stages by layers, run by torch's
schedules (`torch.distributed.pipelining`), each stage sharded by our engine over its
data-parallel ranks and split by tensor parallelism inside.

    pipe = Pipeline(model, dims, mesh, cfg, family, device, accum_steps)
    pipe.model            # this rank's part: the model's own modules under the model's own names
    loss = pipe.train_batches(batches)    # one optimizer step's forward and backward; the loss of
                                          # the whole batch, on every rank of the pipeline

Layout. `pp * v` stages (v = parallelism.pp_virtual_stages); rank r of the pp dimension runs
stages r, r + pp, ... (the loop placement of gpipe, 1f1b and interleaved_1f1b) or r and
2 pp - 1 - r (zbv's V). Stage s holds blocks `split[s]` (parallelism.pp_split, or even), the
first also the embedding, the last the norm and head: the family's `pipeline_stage` builds it
under the whole model's names. `PipelinePart` merges this rank's stages into one module whose
parameter names, state dict and optimizer are the whole model's (less what other ranks hold),
so checkpoints are written by every stage and read at any other pp degree.

[Note: our engine under torch's schedules]
torch's `PipelineStage` drives FSDP2 modules itself (it recognises `FSDPModule` and calls
`set_requires_gradient_sync(False)` before every backward, then FSDP2's own post-backward
internals once at the end, `perform_reduce_grad`); our units are not torch's. So `EngineStage`,
a subclass (no change to torch), counts its stage's backwards over a step and turns gradient
synchronisation on for the last one only: microbatches 1..m-1 accumulate unsharded gradients
without communication, and the m-th backward reduce-scatters once (and all-reduces over the
replicas under hybrid), as gradient accumulation does without a pipeline. Each stage is a root
of its own (`fully_shard(stage)`, with no parameters of its own), so its backward ends in the
engine's final callback, which waits for the reductions. As torch does for FSDP2, a unit stays
gathered after every backward but the last (`set_reshard_after_backward(False)`), so a forward
that follows a backward finds it gathered; under ZeRO-3 (parallelism.strategy=full) each forward
still frees it after, and a backward after a forward gathers it again (grad_op keeps everything).

[Note: zero-bubble schedules on our engine]
Zero-bubble schedules split each backward into the input gradient (I, sent upstream at once)
and the weight gradient (W, run later to fill bubbles) through `torch.autograd.grad` on the
stage's parameters. Our stage's `parameters()` are the shard pieces, not the gathered tensors
the forward used, so that split finds no weights. The stage is therefore given a `dw_builder`
(torch's documented hook for a custom weight pass): the I action runs the whole backward (input
and weight gradients, through the engine's hooks), the W action runs nothing. The schedule's
order and its results are kept; the weight half no longer fills the bubble, so zbv's bubble is
its 2-stage interleaved figure (framework/config/pipeline.py, `bubble_fraction`).

The loss of each microbatch is the task's mean over its labelled positions divided by the
number of microbatches (scale_grads=False), as gradient accumulation divides it; the last stage
sums them and one all-reduce over the pp group gives every rank the step's loss. The gradient
norm needs no pipeline step: the engine's norm sums every rank's pieces over the world, each
divided by its number of copies ([Note: pieces that describe themselves]), which covers every
stage once.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from framework.config.pipeline import PipelineSchedule, balanced_split, even_split, virtual_stages
from framework.distributed.parallel_dims import ParallelDims
from framework.errors import UserInputError

_SCHEDULES = {
    PipelineSchedule.gpipe: ScheduleGPipe,
    PipelineSchedule.one_f_one_b: Schedule1F1B,
    PipelineSchedule.interleaved_1f1b: ScheduleInterleaved1F1B,
    PipelineSchedule.zbv: ScheduleZBVZeroBubble,
}


def stages_of_rank(rank: int, pp: int, v: int, schedule: PipelineSchedule) -> List[int]:
    """The stage indices pipeline rank `rank` runs, in its order."""
    if schedule == PipelineSchedule.zbv:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(v)]


def layer_ranges(n_layers: int, n_stages: int, split: List[int], pp: int, costs=None) -> List[tuple]:
    """[start, end) of every stage's blocks; refuses a split that does not cover the model.
    No split: `costs` = (each block's, the head's) balanced (`balanced_split`), else even."""
    if split:
        counts = list(split)
    elif costs is not None and n_layers >= n_stages:
        counts = balanced_split(costs[0], n_stages, costs[1])
    else:
        counts = even_split(n_layers, n_stages)
    if sum(counts) != n_layers or len(counts) != n_stages or min(counts) < 1:
        given = f"parallelism.pp_split={list(split)}" if split else f"parallelism.pp={pp}"
        raise UserInputError(
            f"{given}: {n_stages} stages need at least one of the model's {n_layers} layers each"
            + (" and the counts must sum to them" if split else "; lower the pp degree or the virtual stages")
        )
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [(a, a + c) for a, c in zip(starts, counts)]


def _costs(model: nn.Module, blocks: List[nn.Module], family) -> tuple:
    """(each block's parameters, the head's): a token's matmul work in each, the measure stages
    are balanced by. The head is what the last stage holds besides its block (the final norm and
    the output projection); the embedding, a lookup, counts nothing."""
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    per_block = [float(count(b)) for b in blocks]
    n = len(blocks)
    last = family.pipeline_stage(model, n - 1, n, False, True)
    return per_block, float(count(last) - per_block[-1])


class PipelinePart(nn.Module):
    """This rank's stages merged into one module: the model's own names and nothing of the other
    ranks' stages. Its `forward` is not called (the schedule calls each stage); the optimizer,
    the state dict and the gradient norm read it."""

    def __init__(self, stages: List[nn.Module]):
        super().__init__()
        for stage in stages:
            _merge(self, stage)
        self.__dict__["stages"] = stages  # not submodules: their modules are registered above

    def comm_stats(self) -> dict:  # the engine's counters, summed over this rank's stages
        out: Dict[str, float] = {}
        for stage in self.stages:
            for k, val in stage.comm_stats().items():  # a ratio: the largest; counters: summed
                out[k] = max(out.get(k, 0), val) if k.endswith("_over_ideal") else out.get(k, 0) + val
        return out

    def reset_comm_stats(self) -> None:
        for stage in self.stages:
            stage.reset_comm_stats()


def _container(module: nn.Module) -> bool:
    """A module that only groups others (a ModuleDict, a bare nn.Module): merged by its children."""
    return type(module) in (nn.ModuleDict, nn.Module)


def _merge(into: nn.Module, module: nn.Module) -> None:
    for name, child in module.named_children():
        have = into._modules.get(name)
        if have is None:
            if _container(child):
                into.add_module(name, type(child)())
                _merge(into._modules[name], child)
            else:
                into.add_module(name, child)
        elif _container(have) and _container(child):
            _merge(have, child)
        elif have is not child:
            raise AssertionError(f"two pipeline stages hold different modules named {name}")


def _units_of(module: nn.Module) -> List[nn.Module]:
    """The sharding units of a stage: every module with parameters below its containers (the
    blocks, the embedding, the norm, the head), in registration order."""
    out = []
    for child in module.children():
        if _container(child):
            out += _units_of(child)
        elif any(True for _ in child.parameters()):
            out.append(child)
    return out


class EngineStage(PipelineStage):
    """A `PipelineStage` whose module our engine sharded: [Note: our engine under torch's schedules]."""

    def __init__(self, *args, n_microbatches: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_microbatches, self.backwards = n_microbatches, 0

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        # dw_builder makes every backward of ours "full" ([Note: zero-bubble schedules on our engine])
        self.backwards += 1
        last = self.backwards == self.n_microbatches
        self.submod.set_requires_gradient_sync(last)
        self.submod.set_reshard_after_backward(last)  # the next microbatch's forward finds them gathered
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


def _stage_plans(plan_fn):
    """The family's tensor-parallel plan asked of each of the part's stages (each a module of the
    model's own family, which its plan reads: a Hugging Face stage answers `config` and the
    embeddings as a transformers model does), merged; a stage's module names are the part's."""
    if plan_fn is None:
        return None  # apply_tensor_parallel refuses it by name

    def plan(part: "PipelinePart", sequence_parallel: bool) -> dict:
        from framework.distributed.tensor_parallel import _TP_ATTR

        out: dict = {}
        for stage in part.stages:
            setattr(stage, _TP_ATTR, getattr(part, _TP_ATTR))  # the degree, for the plan's width checks
            out.update(plan_fn(stage, sequence_parallel))
        return out

    return plan


def _no_weight_pass():
    return lambda: None


class Pipeline:
    def __init__(
        self, model: nn.Module, dims: ParallelDims, mesh, cfg, family, device, accum_steps: int, task, loss_fn
    ):
        """`task`: the model's task (causal_lm only for now); `loss_fn(logits, labels)`: its mean
        loss over a microbatch's labelled positions (the trainer passes the task's cross-entropy)."""
        p, t = cfg.parallelism, cfg.trainer
        self.loss_fn = loss_fn
        if cfg.stage.value != "training" or task.name != "causal_lm":
            raise UserInputError(
                f"parallelism.pp={dims.pp} with stage={cfg.stage.value} and model.task={task.name}: pipelines train "
                "causal language models on (inputs, labels) batches only for now; set parallelism.pp=1"
            )
        if cfg.peft.lora.enabled:
            raise UserInputError(
                f"parallelism.pp={dims.pp} with peft.lora.enabled=true: adapters are not cut into stages yet; "
                "set parallelism.pp=1"
            )
        meta = any(param.is_meta for param in model.parameters())
        if family.pipeline_stage is None:
            raise UserInputError(
                f"parallelism.pp={dims.pp} with model.name={cfg.model.name}: its family cannot be cut into "
                "stages yet; set parallelism.pp=1"
            )
        family.check_pipeline(model, dims.pp)
        self.schedule_name = PipelineSchedule(p.pp_schedule)
        v = virtual_stages(self.schedule_name, p.pp_virtual_stages)
        n_stages = dims.pp * v
        self.microbatches = accum_steps if p.pp_microbatches == -1 else p.pp_microbatches
        self.samples = t.micro_batch_size * accum_steps  # per data-parallel rank and step
        blocks = family.blocks(model)
        ranges = layer_ranges(len(blocks), n_stages, list(p.pp_split), dims.pp, _costs(model, blocks, family))
        self.pp_rank = mesh.get_local_rank("pp")
        self.pp_group = mesh["pp"].get_group()
        mine = stages_of_rank(self.pp_rank, dims.pp, v, self.schedule_name)
        modules = [family.pipeline_stage(model, *ranges[s], s == 0, s == n_stages - 1) for s in mine]
        if meta and not all(hasattr(m, "materialize") for m in modules):
            raise UserInputError(
                f"parallelism.pp={dims.pp} with model.meta_init (the model built on the meta device) and "
                f"model.name={cfg.model.name}: its stages cannot be materialised yet; set model.meta_init=false "
                "or parallelism.pp=1"
            )
        self.model = PipelinePart(modules)
        self.holds_first, self.holds_last = 0 in mine, n_stages - 1 in mine
        self._shard(dims, mesh, p, family)
        if meta:  # this rank's stages only: the other ranks' layers stay on the meta device
            self.model.to_empty(device=device)
            for module in modules:
                module.materialize()  # what the model's init does not fill (the rotary table)
        dtype = _DTYPES[p.param_dtype]
        mb = self.samples // self.microbatches
        self.stages = []
        for index, module in zip(mine, modules):
            x, y = module.example_io(mb, cfg.data.seq_len, dtype, tp=dims.tp)
            # what needs a gradient: the hidden states between stages (not the tokens), every output
            x.requires_grad_(x.is_floating_point())
            y.requires_grad_(True)
            self.stages.append(
                EngineStage(
                    module,
                    index,
                    n_stages,
                    device,
                    input_args=x,
                    output_args=y,
                    group=self.pp_group,
                    dw_builder=_no_weight_pass,
                    n_microbatches=self.microbatches,
                )
            )
        schedule_class = _SCHEDULES[self.schedule_name]
        stages = self.stages if v > 1 else self.stages[0]
        self.losses: List[torch.Tensor] = []
        self.schedule = schedule_class(stages, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _shard(self, dims, mesh, p, family) -> None:
        """Tensor parallel over this rank's part, then our engine: every block, the embedding and
        the norm with the head as units, each stage a root (no parameters of its own)."""
        from framework.distributed.parallelize import shard_kwargs

        part = self.model
        if dims.tp_enabled:
            from framework.distributed.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(part, mesh["tp"], p, _stage_plans(family.tp_plan))
        fully_shard, kwargs = shard_kwargs(mesh, dims, p)
        reshard = p.strategy.value != "grad_op"
        for stage in part.stages:
            for unit in _units_of(stage):
                fully_shard(unit, reshard_after_forward=reshard, **kwargs)
            fully_shard(stage, reshard_after_forward=reshard, **kwargs)

    def _loss(self, logits, labels) -> torch.Tensor:
        return self.loss_fn(logits, labels) / self.microbatches

    def train_batches(self, batches: list) -> torch.Tensor:
        """Forward and backward of one optimizer step's batches ((inputs, labels) pairs, this
        data-parallel rank's); returns the step's loss on every rank (a 0-d tensor)."""
        from framework.distributed.tensor_parallel import full, loss_context

        inputs = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        for stage in self.stages:
            stage.backwards = 0
        losses: List[torch.Tensor] = []
        args = (inputs,) if self.holds_first else ()
        kwargs = {"target": labels, "losses": losses} if self.holds_last else {}
        with loss_context(self.model):
            self.schedule.step(*args, **kwargs)
        total = torch.zeros((), device=inputs.device)
        for loss in losses:
            total += full(loss.detach()).float()
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds the losses
        return total

    @torch.no_grad()
    def eval_total(self, batches: list, per_step: int) -> torch.Tensor:
        """The sum of the batches' mean losses, without backward, on every rank of the pipeline;
        `per_step` batches (a training step's worth, the stages' static shapes) per schedule pass."""
        from framework.distributed.tensor_parallel import full, loss_context

        total = torch.zeros((), device=batches[0][0].device)
        for start in range(0, len(batches), per_step):
            group = batches[start : start + per_step]
            losses: List[torch.Tensor] = []
            args = (torch.cat([b[0] for b in group]),) if self.holds_first else ()
            kwargs = {"target": torch.cat([b[1] for b in group]), "losses": losses} if self.holds_last else {}
            with loss_context(self.model):
                self.schedule.eval(*args, **kwargs)
            for loss in losses:  # each the microbatch's mean / microbatches: the group's mean
                total += full(loss.detach()).float() * len(group)
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds the losses
        return total


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
