"""Pipeline parallelism (`parallelism.pp`): a model cut into stages by layers, run by torch's
schedules (`torch.distributed.pipelining`), each stage sharded over its data-parallel ranks (by
our engine, or by torch's `fully_shard` with parallelism.engine=torch) and split by tensor (and
sequence) parallelism inside.

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
and the weight gradient (W, run later to fill bubbles). torch's own split finds the weights by
the stage's `parameters()`, which on our engine are the shard pieces, not the gathered tensors
the forward used, and it stores weight gradients itself, past autograd's accumulation and so past
the engine's gradient hooks. `EngineStage` splits them itself (`backward_input`,
`backward_weight`): from the stage's outputs it walks the autograd graph, finds every weight
(a leaf that is not a stage input) and, for each, the nodes where its gradient joins the path to
the inputs (weights sharing such a node are one group). I asks autograd for the inputs'
gradients only, and a pre-hook on those nodes keeps the gradients that reach them; W starts
autograd at the kept gradients, one call per group (one for all of them under activation
checkpointing, which each stage's blocks get as `parallelize` gives them: each call recomputes
the blocks it passes through), and accumulates into the group's weights
(a group with several such nodes holds each at its kept gradient, so nothing counts twice). A
stage output computed from weights alone (or a weight returned as it is) is a boundary too, with
the output's gradient; where the stage also uses it, its gradient from that use arrives in W and
adds to the output's (it is not held), and the input half leaves such outputs attached. So
I stores no weight gradient and fires none of the engine's gradient hooks (only its pre-backward
hooks, which gather; the final callback after it reduces nothing that is not there), and W does
the weights' work (a matmul's weight gradient) and fires the post-accumulate-grad hooks that
drive the reductions. The W calls of one microbatch are one backward of the stage's engine
(`backward_in_parts`, [Note: one backward in several autograd calls] in fsdp/context.py): the
units a forward freed since are gathered first (so m + 1 gathers per unit and step still, every
gather following a forward), and the final callback runs once after them. The step's m-th W (or
whole backward, on the first stage, whose inputs need no gradient: its I is empty and its W is
its backward) is the synced one: gradients reduce-scatter once per stage and step. The bubble:
framework/config/pipeline.py, `bubble_fraction`; measured: bench/pipeline_bubble.py.

[Note: tied embeddings in a pipeline]
A model whose output head is its token embedding (model.args.tie_embeddings, a Hugging Face
config's tie_word_embeddings) uses the one matrix on the first stage (the lookup) and on the last
(the head). Both stages hold both modules, as the whole model does (the family's stage does it),
so each of the two ranks has a copy of the parameter under the whole model's names: its state dict
and its optimizer state are the whole model's (the optimizer's under the embedding's name, the
first the model yields), the two ranks write the same pieces, and checkpoints move to and from a
model without a pipeline. The copies start equal (every rank builds the model from one seed; built
on the meta device, each rank draws its own values, and the first pass broadcasts the first
stage's copy to the last's) and stay equal: after the step's backward each holds the gradient of
its own use, and one all-reduce between the two ranks (per data- and tensor-parallel place: the pp
group itself at pp=2) gives both the sum, the whole model's gradient, before clipping and the
optimizer step, which then move both alike. The two modules are one sharding unit (a group: the
one the stage does not call is gathered with the other and gets no gradient of its own), whose
pieces say they have 2 copies, so the gradient norm counts the matrix once. A schedule that puts
the first and the last stage on one rank (zbv's V) would need two stages, each a root of its own,
to share the unit: refused.

[Note: sequence parallel inside stages]
Under sequence parallelism (parallelism.sequence_parallel, with tp) the family's plan leaves the
residual stream between blocks sharded on the sequence: the embedding's output is reduce-scattered
to each tp rank's piece of the sequence, every block takes and returns that piece, and the head
gathers it back. A stage boundary is between two blocks, so the hidden states go between stages
as they are: each tp rank sends its piece to the next stage's rank at the same tp place (the pp
group is per tp place), 1/tp of the whole, and the next stage's first block takes it as its plan
expects. The stages' static shapes say so (`example_io`'s `hidden_seq`: the piece's length as a
Shard(1) DTensor cuts the sequence, ceil(seq/tp) on the first ranks); the last stage's logits stay
whole in the sequence (split on the vocabulary), as without a pipeline.

[Note: torch's fully_shard under torch's schedules]
With parallelism.engine=torch each stage's units and the stage (its root) are sharded by torch's
`fully_shard` over the same data-parallel mesh, and the stage is torch's own `PipelineStage`,
which drives FSDP2 itself: no gradient synchronisation in the microbatches' backwards, then one
reduce-scatter per stage and step after the last (`perform_reduce_grad`). Its gradient norm is
torch's over DTensors, which covers the rank's own stages: the engine's clip adds the squares
over the pp group (`norm_group`) and counts a tied matrix once (`norm_copies`).

The loss of each microbatch is the task's mean over its labelled positions divided by the
number of microbatches (scale_grads=False), as gradient accumulation divides it; the last stage
sums them and one all-reduce over the pp group gives every rank the step's loss.

[Note: a stage's own loss through the schedule]
A stage whose loss is not the task's cross-entropy of each row (stage=dpo's: a pair's chosen and
rejected sequences, compared with a reference model's) hands `train_batches` and `eval_total` a
`RowsLoss` (framework/steps.py): `rows(batches, microbatches)` lays the step's batches out as the
stages' rows, in the order the schedule cuts them into `microbatches` equal chunks (so a pair's
two sequences share a microbatch), and keeps what its microbatch losses need (the labels; the
reference's log-probabilities, from a forward-only pass of the reference's own stages,
`forward_rows`: every rank of the pipeline calls `rows`); the schedule's target is then each row's
index, so the last stage's loss of a microbatch, `loss(output, rows)`, reads its rows' labels by
index and depends on no order in which the schedule computes its microbatches. That loss is the
microbatch's mean, divided here by the number of microbatches as the task's is. The gradient
norm needs no pipeline step on our engine: its norm sums every rank's pieces over the world, each
divided by its number of copies ([Note: pieces that describe themselves]), which covers every
stage once (torch's: [Note: torch's fully_shard under torch's schedules]).
"""

