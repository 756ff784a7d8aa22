"""The engine's contract with torch: torch's own tools, unmodified, are right on our sharded model.

Nothing of torch is changed for the process (its clipping functions are its own objects, no
global optimizer hook, the `torch.__future__` flags as the user left them), and still torch's
`clip_grad_norm_` returns the single-process norm and clips alike, and `torch.optim.AdamW` in its
for-loop, foreach and fused forms steps exactly as on one process. See [Note: pieces that
describe themselves] in framework/distributed/fsdp/views.py.

Device and world size are read at run time, as in test_fsdp2_behaviours.py: `FSDP_TEST_DEVICE=cuda`
puts each rank (and its single-process reference) on its own GPU, `FSDP_TEST_WORLD` sets the
world sizes of the contract cases (default 2 and 4); `bench/gpu_check.sh` runs the contract on
the GPUs it has (one GPU: 1 rank), leaving out the DCP cases, which are CPU cases.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn as nn

from tests.distributed.harness import run_ranks

STEPS = 5
ROWS = 8  # global batch: divides by 1, 2 and 4 ranks
# fp32 on both sides; the sharded run sums per-rank gradient means in another order than the
# single process sums the rows (and the norm's powers per piece), so values differ by rounding
# only: ~1e-7 relative per step, compounded over 5 AdamW steps well below 1e-6.
TOL = 1e-6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, 24)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(24, 24), nn.Tanh()) for _ in range(2)])
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


BOUNDARIES = ["anywhere", "rows", "params"]
WORLDS = [int(os.environ["FSDP_TEST_WORLD"])] if os.environ.get("FSDP_TEST_WORLD") else [2, 4]


def _device() -> torch.device:
    """This rank's device: its GPU under FSDP_TEST_DEVICE=cuda (the harness made it current), else the CPU."""
    if os.environ.get("FSDP_TEST_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard(model: nn.Module, boundary: str = "anywhere") -> nn.Module:
    from framework.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, shard_boundary=boundary)
    fully_shard(model, shard_boundary=boundary)
    return model


def _pieces(model) -> dict:
    """Each parameter's local piece: (elements here, the full shape)."""
    return {k: (p.numel(), tuple(p.piece_spec.full_shape)) for k, p in model.named_parameters()}


def _batch(step: int, rank: int, n: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(ROWS, 6, generator=g, dtype=dtype)
    y = torch.randn(ROWS, 3, generator=g, dtype=dtype)
    k = ROWS // n
    return x[rank * k : (rank + 1) * k].to(_device()), y[rank * k : (rank + 1) * k].to(_device())


def _train(model, opt, rank, n, clip: float, dtype=torch.float32, steps=range(STEPS)):
    import torch.distributed as dist

    losses, norms = [], []
    for step in steps:
        x, y = _batch(step, rank, n, dtype)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if n > 1:
            dist.all_reduce(total)
        losses.append(float(total) / n)
    return losses, norms


def _full(model) -> dict:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in model.state_dict().items()
    }


def _torch_untouched() -> dict:
    """What a process-wide change of torch would show: its clipping functions replaced, a global
    optimizer hook, a `torch.__future__` flag moved."""
    from torch.nn.utils import clip_grad
    from torch.optim import optimizer as optim_mod

    def torchs_own(fn) -> bool:  # the object itself, not what a functools.wraps wrapper names
        return fn.__code__.co_filename == clip_grad.__file__

    return {
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_ is clip_grad.clip_grad_norm_
        and torchs_own(clip_grad.clip_grad_norm_),
        "_get_total_norm": torchs_own(clip_grad._get_total_norm),
        "get_total_norm": torchs_own(torch.nn.utils.get_total_norm),
        # torch has no public reader of its global optimizer hooks: its own registries, read only
        "global_optimizer_hooks": len(optim_mod._global_optimizer_pre_hooks)
        + len(optim_mod._global_optimizer_post_hooks),
        "swap_flag": torch.__future__.get_swap_module_params_on_conversion(),
        "overwrite_flag": torch.__future__.get_overwrite_module_params_on_conversion(),
    }


