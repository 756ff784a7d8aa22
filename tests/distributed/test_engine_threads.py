"""Ranks that are threads of one process (torch's threaded process group, [Note: ranks as threads
of one process] in harness.py): the engine keeps its state by process group, not by process.

The engine once cached its world's groups in one module-level slot; two rank threads sharing the
process replaced each other's, so one rank made its reduction group again inside `fully_shard`
while the other already waited in the forward's all-gather, and both waited for good. Each run
here is bounded (`run_rank_threads` reports the stuck threads' stacks) and repeated 20 times in a
row, in a fresh world each time: the hang came in some runs, not all.

Tolerance: TOL = 1e-5, as in test_fsdp2_behaviours.py (fp32; the sharded sum runs in another
order than one process's, ~1e-7 relative; a scaling bug is 1e-2 or more).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed.harness import run_rank_threads

pytestmark = pytest.mark.timeout(600)

TOL = 1e-5
RUNS = 20
D = 8


class MLP(nn.Module):
    """The shape of torch's test MLP: in_proj (D -> 4D), relu, out_proj (4D -> D)."""

    def __init__(self, dim: int = D) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _built(make, seed: int = 0):
    """Build under the behaviours' lock with a fixed seed: rank threads share torch's generator."""
    from tests.distributed.test_fsdp2_behaviours import BUILD_LOCK

    with BUILD_LOCK:
        torch.manual_seed(seed)
        return make()


def _inputs(rank: int, n: int, rows: int = 2, width: int = D):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows * n, width, generator=g)
    return x, x[rank * rows : (rank + 1) * rows]


def post_acc_grad_hook_runs(rank, n):
    """Mirrors torch's `TestFullyShardPostAccGradHookMultiThread.test_post_acc_grad_hook_runs`:
    in_proj, out_proj and the root each a unit; a post-accumulate-grad hook on every parameter
    runs once per backward. Each whole gradient is also compared with one process's."""
    from framework.distributed.fsdp import fully_shard

    ref, model = _built(MLP), _built(MLP)
    for m in (model.in_proj, model.out_proj, model):
        fully_shard(m)
    counts = collections.defaultdict(int)
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: counts.__setitem__(name, counts[name] + 1))
    x_all, x = _inputs(rank, n)
    model(x).sum().backward()
    ref(x_all).sum().backward()  # our gradients are the mean over ranks: the global sum / n
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    diff = max((grads[k] - p.grad / n).abs().max().item() for k, p in ref.named_parameters())
    return {"names": sorted(name for name, _ in model.named_parameters()), "counts": dict(counts), "grad_diff": diff}


class SaveInputs(nn.Module):
    """The shape of torch's `SaveForwardInputsModel`: two 100-wide children, each recording the
    input it is called with."""

    def __init__(self, seen: dict, key: str, cast_to_fp16: bool = False) -> None:
        super().__init__()
        self.seen, self.key, self.cast = seen, key, cast_to_fp16
        self.lin = nn.Linear(100, 100)

    def forward(self, x):
        self.seen[self.key] = x
        return self.lin(x.half() if self.cast else x)


class SaveModel(nn.Module):
    def __init__(self, seen: dict, cast_c2: bool = False) -> None:
        super().__init__()
        self.seen = seen
        self.c1, self.c2 = SaveInputs(seen, "c1"), SaveInputs(seen, "c2", cast_to_fp16=cast_c2)

    def forward(self, x):
        self.seen["model"] = x
        return self.c2(self.c1(x))


def float16_on_one_submodule(rank, n):
    """Mirrors torch's `TestFullyShardMixedPrecisionCasts.test_float16_on_one_submodule`: fp16 on
    c2 alone; on c2 with the module casting its own input (cast_forward_inputs=False); on c1 with
    output_dtype=float32. Returns the dtype each module saw, per case."""
    from framework.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    x = torch.zeros(2, 100)
    cases = {
        "c2": (False, "c2", MixedPrecisionPolicy(param_dtype=torch.float16)),
        "c2_own_cast": (True, "c2", MixedPrecisionPolicy(param_dtype=torch.float16, cast_forward_inputs=False)),
        "c1_output_fp32": (
            False,
            "c1",
            MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32),
        ),
    }
    for case, (cast_c2, child, policy) in cases.items():
        seen: dict = {}
        model = _built(lambda seen=seen, cast_c2=cast_c2: SaveModel(seen, cast_c2))
        fully_shard(getattr(model, child), mp_policy=policy)
        fully_shard(model)
        model(x).sum().backward()
        out[case] = {k: str(v.dtype) for k, v in seen.items()}
    return out


