"""`optimizer_step(opt)`: an elementwise optimizer steps our sharded parameters on their plain local
data ([Note: the optimizer step on plain local data] in framework/distributed/fsdp/optim_check.py),
bit for bit as `opt.step()` does, and leaves the parameters, gradients and state the pieces they
were; an optimizer that may take a norm, or a step that creates state, runs as `opt.step()`."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tests.distributed.harness import run_ranks
from tests.distributed.test_torch_contract import Net, _batch, _shard

VARIANTS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def _optimizer(name, params):
    """torch's AdamW in each form, and ours with bfloat16 state (`elementwise_step = True`)."""
    if name == "bf16 state":
        from framework.optim.lowp import AdamWLowState

        return AdamWLowState(params, lr=1e-2, weight_decay=0.1, seed=7)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **VARIANTS[name])


OPTIMIZERS = [*VARIANTS, "bf16 state"]


class _NormSGD(torch.optim.SGD):
    """SGD that scales each step by the gradient's norm: a subclass of an elementwise optimizer that
    is not elementwise (its norm must stay global)."""

    seen: list

    @torch.no_grad()
    def step(self, closure=None):
        self.seen = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    norm = torch.linalg.vector_norm(p.grad)
                    self.seen.append(float(norm))
                    p.add_(p.grad, alpha=-group["lr"] / (1.0 + float(norm)))
        return None


def _steps(model, opt, rank, n, step_fn, steps=5, frozen_until=0):
    """`steps` training steps, stepping with `step_fn(opt)`; the head is frozen (no gradient)
    until step `frozen_until`."""
    for step in range(steps):
        model.head.weight.requires_grad_(step >= frozen_until)
        x, y = _batch(step, rank, n)
        nn.functional.mse_loss(model(x), y).backward()
        step_fn(opt)
        opt.zero_grad(set_to_none=True)


def _plain_step_ranks(rank, n):
    from framework.distributed.fsdp import ShardPiece, optimizer_step

    out = {}
    for name in OPTIMIZERS:
        a, b = _shard(Net()), _shard(Net())
        opt_a, opt_b = _optimizer(name, a.parameters()), _optimizer(name, b.parameters())
        # the head gets its first gradient at step 3: its state is made then, as pieces (and its
        # step count differs from the others' from then on)
        _steps(a, opt_a, rank, n, optimizer_step, frozen_until=3)
        _steps(b, opt_b, rank, n, lambda o: o.step(), frozen_until=3)
        same = all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(a.parameters(), b.parameters()))
        for p, q in zip(a.parameters(), b.parameters()):
            for k in ("exp_avg", "exp_avg_sq"):
                same = same and torch.equal(opt_a.state[p][k].to_local(), opt_b.state[q][k].to_local())
        kinds = {type(t).__name__ for st in opt_a.state.values() for k, t in st.items() if k != "step"}
        kinds |= {type(p).__name__ for p in a.parameters()}
        out[name] = {
            "bit_equal": same,
            "kinds": sorted(kinds),
            "states": len(opt_a.state),
            "params": len(list(a.parameters())),
        }
        assert all(isinstance(p, ShardPiece) for p in a.parameters())
    # a subclass that takes a norm runs as opt.step(): its norms are global
    model = _shard(Net())
    ref = copy.deepcopy(Net())
    opt = _NormSGD(model.parameters(), lr=0.1)
    for p in model.parameters():  # state made: only the optimizer's type keeps it off the plain path
        opt.state[p]["calls"] = torch.zeros(())
    x, y = _batch(0, rank, n)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer_step(opt)
    out["norms"] = opt.seen
    xs, ys = zip(*(_batch(0, r, n) for r in range(n)))
    # one process's mean over the global batch = the mean of the ranks' means (equal shares)
    nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
    out["ref_norms"] = [float(torch.linalg.vector_norm(p.grad)) for p in ref.parameters()]
    # an exception inside the step leaves the subclass's __torch_function__ on
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # state made
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = "not a number"
    try:
        optimizer_step(opt)
        out["raised"] = False
    except TypeError:
        out["raised"] = True
    out["torch_function_on"] = torch._C._is_torch_function_enabled()
    out["piece_norm_partial"] = type(torch.linalg.vector_norm(next(model.parameters()))).__name__
    return out


def test_optimizer_step_on_plain_data_is_bit_equal_and_keeps_the_pieces():
    for r in run_ranks(_plain_step_ranks, 2, timeout_s=240):
        for name in OPTIMIZERS:
            assert r[name]["bit_equal"], (name, r[name])
            assert r[name]["kinds"] == ["ShardPiece"], (name, r[name])  # parameters and state
            assert r[name]["states"] == r[name]["params"] == 10, (name, r[name])  # the head's too, made at step 3
        assert len(r["norms"]) == len(r["ref_norms"])
        for got, want in zip(r["norms"], r["ref_norms"]):
            assert abs(got - want) <= 1e-6 * max(1.0, want), (r["norms"], r["ref_norms"])
        assert r["raised"] and r["torch_function_on"] and r["piece_norm_partial"] == "PartialNorm", r