from __future__ import annotations

import collections
import functools
from typing import Dict, List, NamedTuple, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from framework.config.pipeline import PipelineSchedule, balanced_split, even_split, virtual_stages
from framework.config.schema import ActivationCheckpointing
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
        # What a gradient norm over DTensors (torch's fully_shard) needs besides its meshes: the
        # group holding the other stages (set by the pipeline) and the parameters held by another
        # rank of it too ([Note: tied embeddings in a pipeline]), id -> copies. Our engine's
        # pieces say both themselves.
        self.__dict__["norm_group"] = None
        self.__dict__["norm_copies"] = {}

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


class _WeightHalf(NamedTuple):
    """What a microbatch's input-gradient pass leaves for its weight-gradient pass: per group of
    weights, the graph nodes its gradients come through, the gradients that reached them there
    (one per node output, None where none did), the weights (leaf tensors) and which of the nodes
    are open (stage outputs off the input path, whose own gradient adds to what arrives from the
    group's other nodes)."""

    groups: List[tuple]  # (nodes, their gradients, weights, open nodes), in graph order from the outputs


def _edge_node(t: torch.Tensor):
    return torch.autograd.graph.get_gradient_edge(t).node


def _split(roots: list, input_nodes: list) -> Tuple[List[tuple], set]:
    """The stage graph's weights grouped by where their gradients join the input path: [Note:
    zero-bubble schedules on our engine]. Returns (boundary nodes, weights, open nodes) per group,
    the lists in breadth-first order from `roots` (the same on every rank of a tensor-parallel
    group, whose weight passes must issue their collectives alike).

    A boundary is a node on the input path (its gradient, whole, is known after the input half) or
    a stage output off the input path (a weight's own AccumulateGrad node included, where the stage
    returns the weight). Such an output is open: its gradient is the output's plus whatever the
    stage's later use of it sends back, so the walk goes on past it and the weight half adds the two
    rather than holding it at the output's gradient alone.

    Also returns the roots that the stage uses itself or that are boundaries: their outputs may be
    saved for the weight half's backward, so the input half must not detach them in place."""
    consumers: Dict = {}  # node -> the nodes whose backward feeds it (towards the outputs)
    order, seen = [], set(roots)
    queue = collections.deque(roots)
    while queue:
        node = queue.popleft()
        order.append(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            consumers.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
    on_input_path = set()  # nodes whose backward reaches a stage input
    stack = [n for n in input_nodes if n in seen]
    while stack:
        node = stack.pop()
        if node not in on_input_path:
            on_input_path.add(node)
            stack.extend(consumers.get(node, ()))
    inputs = set(input_nodes)
    rank = {node: i for i, node in enumerate(order)}
    open_nodes = set(roots) - on_input_path  # outputs off the input path (every node above none is one)
    per_weight = []  # (weight, the nodes its gradient joins the input path at, or an output)
    for weight in (n for n in order if hasattr(n, "variable") and n not in inputs):  # AccumulateGrad
        bounds, walk, visited = [], [weight], {weight}
        while walk:
            node = walk.pop()
            if node is not weight and node in on_input_path:
                bounds.append(node)
                continue
            if node in open_nodes:
                bounds.append(node)  # and on: the stage may use the output too
            for up in consumers.get(node, ()):
                if up not in visited:
                    visited.add(up)
                    walk.append(up)
        per_weight.append((weight, bounds))
    parent: Dict = {}  # weights that share a boundary node are one group (union-find on the nodes)

    def find(node):
        while parent[node] is not node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for _, bounds in per_weight:
        for b in bounds:
            parent.setdefault(b, b)
        for b in bounds[1:]:
            parent[find(b)] = find(bounds[0])
    grouped: Dict = {}
    for weight, bounds in per_weight:
        group = grouped.setdefault(find(bounds[0]), (set(), []))
        group[0].update(bounds)
        group[1].append(weight)  # in graph order: `order` is
    groups = [(sorted(b, key=rank.__getitem__), w, b & open_nodes) for b, w in grouped.values()]
    bounds = set().union(*(b for b, _ in grouped.values()))
    needed = {r for r in roots if r in bounds or r in consumers}
    return sorted(groups, key=lambda g: rank[g[0][0]]), needed


def backward_input(outputs: tuple, output_grads, inputs: list) -> tuple:
    """The input half of a stage's backward: the gradients of `inputs` (None for those that need
    none) and the `_WeightHalf` the weight half computes from. The weights' gradients are not
    computed; the gradients reaching the nodes where they join the input path are kept."""
    outs, grads = [], []
    for i, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            outs.append(out)
            grads.append(torch.ones_like(out) if output_grads is None else output_grads[i])
    wanted = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    edges = [torch.autograd.graph.get_gradient_edge(t) for t in outs]
    groups, needed = _split([e.node for e in edges], [_edge_node(t) for t in wanted])
    kept: Dict = {}  # boundary node -> {its output's index: the gradient that reached it}
    for e, g in zip(edges, grads):  # an open boundary keeps the output's own gradient
        kept.setdefault(e.node, {})[e.output_nr] = g
    handles = []

    def keep(node):
        def hook(grad_outputs):
            kept[node] = {i: g for i, g in enumerate(grad_outputs) if g is not None}

        return hook

    try:
        for bounds, _, open_nodes in groups:
            for node in bounds:
                if node not in open_nodes:  # off the input path: this pass never reaches it
                    handles.append(node.register_prehook(keep(node)))
        found = torch.autograd.grad(outs, wanted, grads, retain_graph=True, allow_unused=True) if wanted else ()
    finally:
        for h in handles:
            h.remove()
    for out, e in zip(outs, edges):  # the graph above the boundaries is no longer needed
        if e.node not in needed and not out._is_view():  # (a returned weight is a boundary)
            out.detach_()
    got = iter(found)
    dinputs = tuple(next(got) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs)
    return dinputs, _WeightHalf([(b, [kept.get(n) for n in b], w, o) for b, w, o in groups])


def _held(kept: dict, grad_outputs: tuple) -> tuple:
    return tuple(kept.get(i) for i in range(len(grad_outputs)))


def backward_weight(half: _WeightHalf, together: bool = False) -> None:
    """The weight half: each group's gradients from the kept ones at its boundary nodes into its
    weights, through autograd's accumulation (so the engine's gradient hooks run as in any
    backward). A group with several boundary nodes holds each at its kept gradients, so a path
    from one to another counts nothing twice; an open one is not held (its kept gradient is the
    output's alone, to which the paths into it add).

    `together`: every group in one autograd call, each boundary node held (open ones excepted).
    Under activation checkpointing each call recomputes the checkpointed blocks it passes through
    (the recomputation lives for one call), so one call per group would recompute a block once per
    group of its weights; one call recomputes it once. The holds make the groups independent: a
    path from one group's boundary into another group reaches that group's own boundary first."""
    calls = [half.groups] if together else [[g] for g in half.groups]
    for groups in calls:
        edges, grads, weights, handles = [], [], [], []
        for bounds, kept, group_weights, open_nodes in groups:
            for node, gs in zip(bounds, kept):
                for i, g in (gs or {}).items():
                    edges.append(torch.autograd.graph.GradientEdge(node, i))
                    grads.append(g)
            weights += [w.variable for w in group_weights]
            if len(bounds) > 1 or together:
                handles += [(node, gs) for node, gs in zip(bounds, kept) if node not in open_nodes]
        if not edges:
            continue
        handles = [node.register_prehook(functools.partial(_held, gs or {})) for node, gs in handles]
        try:
            torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)
        finally:
            for h in handles:
                h.remove()


