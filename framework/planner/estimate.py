"""Bytes per rank, bytes on the wire and step time of one job, from arithmetic alone (no torch).

The memory model follows our engine (`framework/distributed/fsdp/`) buffer by buffer:

  between steps   fp32 shard per unit ([Note: flat storage]: S = ceil(T / N) elements per rank,
                  rounded up to the int8 block with quantized communication), optimizer state
                  on this rank's real elements, the gradient-accumulation buffers
                  (unsharded, one per unit, once accumulation runs), the gradient buffer pool
                  (simulated exactly, see `grad_pool_bytes`; on the host only: an
                  accelerator's pool is let go at the end of backward and taken again in the
                  next, so there it counts during the step);
  during a step   the root unit stays gathered from its forward to the end of backward; a block is
                  gathered while it computes, plus the prefetched next one (ZeRO-3), or every block
                  stays gathered until backward ends (ZeRO-2); the saved activations of every block
                  (measured per token: `activation_bytes_per_token`), the logits and the loss;
                  the fp32 grad shard per unit, allocated by its reduction in backward and freed
                  by zero_grad(set_to_none=True) ([Note: gradient shards live from backward to
                  zero_grad] in reduce.py); the send buffer of a gather in flight (the shard cast
                  to 16 bits, or copied to the device), freed when the gather is waited on.

Traffic follows the engine's byte counters (`framework/distributed/fsdp/collectives.py`): an all-gather counts
the bytes this rank receives, a reduce-scatter or all-to-all the bytes it sends, an all-reduce the
ring volume 2 (n-1)/n x bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from framework.distributed.shard_layout import busiest_rank, elements_on, granule, pack
from framework.distributed.whole_owners import (
    assign_owners,
    bytes_sent,
    holdings,
    max_over_ideal,
    moves,
    newton_schulz_flops,
)
from framework.models.shapes import (
    ModelShape,
    Unit,
    flops_per_token,
    param_count,
    units,
)
from framework.planner.devices import Device

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True)
class Job:
    """Everything the estimate depends on (built from the config by `job_from_config`)."""

    model: ModelShape
    seq_len: int
    micro_batch: int
    global_batch: int  # samples per optimizer step over all data-parallel ranks
    strategy: str  # full | grad_op | hybrid | no_shard
    dp_replicate: int
    dp_shard: int
    tp: int
    nodes: int
    nproc_per_node: int
    device: Device
    device_key: str = "cpu"
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    optimizer: str = "adamw"  # adamw | sgd
    state_dtype: str = "fp32"  # fp32 | bf16: Adam's moments and Muon's momentum (optimizer.state_dtype)
    momentum: float = 0.9
    offload: bool = False
    quantized: bool = False
    block_size: int = 256
    shard_boundary: str = "anywhere"  # where rank boundaries fall: [Note: shard boundaries]
    activation_checkpointing: str = "none"  # none | full | selective
    recomputations: int = 1  # per microbatch, of each checkpointed block: 2 on a zbv stage past the first (I and W)
    sequence_parallel: bool = False
    gloo: bool = False  # CPU jobs: gloo's reduce-scatter needs receive scratch (collectives.py)
    host_shm: bool = False  # CPU jobs, our engine: a group on one host gathers and reduces through shared memory
    ep: int = 1  # expert parallelism: experts split over ep of the dp_shard ranks
    cp: int = 1  # context parallelism: each sequence split over cp ranks, weights over dp_shard x cp
    memory_gib: float = 0.0  # per rank; 0: the device's
    peak_tflops: float = 0.0  # 0: the device's
    # One pipeline stage (framework/planner/pipeline.py): its units stay gathered from a backward to
    # the next forward, and every unit, the embedding and head included, is resharded after forward
    # (the stage root holds no parameters): [Note: gathers of a pipeline stage]
    pipeline_stage: bool = False

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def accum(self) -> int:
        """Micro-batches per optimizer step (the trainer's gradient accumulation)."""
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    @property
    def budget_bytes(self) -> float:
        gib = self.memory_gib or self.device.memory_gib
        if self.device_key == "cpu" and not self.memory_gib:
            gib = gib / max(1, self.nproc_per_node)  # the ranks of a node share its memory
        return gib * GIB


# ------------------------------------------------------------------ the engine's per-unit layout
@dataclass(frozen=True)
class UnitLayout:
    unit: Unit
    T: int  # real elements (tp-local)
    S: int  # elements per rank (padded)
    N: int  # shard-group size
    real: int  # of S, the real elements on the rank planned for
    real_per_tensor: tuple = ()  # of `real`, each tensor's elements there (the unit's order)

    @property
    def padded(self) -> int:
        return self.S * self.N


def layouts(job: Job, rank: int | None = None) -> list[UnitLayout]:
    """Each unit's flat layout as `framework.distributed.fsdp.flat.build_layout` makes it (the same
    packing: [Note: shard boundaries]); `real` counts the parameter elements on `rank`, or on the
    rank holding the most (None: what memory must fit)."""
    align = job.block_size if job.quantized else 1
    out = []
    for u in units(job.model, job.tp, job.ep):
        N = job.dp_shard // job.ep if u.shard == "efsdp" else job.dp_shard * job.cp
        sizes = [(t.numel, granule(t.numel, t.row, job.shard_boundary)) for t in u.tensors]
        offsets, S = pack(sizes, N, align)
        if rank is not None:
            at = rank
        else:  # the busiest rank (the first of equals)
            at = busiest_rank(offsets, sizes, S, N)
        per = tuple(elements_on(at, [o], [sz], S) for o, sz in zip(offsets, sizes))
        out.append(UnitLayout(u, u.numel, S, N, sum(per), per))
    return out


def packed_nbytes(n: int, block: int) -> int:
    return n + 4 * (n // block)


def _zero_copy(job: Job, lay: UnitLayout) -> bool:
    return lay.N == 1 and job.param_dtype == "float32" and not job.offload


def muon_tensors(lay: UnitLayout) -> list[bool]:
    """Per tensor of the unit: stepped by Muon under optimizer=muon, as the family's shapes say
    (framework/param_roles.py: the optimizer builder's rule); a family that does not say: a
    block's matrix (row > 1 outside the root)."""
    return [t.muon if t.muon is not None else lay.unit.name != "root" and t.row > 1 for t in lay.unit.tensors]


def optimizer_bytes(job: Job, lay: UnitLayout) -> int:
    """AdamW: exp_avg + exp_avg_sq on the real elements, a 4-byte `step` per tensor; SGD with
    momentum: one buffer; Muon: one momentum buffer on the blocks' matrices (AdamW on the rest: the
    root's embeddings and head, norms, biases; framework/optim/builder.py). The moments and the
    momentum are 4 bytes an element, 2 with state_dtype=bf16, which also gives Muon's matrices a
    4-byte `step` (the count that keys their rounding: framework/optim/lowp.py)."""
    sb = 2 if job.state_dtype == "bf16" else 4
    if job.optimizer == "adamw":
        return 2 * sb * lay.real + 4 * len(lay.unit.tensors)
    if job.optimizer == "muon":
        hidden = muon_tensors(lay)
        muon = sum(r for r, h in zip(lay.real_per_tensor, hidden) if h)
        steps = len(hidden) if job.state_dtype == "bf16" else hidden.count(False)
        return sb * muon + 2 * sb * (lay.real - muon) + 4 * steps
    return 4 * lay.real if job.momentum > 0 else 0


def _requests(job: Job, lay: UnitLayout, rank: int) -> list[tuple[str, int, int]]:
    """(tag, elements, element size) a unit's gradient reduction takes from the pool, in order."""
    rb = BYTES[job.reduce_dtype]
    out = []
    in_place = not _zero_copy(job, lay) and job.reduce_dtype == job.param_dtype
    if not in_place and job.accum == 1:  # with accumulation the reduction reads the accum buffer
        out.append(("in", lay.padded, rb))
    direct = rb == 4 and not job.offload
    if job.quantized and lay.N > 1:
        if job.offload:  # the chunks are summed in fp32, into the grad shard when it is on the device
            out.append(("q", lay.S, 4))
        nb = packed_nbytes(lay.S, job.block_size)
        if lay.padded * rb < 2 * lay.N * nb:  # the received chunks do not fit behind the sent ones
            out.append(("qrecv", lay.N * nb, 1))
    else:
        if not direct:
            out.append(("out", lay.S, rb))
        if job.gloo and lay.N > 2:  # gloo's reduce-scatter receive scratch (collectives.py)
            k = (lay.N - 1) * lay.S if rank in (0, lay.N - 1) else lay.N * lay.S
            out.append(("rs", k, rb))
    return out


def grad_pool_bytes(job: Job, lays: list[UnitLayout], rank: int = 0) -> int:
    """Bytes the engine's buffer pool holds after a step ([Note: the gradient buffer pool] in
    context.py), by replaying its acquire/release order over one backward: every buffer of a tag
    is cut to the largest request any unit makes under it, a request takes any free buffer, and
    when none is free while MAX_IN_FLIGHT = 2 reductions are pending the oldest finishes first."""
    in_flight_max = 2
    reqs = {id(lay): _requests(job, lay, rank) for lay in lays}
    cap: dict[str, tuple[int, int]] = {}
    for lay in lays:
        for tag, n, esize in reqs[id(lay)]:
            cap[tag] = (max(cap.get(tag, (0, 0))[0], n), esize)
    free: dict[str, int] = {}
    created: dict[str, int] = {}
    pending: list[list[str]] = []

    def finish_oldest() -> None:
        for tag in pending.pop(0):
            free[tag] = free.get(tag, 0) + 1

    def acquire(tag: str) -> None:
        while True:
            if free.get(tag, 0):
                free[tag] -= 1
                return
            if len(pending) >= in_flight_max:
                finish_oldest()
                continue
            created[tag] = created.get(tag, 0) + 1
            return

    for lay in list(reversed(lays[1:])) + lays[:1]:  # backward: last block first, the root last
        held = []
        for tag, _, _ in reqs[id(lay)]:
            acquire(tag)
            held.append(tag)
        pending.append(held)
        while len(pending) > in_flight_max:
            finish_oldest()
    # int8 communication needs no buffer of its own beyond transients: packed chunks live inside
    # the unit's storage and the dequantized chunks are summed into the gradient shard.
    return sum(count * cap[tag][0] * cap[tag][1] for tag, count in created.items())


@dataclass
class Memory:
    """Bytes per rank, by what holds them."""

    params: int = 0  # fp32 shards (the optimizer's parameters)
    grads: int = 0  # fp32 gradient shards
    optimizer: int = 0
    accumulation: int = 0  # unsharded gradients kept across micro-batches (accum > 1), during a step
    grad_pool: int = 0  # reduce-scatter inputs/outputs/scratch (pooled), held during backward
    pool_between_steps: bool = True  # the host keeps the pool between steps; accelerators let it go
    send_buffers: int = 0  # the cast (16-bit) shard of the gather in flight at the peak (prefetch)
    int8_buffers: int = 0  # int8 buffers outside the units' storage (none in this engine version)
    gathered_root: int = 0  # unsharded from forward to the end of backward (root; every unit in ZeRO-2)
    gathered_blocks: int = 0  # blocks gathered in backward, one full gradient, the block's working set
    largest_gather: int = 0  # the largest unit's gathered bytes (and its prefetched neighbour)
    activations: int = 0  # saved for backward, all blocks, as configured
    activations_no_ckpt: int = 0
    activations_full_ckpt: int = 0
    logits: int = 0  # logits, log-softmax and their gradients at the start of backward
    host: int = 0  # offloaded shards, grads and optimizer state (host memory)

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def between_steps(self) -> int:
        """Held after zero_grad(set_to_none=True): gradient shards are freed there, and off the
        host the reduction pool too ([Note: the gradient buffer pool])."""
        pool = self.grad_pool if self.pool_between_steps else 0
        return self.params + self.optimizer + pool + self.int8_buffers

    @property
    def gathered_peak(self) -> int:
        """Unsharded parameters at the peak."""
        return self.gathered_root + (self.gathered_blocks if self.gathered_blocks > self.logits else 0)

    @property
    def peak(self) -> int:
        """Backward starts with every block's activations saved, the root gathered and no gradient
        shard yet; first the loss and the head (logits-wide tensors), then the last blocks
        gathered again, whichever is larger. It ends with every gradient shard and the
        activations freed. The peak is the larger of the two ends."""
        start = self.activations + max(self.logits, self.gathered_blocks)
        end = self.grads + self.gathered_blocks
        during = self.accumulation + self.gathered_root + self.send_buffers
        if not self.pool_between_steps:
            during += self.grad_pool
        return self.between_steps + during + max(start, end)


def activation_bytes_per_token(m: ModelShape, dtype: str, tp: int = 1) -> int:
    """Bytes one transformer block saves for backward per token (no checkpointing).

    Counted with saved-tensor hooks on our Llama block (tests/planner): 10 d + 4 f elements in the
    compute dtype (block input, two norms' outputs, q, rotary q, attention output, its transposed
    copy, the residual, the SwiGLU's four f-wide tensors), plus fp32 copies the norms make of 16-bit
    inputs (6 d bytes per byte saved), the attention's log-sum-exp (4 bytes per head) and the norms'
    reciprocal roots (8 bytes). Under tp the attention and SwiGLU parts divide by tp.
    """
    e = BYTES[dtype]
    d, f = m.dim, m.ffn_dim
    replicated = 6 * d * e + 6 * (4 - e) * d  # norms and the residual stream
    split = (4 * d + 4 * f) * e + 4 * m.n_heads
    return replicated + split // tp + 8


def block_activation_bytes(job: Job, mode: str | None = None) -> tuple[int, int]:
    """(saved bytes of all blocks, transient extra of recomputing one block) for a micro-batch."""
    mode = mode or job.activation_checkpointing
    tokens = job.micro_batch * job.seq_len // job.cp  # a cp rank holds 1/cp of each sequence
    per_block = activation_bytes_per_token(job.model, job.param_dtype, job.tp) * tokens
    block_input = job.model.dim * BYTES[job.param_dtype] * tokens
    L = job.model.n_layers
    if mode == "none":
        return L * per_block, 0
    if mode == "full":
        return L * block_input, per_block
    kept = L // 2  # selective: blocks 0, 2, 4, ... recompute; the odd ones keep their activations
    return (L - kept) * block_input + kept * per_block, per_block


def logits_bytes(job: Job) -> int:
    """The head at the start of backward: the fp32 log-softmax the loss saved, the loss's gradient
    and the logits' fp32 gradient (plus its 16-bit cast); the final norm's three saved tensors."""
    tokens = job.micro_batch * job.seq_len // job.cp
    vocab = -(-job.model.vocab_size // job.tp)
    e = BYTES[job.param_dtype]
    return tokens * vocab * (12 + (e if e != 4 else 0)) + tokens * job.model.dim * 3 * e


def memory(job: Job, rank: int | None = None) -> Memory:
    lays = layouts(job, rank)
    pb, rb = BYTES[job.param_dtype], BYTES[job.reduce_dtype]
    mem = Memory()
    for lay in lays:
        mem.params += 4 * lay.S
        mem.grads += 4 * lay.S
        mem.optimizer += optimizer_bytes(job, lay)
        if job.accum > 1:  # unsharded gradients across the micro-batches, freed by the reduction
            mem.accumulation += lay.padded * rb
    mem.grad_pool = grad_pool_bytes(job, lays, rank)
    mem.pool_between_steps = job.device_key == "cpu"
    if job.offload:
        mem.host = mem.params + mem.grads + mem.optimizer
        mem.params = mem.grads = mem.optimizer = 0
    full = lambda lay: 0 if _zero_copy(job, lay) else lay.padded * pb
    root, blocks = lays[0], lays[1:]
    biggest = max(blocks, key=lambda lay: lay.padded) if blocks else root
    # The largest parameter's gradient exists once in full before it is copied into its slot.
    largest_param = max(t.numel for lay in lays for t in lay.unit.tensors)
    if job.strategy == "grad_op":
        mem.gathered_root = full(root) + sum(full(b) for b in blocks)
        mem.gathered_blocks = largest_param * pb
    else:
        # In backward: the block computing, the one before it prefetched, and (when gradients are
        # reduced in the gathered storage itself) up to MAX_IN_FLIGHT = 2 blocks whose
        # reduce-scatter has not finished yet; other reduce inputs come from the pool.
        in_place = job.reduce_dtype == job.param_dtype and job.accum == 1 and not _zero_copy(job, biggest)
        mem.gathered_root = full(root)
        mem.gathered_blocks = min(4 if in_place else 2, len(blocks)) * full(biggest) + largest_param * pb
    # The block being differentiated holds a few gradients of its own activations at once (its
    # SwiGLU's two f-wide ones and two d-wide ones at the widest point).
    tokens = job.micro_batch * job.seq_len
    mem.gathered_blocks += tokens * (2 * -(-job.model.ffn_dim // job.tp) + 2 * job.model.dim) * pb
    # int8 packing happens inside the unit's own storage ([Note: int8 buffers live inside the
    # unit's own storage]); a cast to 16 bits (or a copy to the device) needs a send buffer, for
    # one gather: in backward (ZeRO-3) the prefetched block's is in flight.
    if job.strategy != "grad_op" and blocks and not _zero_copy(job, biggest):
        if not (job.quantized and biggest.N > 1) and (job.param_dtype != "float32" or job.offload):
            mem.send_buffers = biggest.S * pb
    big = max(lays, key=lambda lay: lay.padded)
    mem.largest_gather = full(big) + (full(biggest) if big is not root else 0)
    mem.activations_no_ckpt = sum(block_activation_bytes(job, "none"))
    mem.activations_full_ckpt = sum(block_activation_bytes(job, "full"))
    mem.activations = sum(block_activation_bytes(job))
    mem.logits = logits_bytes(job)
    return mem


# ------------------------------------------------------------------ traffic
@dataclass
class Traffic:
    """Bytes per rank per optimizer step, by collective and by mesh dimension."""

    rows: list[dict] = field(default_factory=list)  # {collective, dim, link, bytes, calls}

    def add(self, collective: str, dim: str, link: str, nbytes: int, calls: int, engine: bool | None = None) -> None:
        """`engine`: the sharding engine issues it and counts it in `comm_stats()` (default: the dp
        dims' rows; tensor parallel's activation all-reduces are torch's)."""
        if engine is None:
            engine = dim in ("dp_shard", "dp_replicate")
        if nbytes or calls:
            row = {"collective": collective, "dim": dim, "link": link, "bytes": int(nbytes), "calls": calls}
            self.rows.append({**row, "engine": engine})

    def total(self, **match) -> int:
        return sum(r["bytes"] for r in self.rows if all(r[k] == v for k, v in match.items()))

    def engine_counters(self) -> dict[str, int]:
        """In the keys of the engine's `comm_stats()`."""
        names = {
            "all_gather": "allgather_bytes",
            "reduce_scatter": "reduce_scatter_bytes",
            "all_reduce": "allreduce_bytes",
            "all_to_all": "alltoall_bytes",
        }
        out = {v: 0 for v in names.values()}
        out["num_collectives"] = 0
        for r in self.rows:
            if r["engine"]:
                out[names[r["collective"]]] += r["bytes"]
                out["num_collectives"] += r["calls"]
        return out


def expert_all_to_all(job: Job) -> tuple[int, int]:
    """(bytes sent, exchanges) per rank per step of expert parallelism's token all-to-alls
    (framework/distributed/expert_parallel.py), with the routing spread evenly over the experts:
    a micro-batch's micro x seq x top_k rows leave for other ranks with probability (ep-1)/ep,
    in forward to the experts and back (2 exchanges, plus the row counts), in backward their
    gradients the same way (2); recomputed blocks repeat the forward ones. Only the blocks holding
    experts exchange (DeepSeek-V3's first dense blocks do not)."""
    m, ep = job.model, job.ep
    rows = job.micro_batch * job.seq_len * m.top_k * (ep - 1) // ep
    row_bytes = m.dim * BYTES[job.param_dtype]
    counts = (ep - 1) * (m.n_experts // ep) * 8
    moe = [i for i, u in enumerate(m.layout(m, job.tp)[1:]) if any(t.experts for t in u.tensors)]
    L = len(moe)
    # recomputed: every checkpointed block (full), the even ones (selective: `block_activation_bytes`)
    per = {"none": 0, "full": L, "selective": sum(1 for i in moe if i % 2 == 0)}[job.activation_checkpointing]
    recompute = per * job.recomputations
    forward = 2 * rows * row_bytes + counts
    per_micro = (L + recompute) * forward + L * 2 * rows * row_bytes
    return per_micro * job.accum, (3 * (L + recompute) + 2 * L) * job.accum


def context_all_to_all(job: Job) -> tuple[int, int]:
    """(bytes sent, exchanges) per rank per step of context parallelism's attention all-to-alls
    (framework/distributed/context_parallel.py): per block q, k, v to whole sequences and the
    output back, each (cp-1)/cp of a chunk's (micro x seq/cp) x width; backward the same;
    recomputed blocks repeat the forward ones. KV heads cp does not divide travel repeated."""
    m, cp = job.model, job.cp
    heads = m.n_heads // job.tp
    kv = m.n_kv_heads // job.tp if (m.n_kv_heads // job.tp) % cp == 0 else heads
    width = (2 * heads + 2 * kv) * m.head_dim  # q and the output, k and v
    chunk = job.micro_batch * job.seq_len // cp
    per_block = chunk * width * BYTES[job.param_dtype] * (cp - 1) // cp
    L = m.n_layers
    recompute = _recomputed_blocks(job)
    return (2 * L + recompute) * per_block * job.accum, (8 * L + 4 * recompute) * job.accum


def _link(job: Job, span: int) -> str:
    """A group of `span` consecutive ranks (stride 1) is intra-node if it fits one node."""
    return "intra" if span <= job.nproc_per_node else "inter"


@dataclass(frozen=True)
class MuonWork:
    """optimizer=muon's whole matrices per step, as the engine balances and moves them
    ([Note: balancing whole-matrix owners] in framework/distributed/whole_owners.py): per rank of the
    dense shard group (its dp_shard x cp index)."""

    work: tuple  # per dp x tp rank (dp index x tp + tp rank): FLOPs of its Newton-Schulz calls (5 steps)
    max_over_ideal: float  # the busiest rank's work over the mean (the largest of the shard groups')
    bytes_sent: tuple  # per dp index: what its all-to-alls send (to the owners, and the results back)
    calls: tuple  # per dp index: the all-to-alls it takes part in (two per shard group moving anything)
    tp_numel: tuple  # per dp index: elements of the tp-local slices of the tp-split matrices it owns


def _matrix_cost(t, tp: int) -> int:
    """Newton-Schulz FLOPs of tensor `t`: its matrices (stacked experts: each), whole over tp."""
    shape = t.matrix or (t.numel // max(1, t.row), t.row)
    count = t.numel * (tp if t.tp_split else 1) // max(1, shape[0] * shape[1])
    return max(1, count) * newton_schulz_flops(shape)


def muon_work(job: Job) -> MuonWork:
    """The engine's owners of the Muon matrices, computed from the planner's own layout (the same
    functions as fsdp/whole.py's): one assignment per shard group (the dense units' and, with
    expert parallelism, the efsdp one, whose index is the dp index // ep), in the units' order."""
    align = job.block_size if job.quantized else 1
    T = job.tp
    groups: dict = {}
    for u in units(job.model, job.tp, job.ep):
        n = job.dp_shard // job.ep if u.shard == "efsdp" else job.dp_shard * job.cp  # as `layouts`
        sizes = [(t.numel, granule(t.numel, t.row, job.shard_boundary)) for t in u.tensors]
        offsets, S = pack(sizes, n, align)
        for o, t, h in zip(offsets, u.tensors, muon_tensors(UnitLayout(u, u.numel, S, n, 0))):
            if h and t.numel:
                groups.setdefault(u.shard, (n, []))[1].append((holdings(o, t.numel, S, n), t))
    N = job.dp_shard * job.cp
    work, sent, calls, tp_numel, ratio = [0] * (N * T), [0] * N, [0] * N, [0] * N, 1.0
    for shard, (n, mats) in groups.items():
        held = [h for h, _ in mats]
        costs = [_matrix_cost(t, T) for _, t in mats]
        owners = assign_owners(costs, held, n)
        split = [t.tp_split and T > 1 for _, t in mats]
        tp_owner, owned = [-1] * len(mats), [0] * n
        by_owner: dict = {}
        for k in range(len(mats)):
            if split[k]:
                by_owner.setdefault(owners[k], []).append(k)
                owned[owners[k]] += mats[k][1].numel
        for ks in by_owner.values():
            for k, t in zip(ks, assign_owners([costs[k] for k in ks], [{r: 1 for r in range(T)} for _ in ks], T)):
                tp_owner[k] = t
        mine = [0] * (n * T)
        for k, (c, o) in enumerate(zip(costs, owners)):
            for t in range(T):
                if not split[k] or tp_owner[k] == t:
                    mine[o * T + t] += c
        ratio = max(ratio, max_over_ideal(mine))
        moving = moves(held, owners)
        out = bytes_sent(held, owners, n)
        for r in range(N):
            g = r if shard == "dp_shard" else r // job.ep  # the rank's index in this group
            sent[r] += out[g]
            calls[r] += 2 if moving else 0
            tp_numel[r] += owned[g]
            for t in range(T):
                work[r * T + t] += mine[g * T + t]
    return MuonWork(tuple(work), ratio, tuple(sent), tuple(calls), tuple(tp_numel))


# [Note: gathers of a pipeline stage]
# Under a pipeline schedule each unit of a stage is resharded after every forward (ZeRO-3), and kept
# gathered after every backward but the step's last (framework/distributed/pipeline.py, [Note: our
# engine under torch's schedules]). So a forward or backward gathers exactly when the stage's
# previous action was a forward (or it is the step's first): every forward is followed by some
# action, so m microbatches cost m + 1 gathers per unit and step, whatever the schedule's order
# (GPipe: m forwards, then the first backward; 1F1B: every forward's successor), against 2m with
# plain accumulation; with grad_op (nothing resharded until the last backward) one. Measured: rank
# 0's gather bytes of a pp=2 x dp_shard=2 job equal this count for each schedule
# (tests/planner/test_pipeline_plan.py).
def traffic(job: Job, rank: int | None = None) -> Traffic:
    """Per rank per step; `rank` (the dp_shard index) matters to optimizer=muon only, whose
    exchange of whole matrices depends on the matrices that index owns and holds (None: the index
    sending the most)."""
    tr = Traffic()
    lays = layouts(job)
    pb, rb = BYTES[job.param_dtype], BYTES[job.reduce_dtype]
    N, R, t = lays[0].N, job.dp_replicate, job.tp
    shard_link = _link(job, N * t)  # the shard group's ranks are tp apart: it spans N x tp ranks
    repl_link = "inter" if job.nodes > 1 and N * t * R > job.nproc_per_node else "intra"
    gathers = ag_bytes = rs_bytes = a2a_bytes = ar_bytes = 0
    reduces = 0
    for i, lay in enumerate(lays):
        if lay.N > 1 and not (job.pipeline_stage and lay.T == 0):  # a middle stage's root holds nothing
            # all-gathers per step: per micro-batch one (the root, kept gathered; grad_op) or two
            # (forward and backward), with accumulation every micro-batch's; a pipeline stage's
            # units: [Note: gathers of a pipeline stage]
            if job.pipeline_stage:
                calls = 1 if job.strategy == "grad_op" else job.accum + 1
            else:
                calls = (1 if (i == 0 or job.strategy == "grad_op") else 2) * job.accum
            gathers += calls
            n = lay.N
            if job.quantized:
                nb = packed_nbytes(lay.S, job.block_size)
                ag_bytes += calls * (n - 1) * nb
                a2a_bytes += (n - 1) * (nb * n) // n
            else:
                ag_bytes += calls * (n - 1) * lay.S * pb
                rs_bytes += (n - 1) * lay.S * rb
            reduces += 1
        if R > 1:
            esize = 4 if job.quantized else rb  # the int8 path reduces into an fp32 buffer
            ar_bytes += 2 * (R - 1) * lay.S * esize // R
    # With accumulation, forward/backward of every micro-batch gathers (counted above); only the last reduces.
    tr.add("all_gather", "dp_shard", shard_link, ag_bytes, gathers)
    if job.quantized:
        tr.add("all_to_all", "dp_shard", shard_link, a2a_bytes, reduces)
    else:
        tr.add("reduce_scatter", "dp_shard", shard_link, rs_bytes, reduces)
    tr.add("all_reduce", "dp_replicate", repl_link, ar_bytes, len(lays) if R > 1 else 0)
    if job.optimizer == "muon":
        # the whole matrices, once per step after the last micro-batch ([Note: whole matrices from
        # pieces]): the pieces to their owners and the results back (two fp32 all-to-alls over
        # dp); the tp-split ones also made whole over tp: one fp32 all-gather of the tp-local
        # slices this dp index owns ((t-1) x M x 4 received) and one reduce-scatter back
        mw = muon_work(job)
        at = rank if rank is not None else max(range(len(mw.bytes_sent)), key=lambda r: mw.bytes_sent[r])
        tr.add("all_to_all", "dp_shard", shard_link, mw.bytes_sent[at], mw.calls[at])
        if t > 1:
            if rank is None:
                at = max(range(len(mw.tp_numel)), key=lambda r: mw.tp_numel[r])
            tp_link = _link(job, t)
            M, calls = mw.tp_numel[at], 1 if mw.tp_numel[at] else 0
            tr.add("all_gather", "tp", tp_link, (t - 1) * M * 4, calls, engine=True)
            tr.add("reduce_scatter", "tp", tp_link, (t - 1) * M * 4, calls, engine=True)
    if job.ep > 1 and job.model.n_experts:
        bytes_, calls = expert_all_to_all(job)
        tr.add("all_to_all", "ep", _link(job, job.ep * t), bytes_, calls)
    if job.cp > 1:
        bytes_, calls = context_all_to_all(job)
        tr.add("all_to_all", "cp", _link(job, job.cp * t), bytes_, calls)
    if t > 1:
        # Megatron layout: per block two all-reduces of (batch, seq, dim) in forward (attention and
        # MLP outputs) and two in backward (their inputs' gradients); the embedding's forward and
        # the head's backward add one each. Sequence parallel turns each into an all-gather plus a
        # reduce-scatter of the same total. Recomputation repeats the forward ones.
        act = job.micro_batch * job.seq_len * job.model.dim * pb
        L = job.model.n_layers
        recompute = _recomputed_blocks(job)
        calls = (4 * L + 2 + 2 * recompute) * job.accum
        tr.add("all_reduce", "tp", _link(job, t), calls * 2 * (t - 1) * act // t, calls)
    return tr


# ------------------------------------------------------------------ time
@dataclass
class Timing:
    compute_s: float
    comm_s: float  # total communication time if nothing overlapped
    exposed_s: float  # the part not hidden behind compute
    step_s: float
    tokens_per_s: float  # whole job
    mfu: float
    peak_tflops: float


def _recomputed_blocks(job: Job) -> int:
    """Block forwards a microbatch's backward repeats (each repeats the forward's collectives)."""
    L = job.model.n_layers
    return {"none": 0, "full": L, "selective": (L + 1) // 2}[job.activation_checkpointing] * job.recomputations


def timing(job: Job, tr: Traffic | None = None) -> Timing:
    tr = tr or traffic(job)
    dev = job.device
    peak = job.peak_tflops or dev.tflops(job.param_dtype)
    tokens_rank = job.micro_batch * job.seq_len * job.accum  # per data-parallel rank
    fpt = flops_per_token(job.model, job.seq_len)
    recompute = {"none": 0.0, "full": 1.0, "selective": 0.5}[job.activation_checkpointing] * job.recomputations
    # Forward is a third of 6N: each recomputation adds one more forward of the checkpointed blocks.
    flops_rank = fpt * tokens_rank * (1 + recompute / 3) / (job.tp * job.cp)
    compute = flops_rank / (peak * 1e12 * dev.efficiency)
    bw = {"intra": dev.intra_node_gbps, "inter": dev.inter_node_gbps}
    comm = {"dp": 0.0, "tp": 0.0}
    for r in tr.rows:
        rate = bw[r["link"]]
        if (
            job.host_shm
            and dev.shm_gbps
            and r["link"] == "intra"
            and r["collective"] in ("all_gather", "reduce_scatter")
        ):
            rate = dev.shm_gbps
        seconds = r["bytes"] / (rate * 1e9 * dev.link_efficiency)
        # tp, cp and ep exchanges sit inside each block's compute: on the critical path
        comm["tp" if r["dim"] in ("tp", "cp", "ep") else "dp"] += seconds
    lays = layouts(job)
    n_units = max(1, len(lays))
    # Sharded-dp traffic overlaps compute unit by unit (prefetch, async reduce); the first gather
    # and the last reduction cannot, and a step can never be shorter than its communication.
    # Tensor-parallel collectives sit on the critical path of every block.
    first_last = 2 * comm["dp"] / (n_units * (2 if job.strategy != "grad_op" else 1))
    overlapped = max(compute, comm["dp"])
    step = overlapped + first_last + comm["tp"]
    if job.offload:  # shards and grads cross PCIe (~25 GB/s) every step, optimizer on the host
        host_bytes = sum(lay.S for lay in lays) * (BYTES[job.param_dtype] + 4)
        step += host_bytes / 25e9 + sum(lay.S for lay in lays) * 16 / 10e9
    exposed = step - compute
    tokens = tokens_rank * job.dp / step
    mfu = fpt * tokens_rank * job.dp / step / (job.world * peak * 1e12)
    return Timing(compute, comm["dp"] + comm["tp"], exposed, step, tokens, mfu, peak)


def with_changes(job: Job, **changes) -> Job:
    return replace(job, **changes)


def total_params(job: Job) -> int:
    return param_count(job.model)