def contract(rank: int, n: int, boundary: str) -> dict:
    before = _torch_untouched()
    dev = _device()
    out = {"before": before, "pieces": _pieces(_shard(Net().to(dev), boundary)), "device": str(dev)}
    variants = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
    for label, kw in variants.items():
        ref = Net().to(dev)
        ours = _shard(copy.deepcopy(ref), boundary)
        ref_l, ref_n = _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05, **kw), 0, 1, clip=0.3)
        our_l, our_n = _train(ours, torch.optim.AdamW(ours.parameters(), lr=0.05, **kw), rank, n, clip=0.3)
        a, b = _full(ref), _full(ours)
        out[label] = {
            "loss_diff": max(abs(x - y) for x, y in zip(ref_l, our_l)),
            "norm_rel": max(abs(x - y) / x for x, y in zip(ref_n, our_n)),
            "clipped": min(ref_n) > 0.3,  # every step's norm was above the bound: clipping acted
            "param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "moved": max((a[k] - Net().state_dict()[k]).abs().max().item() for k in a),
        }
        if label == "for-loop":  # the norms torch's tools take, on gradients left in place
            for model, r, world in ((ref, 0, 1), (ours, rank, n)):
                x, y = _batch(STEPS, r, world)
                nn.functional.mse_loss(model(x), y).backward()
            grads = {k: [p.grad for p in m.parameters()] for k, m in (("ref", ref), ("ours", ours))}
            out["norms"] = {
                order: [float(torch.nn.utils.get_total_norm(grads[k], order)) for k in ("ref", "ours")]
                for order in (1.0, 2.0, float("inf"))
            }
            # one gradient's norm: completed over the ranks on first use (float())
            out["norms"]["emb.weight"] = [float(torch.linalg.vector_norm(m.emb.weight.grad)) for m in (ref, ours)]
            out["norms"]["head.weight.norm()"] = [m.head.weight.grad.norm().item() for m in (ref, ours)]
    # module.to() with torch's swap flag on: the pieces keep their description through the swap
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ref = Net().to(dev).double()
        ours = _shard(Net().to(dev), boundary).to(torch.float64)
        ref_l, ref_n = _train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 0, 1, 0.3, torch.float64)
        our_l, our_n = _train(
            ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), rank, n, 0.3, torch.float64
        )
        a, b = _full(ref), _full(ours)
        out["swap_double"] = {
            "loss_diff": max(abs(x - y) for x, y in zip(ref_l, our_l)),
            "norm_rel": max(abs(x - y) / x for x, y in zip(ref_n, our_n)),
            "param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
            "dtype": str(next(ours.parameters()).dtype),
        }
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before["swap_flag"])
    out["after"] = _torch_untouched()
    out["boundary"] = boundary
    return out


@pytest.fixture(
    scope="module", params=[(n, b) for n in WORLDS for b in BOUNDARIES], ids=lambda p: f"{p[0]}ranks-{p[1]}"
)
def results(request):
    n, boundary = request.param
    return run_ranks(contract, n, args=(boundary,), timeout_s=240)


def test_boundary_policy_places_pieces(results):
    """'rows': every rank's piece of a matrix is whole rows; 'params': every parameter is whole on
    one rank and absent from the others; every element is on exactly one rank."""
    boundary = results[0]["boundary"]
    names = results[0]["pieces"]
    for name, (_, shape) in names.items():
        here = [r["pieces"][name][0] for r in results]
        full = math.prod(shape)
        assert sum(here) == full, (name, here)
        if boundary == "rows" and len(shape) >= 2:
            assert all(k % math.prod(shape[1:]) == 0 for k in here), (name, here)
        if boundary == "params":
            assert sorted(here)[-1] == full and sum(1 for k in here if k) == 1, (name, here)