class EngineStage(PipelineStage):
    """A `PipelineStage` whose module our engine sharded: [Note: our engine under torch's
    schedules], and [Note: zero-bubble schedules on our engine] for the input and weight halves."""

    def __init__(self, *args, n_microbatches: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.n_microbatches, self.backwards = n_microbatches, 0
        self.weight_passes = 0  # weight halves run this step (tests read it)
        self.weight_in_one_call = False  # under activation checkpointing: see `backward_weight`

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if backward_type == "input":  # never the step's last: its weight half follows
            self.submod.set_requires_gradient_sync(False)
            self.submod.set_reshard_after_backward(False)
            return backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        self.backwards += 1  # a whole backward or a weight half: the m-th reduces
        last = self.backwards == self.n_microbatches
        self.submod.set_requires_gradient_sync(last)
        self.submod.set_reshard_after_backward(last)  # the next microbatch's forward finds them gathered
        if backward_type == "weight":
            self.weight_passes += 1
            with self.submod.backward_in_parts():
                backward_weight(bwd_kwargs["param_groups"], together=self.weight_in_one_call)
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)


class TorchShardedStage(PipelineStage):
    """A `PipelineStage` whose module torch's `fully_shard` sharded: [Note: torch's fully_shard
    under torch's schedules]. torch drives FSDP2 (no sync until its `perform_reduce_grad`); the
    zero-bubble halves are ours, as `EngineStage`'s: torch's own weight half looks for the weights
    among the stage's (sharded) parameters, not the gathered ones the forward used."""

    weight_in_one_call = False  # under activation checkpointing: see `backward_weight`

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if backward_type == "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        self.submod.set_is_last_backward(False)
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(False)
        if backward_type == "input":
            return backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        backward_weight(bwd_kwargs["param_groups"], together=self.weight_in_one_call)
        return (), None


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


