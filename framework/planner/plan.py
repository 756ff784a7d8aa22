"""The plan of one job: from the typed config to the estimate, the verdict and the advice.

    python main.py stage=plan model=llama_70b cluster.nodes=16 cluster.nproc_per_node=8 cluster.gpus_per_node=8

`make_plan(cfg)` is pure (no torch, nothing allocated); `run_plan` prints it and writes plan.json
into the run directory; the launcher calls `fit_problems` before it writes a job.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from framework.config.schema import Config
from framework.config.validate import parallel_dims_of
from framework.errors import EXIT_BAD_INPUT
from framework.fileio import write_json
from framework.models.families import plan_shape
from framework.planner.devices import DEVICES, device_for
from framework.planner.estimate import (
    GIB,
    Job,
    Memory,
    Timing,
    Traffic,
    layouts,
    memory,
    muon_work,
    timing,
    total_params,
    traffic,
)


def job_from_config(cfg: Config, world_size: int | None = None) -> Job:
    """The job `cfg` describes; raises ValueError (naming the field) when the mesh cannot be built."""
    c, p, t, m = cfg.cluster, cfg.parallelism, cfg.trainer, cfg.model
    world = world_size or c.nodes * c.nproc_per_node
    dims = parallel_dims_of(cfg, world)
    t.fit_micro_batch(dims.dp)
    key = device_for(getattr(c, "gpu_type", "auto"), c.gpus_per_node)
    if key not in DEVICES:
        raise ValueError(f"cluster.gpu_type={key!r}: unknown; choose auto, {', '.join(DEVICES)}")
    # the family's own units and widths (framework/models/families.py); the data's vocabulary (the
    # tokenizer data preparation trains has this size) where the model takes it from the data
    shape = plan_shape(m, cfg.data.vocab_size)
    return Job(
        model=shape,
        seq_len=cfg.data.seq_len,
        micro_batch=t.micro_batch_size,
        global_batch=t.global_batch_size,
        strategy=p.strategy.value,
        dp_replicate=dims.dp_replicate,
        dp_shard=dims.dp_shard,
        tp=dims.tp,
        ep=dims.ep,
        cp=dims.cp,
        nodes=c.nodes,
        nproc_per_node=c.nproc_per_node,
        device=DEVICES[key],
        device_key=key,
        param_dtype=p.param_dtype,
        reduce_dtype=p.reduce_dtype,
        optimizer=cfg.optimizer.name.value,
        state_dtype=cfg.optimizer.state_dtype,
        momentum=cfg.optimizer.momentum,
        offload=p.cpu_offload,
        quantized=p.quantized_comm,
        shard_boundary=p.shard_boundary.value,
        activation_checkpointing=p.activation_checkpointing.value,
        sequence_parallel=p.sequence_parallel,
        # gloo's reduce-scatter needs receive scratch; a shard group on one host uses shared memory
        gloo=key == "cpu" and (p.host_transport.value == "gloo" or dims.dp_shard * dims.tp > c.nproc_per_node),
        host_shm=key == "cpu" and p.engine.value == "native" and p.host_transport.value == "shm",
        memory_gib=float(getattr(c, "gpu_memory_gib", 0.0) or 0.0),
        peak_tflops=t.peak_tflops,
    )


@dataclass
class Estimate:
    job: Job
    memory: Memory
    traffic: Traffic
    timing: Timing

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.job.budget_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        per_node = self.memory.host * min(self.job.nproc_per_node, self.job.world)
        return per_node <= self.job.device.host_memory_gib * GIB


def estimate(job: Job) -> Estimate:
    tr = traffic(job)
    return Estimate(job, memory(job), tr, timing(job, tr))


@dataclass
class Change:
    overrides: list[str]  # what to add to the command line
    why: str
    estimate: Estimate


@dataclass
class PlanResult:
    estimate: Estimate
    changes: list[Change] = field(default_factory=list)  # when it does not fit: ones that do
    notes: list[str] = field(default_factory=list)


def _ranks_options(job: Job) -> list[tuple[int, int]]:
    """(nodes, ranks per node) with more ranks, smallest first."""
    per_node = job.nproc_per_node
    gpus = 8 if job.device_key != "cpu" else per_node
    out = []
    if per_node < gpus:
        out.append((job.nodes, gpus))
        per_node = gpus
    nodes = job.nodes
    while nodes < 4096:
        nodes *= 2
        out.append((nodes, per_node))
    return out


def _with_world(job: Job, nodes: int, per_node: int) -> Job:
    world = nodes * per_node
    if job.strategy == "hybrid":
        shard = max(1, per_node // job.tp)
        return replace(
            job, nodes=nodes, nproc_per_node=per_node, dp_shard=shard, dp_replicate=world // (shard * job.tp)
        )
    if job.strategy == "no_shard":
        return replace(job, nodes=nodes, nproc_per_node=per_node, dp_replicate=world // job.tp)
    return replace(job, nodes=nodes, nproc_per_node=per_node, dp_shard=world // (job.tp * job.cp * job.dp_replicate))


def _tp_ok(job: Job, tp: int) -> bool:
    m = job.model
    world = job.world
    return (
        m.tensor_parallel
        and tp <= job.nproc_per_node
        and world % tp == 0
        and m.n_heads % tp == 0
        and m.n_kv_heads % tp == 0
        and m.dim % tp == 0
        and m.ffn_dim % tp == 0
    )


def _degrees_take(job: Job, **change: int) -> bool:
    """The mesh accepts `job`'s degrees with `change` (framework/config/degrees.py decides)."""
    from framework.config.degrees import ParallelDims
    from framework.errors import UserInputError

    d = dict(dp_replicate=job.dp_replicate, dp_shard=job.dp_shard, tp=job.tp, ep=job.ep, cp=job.cp)
    d.update(change)
    try:
        ParallelDims(world_size=job.world, **d)
    except UserInputError:
        return False
    return True