def test_nothing_of_torch_is_changed(results):
    """After sharding, building optimizers, stepping and clipping with torch's functions: torch's
    clipping functions are its own, no global optimizer hook exists, the future flags are as set."""
    for r in results:
        for state in (r["before"], r["after"]):
            assert state["clip_grad_norm_"] and state["_get_total_norm"] and state["get_total_norm"], state
            assert state["global_optimizer_hooks"] == 0, state
        assert r["after"]["swap_flag"] == r["before"]["swap_flag"], r
        assert r["after"]["overwrite_flag"] == r["before"]["overwrite_flag"], r


@pytest.mark.parametrize("variant", ["for-loop", "foreach", "fused"])
def test_torch_clip_and_adamw_match_one_process(results, variant):
    """torch's own clip_grad_norm_ returns the single-process norm on every rank and every step
    (each of which clips), and AdamW (for-loop, foreach, fused) then gives the single-process
    losses and weights after 5 steps."""
    for r in results:
        v = r[variant]
        assert v["clipped"], v
        assert v["norm_rel"] < TOL, v
        assert v["loss_diff"] < TOL and v["param_diff"] < TOL, v
        assert v["moved"] > 100 * TOL, v  # training moved the weights: the comparison means something


def test_total_norms_of_every_order_are_global(results):
    """torch.nn.utils.get_total_norm of orders 1, 2 and inf, and one gradient's vector_norm, on
    our pieces: the single-process values on every rank."""
    for r in results:
        for order, (ref, ours) in r["norms"].items():
            assert abs(ref - ours) <= TOL * ref, (order, ref, ours)


def test_swap_on_conversion_keeps_sharding(results):
    """`model.to(torch.float64)` with torch.__future__'s swap flag on (torch.utils.swap_tensors)
    gives float64 pieces that train and clip exactly as the float64 single process."""
    for r in results:
        v = r["swap_double"]
        assert v["dtype"] == "torch.float64", v
        assert v["norm_rel"] < 1e-12 and v["loss_diff"] < 1e-12 and v["param_diff"] < 1e-12, v


# ------------------------------ torch's state-dict functions + DCP, across world sizes and policies
def dcp_save(rank: int, n: int, where: str, boundary: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from framework.distributed.fsdp import prepare_optimizer

    model = _shard(Net(), boundary)
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    losses, _ = _train(model, opt, rank, n, clip=0.3, steps=range(2))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=where)
    return losses


def dcp_resume(rank: int, n: int, where: str, boundary: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from framework.distributed.fsdp import prepare_optimizer

    model = _shard(Net(), boundary)
    opt = prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.05))
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=where)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    losses, _ = _train(model, opt, rank, n, clip=0.3, steps=range(2, 4))
    ref = Net()  # the uninterrupted single-process run, for the weights
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), 0, 1, clip=0.3, steps=range(4))
    a, b = _full(ref), _full(model)
    return {"losses": losses, "param_diff": max((a[k] - b[k]).abs().max().item() for k in a)}


@pytest.mark.parametrize(
    "save,load",
    [((2, "anywhere"), (4, "params")), ((4, "rows"), (2, "anywhere")), ((2, "params"), (4, "rows"))],
    ids=lambda p: f"{p[0]}ranks-{p[1]}",
)
def test_dcp_resume_at_another_world_size_and_policy(tmp_path, save, load):
    """torch's get_model_state_dict / get_optimizer_state_dict saved with DCP under one world size
    and boundary policy, loaded with set_* under another, resume the single-process run exactly."""
    ref = Net()
    ref_losses, _ = _train(ref, torch.optim.AdamW(ref.parameters(), lr=0.05), 0, 1, clip=0.3, steps=range(4))
    first = run_ranks(dcp_save, save[0], args=(str(tmp_path / "ckpt"), save[1]), timeout_s=240)[0]
    rest = run_ranks(dcp_resume, load[0], args=(str(tmp_path / "ckpt"), load[1]), timeout_s=240)[0]
    losses = first + rest["losses"]
    assert max(abs(a - b) for a, b in zip(ref_losses, losses)) < TOL, (ref_losses, losses)
    assert rest["param_diff"] < TOL, rest