class Pipeline:
    def __init__(
        self, model: nn.Module, dims: ParallelDims, mesh, cfg, family, device, accum_steps: int, task, loss_fn
    ):
        """`task`: the model's task (causal_lm only for now); `loss_fn(logits, labels)`: its mean
        loss over a microbatch's labelled positions (the trainer passes the task's cross-entropy)."""
        p, t = cfg.parallelism, cfg.trainer
        self.loss_fn = loss_fn
        if cfg.stage.value not in ("training", "fine_tuning", "dpo", "grpo") or task.name != "causal_lm":
            raise UserInputError(
                f"parallelism.pp={dims.pp} with stage={cfg.stage.value} and model.task={task.name}: pipelines train "
                "causal language models (pre-training, fine-tuning, preference pairs, GRPO) only for now; set "
                "parallelism.pp=1"
            )
        # rows a sample is in the stages: a preference pair is its chosen and its rejected sequence, a
        # GRPO prompt its grpo.num_generations completions
        self.rows_per_sample = {"dpo": 2, "grpo": cfg.grpo.num_generations}.get(cfg.stage.value, 1)
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
        # [Note: sequence parallel inside stages]: the tp degree and rank that cut the hidden states
        sp = p.sequence_parallel and dims.tp > 1
        self.sp_degree, self.sp_rank = (dims.tp, mesh.get_local_rank("tp")) if sp else (1, 0)
        self.pp_group = mesh["pp"].get_group()
        mine = stages_of_rank(self.pp_rank, dims.pp, v, self.schedule_name)
        if p.float8:  # the whole model before the cut, as `parallelize` converts it ([Note: float8 training])
            from framework.distributed.engines import engine_of
            from framework.distributed.float8 import apply_float8

            apply_float8(model, p, mesh.device_type, torchao_gathers=engine_of(p.engine).float8_gather_by_torchao)
        modules = [family.pipeline_stage(model, *ranges[s], s == 0, s == n_stages - 1) for s in mine]
        if meta and not all(hasattr(m, "materialize") for m in modules):
            raise UserInputError(
                f"parallelism.pp={dims.pp} with model.meta_init (the model built on the meta device) and "
                f"model.name={cfg.model.name}: its stages cannot be materialised yet; set model.meta_init=false "
                "or parallelism.pp=1"
            )
        packed = cfg.stage.value == "fine_tuning" and cfg.finetune.packing
        if packed and not all(getattr(m, "takes_documents", False) for m in modules):
            raise UserInputError(
                f"parallelism.pp={dims.pp} with stage=fine_tuning, finetune.packing=true and "
                f"model.name={cfg.model.name}: its stages do not keep attention inside packed documents yet; "
                "set finetune.packing=false or parallelism.pp=1"
            )
        self.model = PipelinePart(modules)
        self.model.norm_group = self.pp_group
        for module in modules:  # [Note: the load-balancing loss in a pipeline] (a family's stage may keep one)
            if hasattr(module, "aux_scale"):
                module.aux_scale = 1.0 / self.microbatches
        self.mine = dict(zip(mine, modules))  # stage index -> this rank's module of it
        self.owner = {s: r for r in range(dims.pp) for s in stages_of_rank(r, dims.pp, v, self.schedule_name)}
        self.n_stages, self.dtype = n_stages, _DTYPES[p.param_dtype]
        self.holds_first, self.holds_last = 0 in mine, n_stages - 1 in mine
        tied = _tied_names(model)  # [Note: tied embeddings in a pipeline]
        if tied and self.owner[0] == self.owner[n_stages - 1]:
            raise UserInputError(
                f"parallelism.pp_schedule={self.schedule_name.value} with model.args.tie_embeddings=true (or a "
                "Hugging Face config's tie_word_embeddings): the first and the last stage share a rank, whose two "
                "stages would share one sharded parameter; choose pp_schedule=1f1b, gpipe or interleaved_1f1b"
            )
        self.tied, self.tied_group, self.tied_synced = [], None, False
        if tied and (self.holds_first or self.holds_last):
            self.tied = [n for n, _ in self.model.named_parameters() if any(n in names for names in tied)]
        if tied:
            self.tied_group = _pair_group(mesh, self.pp_group, self.owner[0], self.owner[n_stages - 1])
        self._shard(dims, mesh, p, family, family.activation_checkpoint_targets(model))
        if meta:  # this rank's stages only: the other ranks' layers stay on the meta device
            self.model.to_empty(device=device)
            for module in modules:
                module.materialize()  # what the model's init does not fill (the rotary table)
        dtype = _DTYPES[p.param_dtype]
        mb = self.rows_per_sample * self.samples // self.microbatches
        self.stages = []
        for index, module in zip(mine, modules):
            hidden = self._hidden_length(cfg.data.seq_len)  # [Note: sequence parallel inside stages]
            x, y = module.example_io(mb, cfg.data.seq_len, dtype, tp=dims.tp, hidden_seq=hidden)
            # what needs a gradient: the hidden states between stages (not the tokens), every output
            x.requires_grad_(x.is_floating_point())
            y.requires_grad_(True)
            # [Note: torch's fully_shard under torch's schedules]: its stage drives FSDP2 itself
            torch_sharded = isinstance(module, TorchFSDPModule)
            stage_class = (
                TorchShardedStage if torch_sharded else functools.partial(EngineStage, n_microbatches=self.microbatches)
            )
            self.stages.append(
                stage_class(module, index, n_stages, device, input_args=x, output_args=y, group=self.pp_group)
            )
            self.stages[-1].weight_in_one_call = p.activation_checkpointing != ActivationCheckpointing.none
        schedule_class = _SCHEDULES[self.schedule_name]
        stages = self.stages if v > 1 else self.stages[0]
        self.losses: List[torch.Tensor] = []
        self._microbatch_loss = loss_fn  # a RowsLoss for one step: [Note: a stage's own loss through the schedule]
        self.schedule = schedule_class(stages, self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _hidden_length(self, seq: int) -> int:
        """The length of the hidden states this rank sends and receives between stages for
        sequences of `seq` tokens: [Note: sequence parallel inside stages]."""
        if self.sp_degree == 1:
            return seq
        pieces = torch.arange(seq).chunk(self.sp_degree)  # how a Shard(1) DTensor cuts it
        return len(pieces[self.sp_rank]) if self.sp_rank < len(pieces) else 0

    def _shard(self, dims, mesh, p, family, checkpointed: list) -> None:
        """Tensor parallel over this rank's part, then activation checkpointing of the model's
        targets (`checkpointed`, all of them: selective picks by the block's index in the whole
        model; the ones on other ranks' stages never run here), then our engine: every block, the
        embedding and the norm with the head as units, each stage a root (no parameters of its
        own). The order `parallelize` applies them in."""
        from framework.distributed.parallelize import apply_activation_checkpointing, shard_kwargs

        part = self.model
        if dims.tp_enabled:
            from framework.distributed.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(part, mesh["tp"], p, _stage_plans(family.tp_plan))
        expert_mesh = None
        if dims.ep > 1:  # this rank's stages' experts, split over ep ranks of its pp index
            from framework.distributed.expert_parallel import apply_expert_parallel

            _, expert_mesh = apply_expert_parallel(
                part, dims.ep, dims.efsdp, mesh.device_type, dp_replicate=dims.dp_replicate, tp=dims.tp, pp=dims.pp
            )
        if p.activation_checkpointing != ActivationCheckpointing.none:
            apply_activation_checkpointing(checkpointed, p.activation_checkpointing)
        fully_shard, kwargs = shard_kwargs(mesh, dims, p)
        reshard = p.strategy.value != "grad_op"
        if expert_mesh is not None:  # their own units, over the ranks holding them, before their
            # blocks', and on every rank before any dense unit: the engine's first unit on a mesh
            # gathers that mesh's rows from the world, so all ranks meet the two meshes in one order.
            from framework.distributed.expert_parallel import expert_groups

            for experts in expert_groups(part):
                fully_shard(experts, reshard_after_forward=reshard, **{**kwargs, "mesh": expert_mesh})
                experts.set_gradient_divide_factor(dims.dp)
                if dims.tp > 1:  # whole on every tp rank, as without a pipeline
                    experts.set_norm_copies(dims.tp)
        tied = {id(p) for _, p in _shared_parameters(part)}  # [Note: tied embeddings in a pipeline]
        for stage in part.stages:
            units = _units_of(stage)
            group = [u for u in units if any(id(p) in tied for p in u.parameters())]  # the embedding and head
            for unit in units:
                if unit not in group:
                    fully_shard(unit, reshard_after_forward=reshard, **kwargs)
            if group:  # one unit (a parameter belongs to one), on the first and the last stage's ranks
                fully_shard(group, reshard_after_forward=reshard, **kwargs)
                if hasattr(group[0], "set_norm_copies"):  # our engine's pieces say it
                    group[0].set_norm_copies(2)
                else:  # torch's: its clip reads the part's (framework/distributed/engines.py)
                    part.norm_copies.update({id(p): 2 for m in group for p in m.parameters()})
            fully_shard(stage, reshard_after_forward=reshard, **kwargs)

    def _loss(self, logits, labels) -> torch.Tensor:
        return self._microbatch_loss(logits, labels) / self.microbatches

    def _schedule_inputs(self, batches: list, loss, losses: list) -> tuple:
        """(args, kwargs) of a schedule step over `batches`: the task's rows and labels, or a
        `RowsLoss`'s rows and their indices ([Note: a stage's own loss through the schedule]); the
        microbatch loss set to match."""
        if loss is None:
            inputs, labels, packed = _joined(batches)
            self._microbatch_loss = self.loss_fn
        else:
            inputs, packed = loss.rows(batches, self.microbatches), {}
            labels = torch.arange(inputs.shape[0], device=inputs.device)
            self._microbatch_loss = loss
        args = (inputs,) if self.holds_first else ()
        kwargs = {"target": labels, "losses": losses} if self.holds_last else {}
        return args, {**kwargs, **packed}, inputs.device

    def train_batches(self, batches: list, loss=None) -> torch.Tensor:
        """Forward and backward of one optimizer step's batches ((inputs, labels) pairs, this
        data-parallel rank's); returns the step's loss on every rank (a 0-d tensor). `loss`: a
        stage's own (a `RowsLoss`), else the task's."""
        from framework.distributed.tensor_parallel import full, loss_context

        losses: List[torch.Tensor] = []
        args, kwargs, device = self._schedule_inputs(batches, loss, losses)
        self._tie_once()
        for stage in self.stages:
            stage.backwards = 0
        self._clear_aux()
        with loss_context(self.model):
            self.schedule.step(*args, **kwargs)
        self._sum_tied_grads()
        total = torch.zeros((), device=device)
        for part in losses:
            total += full(part.detach()).float()
        total += self._clear_aux().to(total.device)  # each stage's load-balancing losses, already / microbatches
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds the losses
        return total

    @torch.no_grad()
    def _tie_once(self) -> None:
        """Before the first pass: the last stage's copy of a tied matrix made the first stage's
        (broadcast over the pair). A model built on the meta device draws each rank's values with
        its own seed, so the two copies start apart; built whole, or loaded, they are equal already."""
        if self.tied_synced:
            return
        self.tied_synced = True
        if not self.tied:
            return
        params = dict(self.model.named_parameters())
        src = dist.get_global_rank(self.pp_group, self.owner[0])
        for name in self.tied:
            data = params[name].to_local() if hasattr(params[name], "to_local") else params[name]
            dist.broadcast(data.detach(), src=src, group=self.tied_group)

    def _sum_tied_grads(self) -> None:
        """[Note: tied embeddings in a pipeline]: the tied parameter's gradient summed over the
        first and the last stage's ranks, on both (the pieces of one data-parallel place match)."""
        if not self.tied:
            return
        params = dict(self.model.named_parameters())
        for name in self.tied:
            grad = params[name].grad
            if grad is not None:  # None on both ranks alike (a frozen embedding)
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                dist.all_reduce(local, group=self.tied_group)

    def _clear_aux(self) -> torch.Tensor:
        """The sum of this rank's stages' load-balancing losses since the last call ([Note: the
        load-balancing loss in a pipeline] in the family's stage), each already / microbatches."""
        total = torch.zeros(())
        for module in self.model.stages:
            for aux in getattr(module, "aux_losses", ()):
                total = total.to(aux.device) + aux.float()
            if hasattr(module, "aux_losses"):
                module.aux_losses = []
        return total

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole model's logits (float32, whole over tensor parallel) of `tokens` (batch x any
        length, the same on every rank), on every rank: outside the schedule (whose shapes are a
        training step's), each stage in turn on its rank, the hidden states sent to the next
        stage's rank at the same data- and tensor-parallel place, the logits broadcast over the
        pipeline from the last stage's. Every rank of the pipeline calls it together."""
        from framework.distributed.tensor_parallel import full

        peer = lambda r: dist.get_global_rank(self.pp_group, r)  # noqa: E731
        h = self._walk(tokens)
        last = self.owner[self.n_stages - 1]
        shape = torch.tensor(full(h).shape if last == self.pp_rank else (0, 0, 0), device=tokens.device)
        dist.broadcast(shape, src=peer(last), group=self.pp_group)
        out = (
            full(h).float().contiguous() if last == self.pp_rank else torch.empty(*shape.tolist(), device=tokens.device)
        )
        dist.broadcast(out, src=peer(last), group=self.pp_group)
        return out

    def _walk(self, tokens: torch.Tensor):
        """Each stage in turn on its rank, outside the schedule: the last stage's output on its
        rank (vocabulary-sharded under tensor parallel), `tokens` elsewhere."""
        from framework.distributed.tensor_parallel import loss_context

        self._tie_once()
        peer = lambda r: dist.get_global_rank(self.pp_group, r)  # noqa: E731
        h = tokens
        for stage in range(self.n_stages):
            here, after = self.owner[stage], self.owner.get(stage + 1)
            if here == self.pp_rank:
                with loss_context(self.model):
                    h = self.mine[stage](h)
                if after is not None and after != here:
                    dist.send(h.detach().to(self.dtype).contiguous(), dst=peer(after), group=self.pp_group)
            elif after == self.pp_rank:
                rows, length = tokens.shape
                h = torch.empty(
                    rows, self._hidden_length(length), self.mine[stage + 1].dim, dtype=self.dtype, device=tokens.device
                )
                dist.recv(h, src=peer(here), group=self.pp_group)
        return h

    @torch.no_grad()
    def forward_rows(self, inputs: torch.Tensor, on_output) -> None:
        """A forward-only pass of `inputs` (the stages' rows, the same on every rank of the
        pipeline) that calls `on_output(output, rows)` on the last stage's rank with the output of
        the rows whose indices are `rows` (a reference model's log-probabilities: [Note: a stage's
        own loss through the schedule]). Through the schedule's forward-only step, microbatch by
        microbatch; zbv's schedule has none, so there the stages run in turn over all the rows."""
        from framework.distributed.tensor_parallel import loss_context

        if self.schedule_name == PipelineSchedule.zbv:
            out = self._walk(inputs)
            if self.holds_last:
                with loss_context(self.model):
                    on_output(out, torch.arange(inputs.shape[0], device=inputs.device))
            return

        def loss(output, rows):
            on_output(output, rows)
            return torch.zeros((), device=inputs.device)

        self._microbatch_loss = loss
        args = (inputs,) if self.holds_first else ()
        kwargs = {"target": torch.arange(inputs.shape[0], device=inputs.device), "losses": []}
        with loss_context(self.model):
            self.schedule.eval(*args, **(kwargs if self.holds_last else {}))

    @torch.no_grad()
    def eval_total(self, batches: list, per_step: int, loss=None) -> torch.Tensor:
        """The sum of the batches' mean losses, without backward, on every rank of the pipeline;
        `per_step` batches (a training step's worth, the stages' static shapes) per schedule pass.
        `loss`: a stage's own (a `RowsLoss`), else the task's."""
        from framework.distributed.tensor_parallel import full, loss_context

        total = None
        self._tie_once()
        self._clear_aux()
        for start in range(0, len(batches), per_step):
            group = batches[start : start + per_step]
            losses: List[torch.Tensor] = []
            args, kwargs, device = self._schedule_inputs(group, loss, losses)
            total = torch.zeros((), device=device) if total is None else total
            with loss_context(self.model):
                self.schedule.eval(*args, **kwargs)
            for part in losses:  # each the microbatch's mean / microbatches: the group's mean
                total += full(part.detach()).float() * len(group)
            total += self._clear_aux().to(total.device) * len(group)  # the experts', scaled alike
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank holds the losses
        return total


def _shared_parameters(model: nn.Module) -> List[tuple]:
    """(name, parameter) of every parameter `model` holds under more than one name."""
    names: Dict[int, List[str]] = {}
    params = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [(n, params[i]) for i, ns in names.items() if len(ns) > 1 for n in ns]


def _tied_names(model: nn.Module) -> List[set]:
    """The groups of names of the whole model's tied parameters (the embedding and the head)."""
    groups: Dict[int, set] = {}
    for name, param in _shared_parameters(model):
        groups.setdefault(id(param), set()).add(name)
    return list(groups.values())


def _pair_group(mesh, pp_group, first: int, last: int):
    """The process group of this rank's first- and last-stage ranks (same data- and tensor-parallel
    place): the pp group when it is just those two, else one group per place, made by every rank
    (a new group is a collective of the world); None on a rank in neither."""
    if mesh["pp"].size() == 2:
        return pp_group
    ranks = mesh.mesh
    pp_dim = mesh.mesh_dim_names.index("pp")
    rows = ranks.movedim(pp_dim, -1).reshape(-1, ranks.shape[pp_dim]).tolist()
    mine = None
    for row in rows:
        pair = [row[first], row[last]]
        group = dist.new_group(pair)
        if dist.get_rank() in pair:
            mine = group
    return mine


def _joined(batches: list) -> tuple:
    """(inputs, labels, what every stage takes besides) of a step's batches joined along the rows:
    (inputs, labels) pairs, or fine-tuning's dicts, whose packed rows carry each token's position
    in its document and the document's id. Every rank passes those to its stages (the schedule
    cuts them into microbatches as it cuts the inputs): each stage builds its rotary angles and
    attention mask from them, as the whole model's forward does."""
    if not isinstance(batches[0], dict):
        return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]), {}
    packed = {k: torch.cat([b[k] for b in batches]) for k in ("positions", "document_ids") if k in batches[0]}
    return torch.cat([b["input_ids"] for b in batches]), torch.cat([b["labels"] for b in batches]), packed


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