def _candidates(job: Job) -> list[tuple[str, list[tuple[list[str], str, Job]]]]:
    """Families of changes, each a list of settings from the smallest change up."""
    fams: list[tuple[str, list[tuple[list[str], str, Job]]]] = []
    if job.strategy in ("no_shard", "grad_op", "hybrid"):
        full = replace(job, strategy="full", dp_shard=job.dp, dp_replicate=1)
        fams.append(
            (
                "shard",
                [
                    (
                        ["parallelism.strategy=full", "parallelism.dp_replicate=1", "parallelism.dp_shard=-1"],
                        "shard everything over all data-parallel ranks (ZeRO-3)",
                        full,
                    )
                ],
            )
        )
    if job.activation_checkpointing != "full":
        fams.append(
            (
                "ckpt",
                [
                    (
                        ["parallelism.activation_checkpointing=full"],
                        "recompute every block in backward",
                        replace(job, activation_checkpointing="full"),
                    )
                ],
            )
        )
    mb = []
    m = job.micro_batch
    while m > 1:
        m //= 2
        new = replace(job, micro_batch=m)
        mb.append(([f"trainer.micro_batch_size={m}"], f"micro-batch {m} ({new.accum} accumulation steps)", new))
    if mb:
        fams.append(("micro", mb))
    tps = []
    for tp in (2, 4, 8):
        if tp > job.tp and _tp_ok(job, tp):
            dp_total = job.world // tp
            if job.strategy == "hybrid":
                shard = max(1, job.nproc_per_node // tp)
                new = replace(job, tp=tp, dp_shard=shard, dp_replicate=dp_total // shard)
            elif job.strategy == "no_shard":
                new = replace(job, tp=tp, dp_replicate=dp_total)
            else:
                new = replace(job, tp=tp, dp_shard=dp_total // job.dp_replicate)
            tps.append(([f"parallelism.tp={tp}"], f"tensor parallel over {tp} ranks of a node", new))
    if tps:
        fams.append(("tp", tps))
    cps = []
    for cp in (2, 4, 8):
        heads = job.model.n_heads // job.tp
        if cp > job.cp and job.seq_len % cp == 0 and heads % cp == 0 and job.dp_shard * job.cp % cp == 0:
            if job.dp_replicate == 1 and job.ep == 1 and job.model.context_parallel:
                new = replace(job, cp=cp, dp_shard=job.dp_shard * job.cp // cp)
                cps.append(([f"parallelism.cp={cp}"], f"split each sequence over {cp} ranks (context parallel)", new))
    if cps:
        fams.append(("cp", cps))
    eps = []
    ep = job.ep * 2
    while job.model.n_experts and ep <= min(job.model.n_experts, job.dp_shard):
        if job.model.n_experts % ep == 0 and job.dp_shard % ep == 0 and _degrees_take(job, ep=ep):
            eps.append(
                ([f"parallelism.ep={ep}"], f"split the experts over {ep} ranks (expert parallel)", replace(job, ep=ep))
            )
        ep *= 2
    if eps:
        fams.append(("ep", eps))
    if job.param_dtype == "float32":
        fams.append(
            (
                "bf16",
                [
                    (
                        ["parallelism.param_dtype=bfloat16"],
                        "gather and compute in bfloat16 (fp32 master shards stay)",
                        replace(job, param_dtype="bfloat16"),
                    )
                ],
            )
        )
    if not job.offload and not job.quantized:
        fams.append(
            (
                "offload",
                [
                    (
                        ["parallelism.cpu_offload=true"],
                        "keep shards, gradients and optimizer state in host memory",
                        replace(job, offload=True),
                    )
                ],
            )
        )
    ranks = []
    for nodes, per_node in _ranks_options(job):
        new = _with_world(job, nodes, per_node)
        ov = [f"cluster.nodes={nodes}", f"cluster.nproc_per_node={per_node}"]
        if job.device_key != "cpu":
            ov.append(f"cluster.gpus_per_node={max(per_node, 8)}")
        ranks.append((ov, f"{nodes * per_node} ranks ({nodes} x {per_node})", new))
    fams.append(("ranks", ranks))
    return fams


def advise(job: Job, limit: int = 4) -> list[Change]:
    """The smallest change of each kind that makes the job fit, fastest first; if no single change
    does, the smallest number of ranks that fits with checkpointing and bf16 compute; for a model
    with experts also the fastest expert-parallel degree that fits with them."""
    found: list[Change] = []
    for _, options in _candidates(job):
        for overrides, why, new in options:
            est = estimate(new)
            if est.fits:
                found.append(Change(overrides, why, est))
                break
    combined = job.activation_checkpointing != "full" or job.param_dtype == "float32"
    if combined:  # the fewest ranks with cheaper activations and compute copies, beside the single changes
        base_ov, base = [], job
        if job.activation_checkpointing != "full":
            base_ov.append("parallelism.activation_checkpointing=full")
            base = replace(base, activation_checkpointing="full")
        if job.param_dtype == "float32":
            base_ov.append("parallelism.param_dtype=bfloat16")
            base = replace(base, param_dtype="bfloat16")
        fams = dict(_candidates(base))
        options = [([], "same ranks", base)] + fams.get("ep", []) + fams["ranks"]
        for overrides, why, new in options:
            est = estimate(new)
            if est.fits:
                if overrides or not found:  # with the same ranks it only repeats the single changes
                    found.append(Change(base_ov + overrides, f"{why}, with checkpointing and bf16 compute", est))
                break
        # Experts: the fastest ep that fits with those activations too (the larger ep, the fewer
        # expert bytes each rank gathers, against more rows sent to other ranks)
        fitting = [(estimate(new), ov, why) for ov, why, new in fams.get("ep", [])]
        fitting = [f for f in fitting if f[0].fits]
        if fitting:
            est, ov, why = min(fitting, key=lambda f: f[0].timing.step_s)
            if all(c.overrides != base_ov + ov for c in found):
                found.append(Change(base_ov + ov, f"{why}, with checkpointing and bf16 compute", est))
    found.sort(key=lambda c: c.estimate.timing.step_s)
    kept = found[:limit]
    # A sequence too long for one rank's activations: say so even when other changes are faster.
    split = [c for c in found if any(o.startswith("parallelism.cp=") for o in c.overrides)]
    if split and split[0] not in kept:
        kept[-1] = split[0]
    return kept


def make_plan(cfg: Config, world_size: int | None = None) -> PlanResult:
    job = job_from_config(cfg, world_size)
    est = estimate(job)
    from framework.planner.pipeline import pipeline_view  # pp: the heaviest stage; else a pp proposal

    est, pipeline_notes = pipeline_view(cfg, job, est)
    result = PlanResult(est, notes=pipeline_notes)
    if not est.fits:
        result.changes = advise(job)
    if cfg.parallelism.engine.value == "torch":
        result.notes.append(
            "parallelism.engine=torch: planned with our engine's buffers; torch's "
            "fully_shard keeps per-parameter buffers of the same sizes"
        )
    from framework.planner.snapshots import snapshot_note  # checkpoint.memory_interval's host memory

    snapshots = snapshot_note(cfg.checkpoint.memory_interval, est)
    if snapshots:
        result.notes.append(snapshots)
    return result


# ------------------------------------------------------------------ reporting
def _gib(n: float) -> str:
    return f"{n / GIB:9.2f}"


def _verdict(est: Estimate) -> str:
    job = est.job
    budget = job.budget_bytes
    if est.fits:
        return (
            f"fits: peak {est.memory.peak / GIB:.1f} GiB of {budget / GIB:.1f} GiB per rank "
            f"({100 * est.memory.peak / budget:.0f}%)"
        )
    if est.memory.peak > budget:
        return (
            f"does NOT fit: the peak of {est.memory.peak / GIB:.1f} GiB per rank exceeds the "
            f"{budget / GIB:.1f} GiB of the device (set cluster.gpu_memory_gib if yours differs)"
        )
    return (
        f"does NOT fit: offloaded state needs {est.memory.host * job.nproc_per_node / GIB:.0f} GiB of "
        f"host memory per node, more than {job.device.host_memory_gib:.0f} GiB"
    )


def format_plan(result: PlanResult, model_name: str = "") -> str:
    est = result.estimate
    job, mem, tr, tm = est.job, est.memory, est.traffic, est.timing
    n = total_params(job)
    lays = layouts(job)
    per_rank = sum(lay.real for lay in lays)
    lines = [
        (
            f"Plan: model={model_name or '?'} ({n / 1e9:.3f}B parameters, {per_rank / 1e6:.1f}M per rank), "
            f"{job.world} ranks = {job.nodes} node(s) x {job.nproc_per_node}, {job.device.name}"
        ),
        f"  mesh dp_replicate={job.dp_replicate} x dp_shard={job.dp_shard}"
        f"{f' x cp={job.cp}' if job.cp > 1 else ''} x tp={job.tp}"
        f"{f' (experts: ep={job.ep} x efsdp={job.dp_shard // job.ep})' if job.ep > 1 else ''}; "
        f"strategy={job.strategy}, param {job.param_dtype}, reduce {job.reduce_dtype}, "
        f"optimizer {job.optimizer}{' (bf16 state)' if job.state_dtype == 'bf16' else ''}, "
        f"checkpointing {job.activation_checkpointing}"
        + (", offload" if job.offload else "")
        + (", int8 comm" if job.quantized else ""),
        (
            f"  batch: micro {job.micro_batch} x seq {job.seq_len} x accumulation {job.accum} x dp {job.dp} = "
            f"{job.micro_batch * job.seq_len * job.accum * job.dp} tokens/step"
        ),
        "",
        "Memory per rank                         GiB",
        f"  parameters (fp32 shards)        {_gib(mem.params)}",
        f"  gradients (fp32 shards)         {_gib(mem.grads)}",
        f"  optimizer state                 {_gib(mem.optimizer)}",
    ]
    padding = sum(lay.padded - lay.T for lay in lays) * 4  # fp32 shard elements holding no parameter, all ranks
    lines.append(
        f"  shard boundaries {job.shard_boundary}: padding {padding / GIB:.2f} GiB over all ranks; the fullest rank "
        "holds the figures above"
    )
    if mem.host:
        lines.append(f"  offloaded to host memory        {_gib(mem.host)}")
    lines += [
        f"  accumulation buffers            {_gib(mem.accumulation)}",
        f"  reduce buffers (pool)           {_gib(mem.grad_pool)}",
        f"  send buffer (gather in flight)  {_gib(mem.send_buffers + mem.int8_buffers)}",
        f"  gathered units at the peak      {_gib(mem.gathered_peak)}   "
        f"(largest unit's all-gather + prefetch: {mem.largest_gather / GIB:.2f})",
        (
            f"  {'activations (' + job.activation_checkpointing + ')':<32}{_gib(mem.activations)}   "
            f"(none: {mem.activations_no_ckpt / GIB:.2f}, full checkpointing: {mem.activations_full_ckpt / GIB:.2f})"
        ),
        f"  logits and loss                 {_gib(mem.logits)}",
        f"  peak (during backward)         {_gib(mem.peak)}   of {job.budget_bytes / GIB:.1f}",
        "",
        "Traffic per rank per step              GiB     calls",
    ]
    for r in tr.rows:
        lines.append(f"  {r['collective']:14} {r['dim']:12} {r['link']:5} {_gib(r['bytes'])} {r['calls']:8d}")
    if not tr.rows:
        lines.append("  none (one rank)")
    if job.optimizer == "muon":
        mw = muon_work(job)
        lines.append(
            f"  Muon's Newton-Schulz work: busiest rank {max(mw.work) / 1e12:.2f} TFLOP/step, "
            f"{mw.max_over_ideal:.2f}x the mean (whole matrices to balanced owners and back)"
        )
    lines += [
        "",
        (
            f"Step time (estimate, {job.device.name}, {tm.peak_tflops:g} TFLOP/s peak, "
            f"{job.device.efficiency:.0%} sustained):"
        ),
        (
            f"  compute {tm.compute_s:.3f} s, communication {tm.comm_s:.3f} s (exposed {tm.exposed_s:.3f} s), "
            f"step {tm.step_s:.3f} s, {tm.tokens_per_s:,.0f} tokens/s, MFU {100 * tm.mfu:.1f}%"
        ),
        "",
        "Verdict: " + _verdict(est),
    ]
    if result.changes:
        lines.append("Smallest changes that fit (predicted peak per rank, step time):")
        for ch in result.changes:
            lines.append(
                f"  {' '.join(ch.overrides)}   # {ch.why}: {ch.estimate.memory.peak / GIB:.1f} GiB, "
                f"{ch.estimate.timing.step_s:.2f} s/step"
            )
    elif not est.fits:
        lines.append("No single change found that fits; reduce the model or add hardware.")
    for note in result.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def plan_json(result: PlanResult) -> dict:
    est = result.estimate
    mem = asdict(est.memory)
    mem.update(model_state=est.memory.model_state, between_steps=est.memory.between_steps, peak=est.memory.peak)
    job = asdict(est.job)
    out = {
        "job": job,
        "params": total_params(est.job),
        "memory_bytes": mem,
        "traffic": est.traffic.rows,
        "timing": asdict(est.timing),
        "fits": est.fits,
        "budget_bytes": est.job.budget_bytes,
        "changes": [
            {
                "overrides": c.overrides,
                "why": c.why,
                "peak_bytes": c.estimate.memory.peak,
                "step_s": c.estimate.timing.step_s,
            }
            for c in result.changes
        ],
        "notes": result.notes,
    }
    if est.job.optimizer == "muon":  # the whole matrices' Newton-Schulz work and exchange per step
        mw = muon_work(est.job)
        out["muon"] = {
            "work_max_over_ideal": mw.max_over_ideal,
            "work_flops_per_rank": list(mw.work),
            "bytes_sent_per_rank": list(mw.bytes_sent),
        }
    return out


def fit_problems(cfg: Config, world_size: int | None = None) -> list[str]:
    """For the launcher: one line per reason the job will not fit, with the advice (empty: fits)."""
    result = make_plan(cfg, world_size)
    from framework.planner.snapshots import snapshot_problem

    snapshots = [p for p in [snapshot_problem(cfg.checkpoint.memory_interval, result.estimate)] if p]
    if result.estimate.fits:
        return snapshots
    advice = "; ".join(" ".join(c.overrides) for c in result.changes) or "no single change fits"
    return [
        (
            f"{cfg.model.name}: {_verdict(result.estimate)}. Changes that fit: {advice} "
            "(or set cluster.force=true to submit anyway)"
        )
    ] + snapshots


def run_plan(cfg: Config, problems: list[str]) -> int:
    """stage=plan: print the plan, write plan.json into the run directory. Problems the training
    stage would refuse are printed too; the plan is made unless the mesh itself is impossible."""
    try:
        result = make_plan(cfg)
    except ValueError as exc:
        for line in problems or [str(exc)]:
            print(f"error: {line}")
        return EXIT_BAD_INPUT
    result.notes += [f"the training stage would refuse this config: {p}" for p in problems]
    print(format_plan(result, cfg.model.name), flush=True)
    if cfg.run_dir:
        os.makedirs(cfg.run_dir, exist_ok=True)
        path = os.path.join(cfg.run_dir, "plan.json")
        write_json(path, plan_json(result), indent=1, default=str)  # never through a planted link
        print(f"wrote {path}")
    return 0


__all__ = [
    "advise",
    "estimate",
    "fit_problems",
    "format_plan",
    "job_from_config",
    "make_plan",
    "plan_json",
    "run_plan",
]