class Blocks(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(depth))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def concurrent_blocks(rank, n):
    """Both rank threads shard a 4-block model at once (every block, then the root), then three
    SGD steps: the whole parameters equal one process's on the global batch."""
    from framework.distributed.fsdp import fully_shard

    ref, model = _built(Blocks), _built(Blocks)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x_all, y_all = torch.randn(4 * n, D, generator=g), torch.randn(4 * n, 1, generator=g)
        x, y = x_all[rank * 4 : (rank + 1) * 4], y_all[rank * 4 : (rank + 1) * 4]
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(ref(x_all), y_all).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    sd = model.state_dict()
    full = {k: v.full_tensor() for k, v in sd.items()}
    return max((full[k] - p).abs().max().item() for k, p in ref.named_parameters())


def test_post_acc_grad_hook_runs_once_per_parameter_20_runs():
    for per_rank in run_rank_threads(post_acc_grad_hook_runs, 2, repeats=RUNS):
        for r in per_rank:
            assert set(r["counts"]) == set(r["names"]) and set(r["counts"].values()) == {1}, r
            assert r["grad_diff"] < TOL, r


def test_float16_on_one_submodule_20_runs():
    want = {
        "c2": {"model": "torch.float32", "c1": "torch.float32", "c2": "torch.float16"},
        "c2_own_cast": {"model": "torch.float32", "c1": "torch.float32", "c2": "torch.float32"},
        "c1_output_fp32": {"model": "torch.float32", "c1": "torch.float16", "c2": "torch.float32"},
    }
    for per_rank in run_rank_threads(float16_on_one_submodule, 2, repeats=RUNS):
        assert per_rank == [want, want]


def test_rank_threads_shard_concurrently_and_train_like_one_process_20_runs():
    """Failed before the engine's groups were kept per world: a run hung, one rank thread in
    `dist.new_group` (reduce_group, under fully_shard), the other in the forward's all-gather."""
    for per_rank in run_rank_threads(concurrent_blocks, 2, repeats=RUNS, timeout_s=60):
        assert max(per_rank) < TOL, per_rank


# Our behaviour tests (test_fsdp2_behaviours.py) on 2 rank threads: each trains against one
# process's run from the same weights, as it does on 4 rank processes there.
THREADED_BEHAVIOURS = (
    "reused_module",
    "non_root_forward_backward",
    "nested_ckpt_two_forwards",
    "tied_transformer_ckpt",
    "post_accumulate_grad_hooks",
    "unused_outputs_and_submodules",
    "fp16_one_submodule",
    "module_list_dict_subclasses",
)


def _behaviours(rank, n):
    from tests.distributed.test_fsdp2_behaviours import BEHAVIOURS_4

    return {name: BEHAVIOURS_4[name](rank, n) for name in THREADED_BEHAVIOURS}


def test_behaviours_on_rank_threads():
    from tests.distributed.test_fsdp2_behaviours import FP16_TOL

    for per_rank in run_rank_threads(_behaviours, 2, repeats=3, timeout_s=120):
        for name, r in per_rank[0].items():
            runs = r.values() if name == "fp16_one_submodule" else [r]
            tol = FP16_TOL if name == "fp16_one_submodule" else TOL
            for one in runs:
                assert one["loss_diff"] < tol and one["param_diff"] < tol, (name, one)
                assert one["params_moved"] > 10 * tol, (name, one)
        if "post_accumulate_grad_hooks" in per_rank[0]:
            r = per_rank[0]["post_accumulate_grad_hooks"]
            assert r["ref_calls"] == r["our_calls"], r


def _sanity(rank, n):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def test_the_harness_runs_ranks_as_threads_of_one_process():
    assert run_rank_threads(_sanity, 2, repeats=2) == [[3.0, 3.0], [3.0, 3.0]]
