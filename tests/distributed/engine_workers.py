"""Per-rank checks that run inside the spawned groups of test_engine_parity.py (this file holds
no tests itself: one spawn per world size keeps the suite fast, so the assertions live there).

Each function takes (rank, world_size, ckpt_dir) and returns {name: result}.
"""

from __future__ import annotations

import copy
import os
import time

import engine_models as M
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

CONT = 3  # steps before the checkpoint; the same number after it


def _ours(kind="gpt", reshard=True, **kw):
    return M.shard_model(M.make_model(kind), kind, "ours", None, reshard, **kw)


def _continue_and_compare(model, opt, rank, ws, engine):
    ref_losses, ref_params = M.reference("gpt", "adamw", 2 * CONT, M_GB, clip=None)
    losses = M.train_steps("gpt", model, opt, CONT, M_GB, rank, ws, start=CONT, engine=engine)
    fp = M.full_params(model)
    return {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses[CONT:])),
        "param_diff": max((fp[k] - ref_params[k]).abs().max().item() for k in ref_params),
    }


M_GB = 8


def _load_ours(path, rank, ws):
    from framework.distributed.fsdp import get_state_dicts, set_state_dicts

    model = _ours()
    opt = M.make_optimizer("adamw", model)
    msd, osd = get_state_dicts(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dicts(model, opt, sd["model"], sd["optim"])
    return _continue_and_compare(model, opt, rank, ws, "ours")


def _load_torch(path, rank, ws):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = M.shard_model(M.make_model("gpt"), "gpt", "torch", None, True)
    opt = M.make_optimizer("adamw", model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return _continue_and_compare(model, opt, rank, ws, "torch")


def dcp_save_2(rank, ws, d):
    """Save with both engines at 2 ranks, then load each into the other (and ours into ours)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from framework.distributed.fsdp import get_state_dicts

    out = {}
    for engine in ("ours", "torch"):
        model = M.shard_model(M.make_model("gpt"), "gpt", engine, None, True)
        opt = M.make_optimizer("adamw", model)
        M.train_steps("gpt", model, opt, CONT, M_GB, rank, ws, engine=engine)
        msd, osd = (get_state_dicts if engine == "ours" else get_state_dict)(model, opt)
        if engine == "ours":
            out["sd_format"] = {
                "model_types": sorted({type(v).__name__ for v in msd.values()}),
                "optim_keys": sorted(osd["state"]["blocks.0.fc.weight"].keys()),
                "group_params": osd["param_groups"][0]["params"][:3],
                "placements": str(msd["blocks.0.fc.weight"].placements),
                "shape": tuple(msd["blocks.0.fc.weight"].shape),
            }
        else:
            out["torch_sd_format"] = {
                "optim_keys": sorted(osd["state"]["blocks.0.fc.weight"].keys()),
                "group_params": osd["param_groups"][0]["params"][:3],
            }
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(d, engine))
    out["dcp_ours_to_ours_2"] = _load_ours(os.path.join(d, "ours"), rank, ws)
    out["dcp_ours_to_torch_2"] = _load_torch(os.path.join(d, "ours"), rank, ws)
    out["dcp_torch_to_ours_2"] = _load_ours(os.path.join(d, "torch"), rank, ws)
    return out


def dcp_load_4(rank, ws, d):
    return {"dcp_ours_to_ours_4": _load_ours(os.path.join(d, "ours"), rank, ws)}


def dcp_load_1(rank, ws, d):
    return {"dcp_ours_to_ours_1": _load_ours(os.path.join(d, "ours"), rank, ws)}


def _units(model):
    from framework.distributed.fsdp import sharded_units

    return sharded_units(model)


def bytes_and_memory(rank, ws, d):
    """Counters against the theory; per-rank tensor bytes against the sharded formula."""
    out = {}
    for reshard in (True, False) + ((2,) if ws == 4 else ()):
        model = _ours(reshard=reshard)
        opt = M.make_optimizer("sgd", model)
        M.train_steps("gpt", model, opt, 2, M_GB, rank, ws)
        pool_before = sorted(id(b) for bufs in model._fsdp_unit.ctx._pool.values() for b in bufs)
        model.reset_comm_stats()
        tic = time.perf_counter()
        M.train_steps("gpt", model, opt, 3, M_GB, rank, ws, start=2)
        wall = time.perf_counter() - tic
        pool_after = sorted(id(b) for bufs in model._fsdp_unit.ctx._pool.values() for b in bufs)
        st = model.comm_stats()
        units = _units(model)
        N = ws
        gathers = lambda u, root=model._fsdp_unit, reshard=reshard: 1 if (u is root or not reshard) else 2
        if reshard is True or reshard is False:
            exp_ag = 3 * sum((N - 1) * u.layout.shard_numel * 4 * gathers(u) for u in units)
        else:  # hpZ: forward over N ranks, backward over k ranks from the N S / k secondary shard
            k = reshard
            exp_ag = 3 * sum((N - 1) * u.layout.shard_numel * 4 for u in units) + 3 * sum(
                (k - 1) * (u.layout.padded_total // k) * 4 for u in units if u is not model._fsdp_unit
            )
        exp_rs = 3 * sum((N - 1) * u.layout.shard_numel * 4 for u in units)
        # memory between steps: one more step without zero_grad so grads exist
        x, y = M.make_batch("gpt", 9, M_GB)
        per = M_GB // ws
        M.loss_fn("gpt", model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]).backward()
        opt.step()
        owned = sum(
            max(0, min(u.layout.shard_numel, u.layout.total - u.layout.rank * u.layout.shard_numel)) for u in units
        )
        trainable = sum(e.local_numel for u in units for e in u.trainable)
        total = sum(u.layout.total for u in units)
        out[f"counters_reshard={reshard}"] = {
            "ag": st["allgather_bytes"],
            "exp_ag": exp_ag,
            "rs": st["reduce_scatter_bytes"],
            "exp_rs": exp_rs,
            "ar": st["allreduce_bytes"],
            "exposed": st["exposed_comm_s"],
            "wall": wall,
            "n": st["num_collectives"],
            "exp_n": 3 * sum(gathers(u) + 1 for u in units),
            "pool_stable": pool_before == pool_after,
        }
        out[f"memory_reshard={reshard}"] = {
            "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
            "optim_bytes": sum(
                v.numel() * v.element_size()
                for s in opt.state.values()
                for v in s.values()
                if isinstance(v, torch.Tensor)
            ),
            "exp_param_bytes": owned * 4,
            "exp_trainable_bytes": trainable * 4,
            "owned": owned,
            "bound": -(-total // ws) + len(units),
            "unsharded_bytes": sum(u.tensor_bytes()["unsharded"] + u.tensor_bytes()["secondary"] for u in units),
        }
    return out


def no_sync_is_silent(rank, ws, d):
    """Micro-steps under set_requires_gradient_sync(False) issue no gradient communication."""
    model = _ours()
    x, y = M.make_batch("gpt", 0, M_GB)
    model.set_requires_gradient_sync(False)
    model.reset_comm_stats()
    M.loss_fn("gpt", model, x, y).backward()
    micro = model.comm_stats()
    model.set_requires_gradient_sync(True)
    model.reset_comm_stats()
    M.loss_fn("gpt", model, x, y).backward()
    sync = model.comm_stats()
    # eval forward under no_grad: same output as the plain model, everything resharded after it,
    # and training continues normally afterwards
    plain = M.make_model("gpt")
    model.zero_grad(set_to_none=True)
    fresh = _ours()
    with torch.no_grad():
        diff = (fresh(x) - plain(x)).abs().max().item()
    units = _units(fresh)
    resharded = all(u.state.value == "sharded" for u in units)
    opt = M.make_optimizer("sgd", fresh)
    after = M.train_steps("gpt", fresh, opt, 1, M_GB, rank, ws)
    return {
        "no_sync": {
            "micro_rs": micro["reduce_scatter_bytes"] + micro["allreduce_bytes"],
            "sync_rs": sync["reduce_scatter_bytes"],
        },
        "eval": {"diff": diff, "resharded": resharded, "loss_after": after[0]},
    }


def errors(rank, ws, d):
    """Each bad input must raise the named error with a message that says the fix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from framework.distributed.fsdp import CPUOffloadPolicy, QuantizedCommPolicy, fully_shard

    cases = {}

    def expect(name, exc, words, fn):
        try:
            fn()
            cases[name] = "no error raised"
        except exc as e:  # noqa: PERF203
            msg = str(e)
            cases[name] = "ok" if all(w in msg for w in words) else f"message lacks {words}: {msg}"
        except Exception as e:  # noqa: BLE001
            cases[name] = f"wrong type {type(e).__name__}: {e}"

    def twice():
        m = M.make_model("mlp")
        fully_shard(m)
        fully_shard(m)

    def tied_split():
        m = M.make_model("gpt")
        fully_shard(m.head)
        fully_shard(m)

    def dtensor_param():
        m = torch.nn.Linear(4, 4)
        mesh = init_device_mesh("cpu", (ws,))
        m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
        fully_shard(m)

    expect("sharded_twice", ValueError, ["already sharded", "once per module"], twice)
    expect(
        "mesh_3d",
        ValueError,
        ["1-D", "2-D"],
        lambda: fully_shard(M.make_model("mlp"), mesh=init_device_mesh("cpu", (1, 1, ws))),
    )
    expect(
        "hpz_int_not_dividing",
        ValueError,
        ["reshard_after_forward", "divide"],
        lambda: fully_shard(M.make_model("mlp"), reshard_after_forward=ws + 1),
    )
    expect(
        "offload_and_quant",
        NotImplementedError,
        ["CPUOffloadPolicy", "QuantizedCommPolicy"],
        lambda: fully_shard(M.make_model("mlp"), offload_policy=CPUOffloadPolicy(), comm_policy=QuantizedCommPolicy()),
    )
    expect("tied_across_units", ValueError, ["tied", "one unit"], tied_split)
    expect("tp_mesh_size_mismatch", ValueError, ["tp mesh size", "world size"], dtensor_param)
    expect("bad_block", ValueError, ["block_size"], lambda: QuantizedCommPolicy(block_size=3))
    return {"errors": cases}


def quantized(rank, ws, d):
    """int8 all-gather + all-to-all gradient reduction: loss stays near the fp32 run; bytes shrink."""
    from framework.distributed.fsdp import QuantizedCommPolicy

    res = {}
    losses = {}
    for q in (False, True):
        kw = {"comm_policy": QuantizedCommPolicy()} if q else {}
        model = _ours(**kw)
        opt = M.make_optimizer("adamw", model)
        model.reset_comm_stats()
        losses[q] = M.train_steps("gpt", model, opt, 10, M_GB, rank, ws)
        st = model.comm_stats()
        if q:
            units = _units(model)
            bf16_ag = 10 * sum((ws - 1) * u.layout.shard_numel * 2 * (1 if u is model._fsdp_unit else 2) for u in units)
            bf16_rs = 10 * sum((ws - 1) * u.layout.shard_numel * 2 for u in units)
            res["ag_ratio_vs_bf16"] = st["allgather_bytes"] / bf16_ag
            res["grad_ratio_vs_bf16"] = (st["alltoall_bytes"] + st["reduce_scatter_bytes"]) / bf16_rs
    res["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses[True], losses[False]))
    res["final_loss"] = (losses[False][-1], losses[True][-1])
    return {"quantized": res}


def mixed_precision(rank, ws, d):
    """bf16 compute with fp32 and with bf16 reduction: ours vs torch's fully_shard, same policy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP

    from framework.distributed.fsdp import MixedPrecisionPolicy

    res = {}
    for reduce in (torch.float32, torch.bfloat16):
        out = {}
        policies = (("ours", MixedPrecisionPolicy(torch.bfloat16, reduce)), ("torch", TorchMP(torch.bfloat16, reduce)))
        for engine, mp in policies:
            model = M.shard_model(M.make_model("gpt"), "gpt", engine, None, True, mp_policy=mp)
            opt = M.make_optimizer("sgd", model)
            out[engine] = M.train_steps("gpt", model, opt, 5, M_GB, rank, ws, engine=engine)
            out[engine + "_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        out["max_diff"] = max(abs(a - b) for a, b in zip(out["ours"], out["torch"]))
        res[str(reduce)] = out
    return {"mixed_precision": res}


# ---------------------------------------------------------------- tensor parallel composition
class _TPBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 18)  # ColwiseParallel: weight Shard(0), bias Shard(0)
        self.fc2 = torch.nn.Linear(18, 12)  # RowwiseParallel: weight Shard(1), bias Replicate

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _TPNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(5, 12)
        self.blocks = torch.nn.ModuleList(_TPBlock() for _ in range(2))
        self.ln = torch.nn.LayerNorm(12)
        self.out = torch.nn.Linear(12, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(self.ln(h))


def _tp_batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 1, generator=g)


def _tp_train(model, opt, steps, start, dp_rank, dp, dp_group, clip, engine_clip):
    losses = []
    per = 8 // dp
    for s in range(start, start + steps):
        x, y = _tp_batch(s)
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        engine_clip(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1).double()
        if dp_group is not None:
            dist.all_reduce(t, group=dp_group)
        losses.append(float(t) / dp)
    return losses


def tp_compose_4(rank, ws, d):
    """tp=2 x dp=2: TP-parallelized blocks, then fully_shard over dp; vs a single-process reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from framework.distributed.fsdp import clip_grad_norm_, fully_shard, get_state_dicts, set_state_dicts

    torch.manual_seed(0)
    ref = _TPNet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_losses = _tp_train(ref, ref_opt, 8, 0, 0, 1, None, 0.5, torch.nn.utils.clip_grad_norm_)
    world = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("dp", "tp"))
    for b in model.blocks:
        parallelize_module(b, world["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(b, mesh=world["dp"])
    fully_shard(model, mesh=world["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dp_rank, dp_group = world["dp"].get_local_rank(), world["dp"].get_group()
    losses = _tp_train(model, opt, 5, 0, dp_rank, 2, dp_group, 0.5, clip_grad_norm_)
    msd, osd = get_state_dicts(model, opt)
    saved = {k: v.to_local().clone() if isinstance(v, DTensor) else v for k, v in msd.items()}
    saved_opt = {
        k: {kk: vv.to_local().clone() if isinstance(vv, DTensor) else vv for kk, vv in st.items()}
        for k, st in osd["state"].items()
    }
    losses += _tp_train(model, opt, 3, 5, dp_rank, 2, dp_group, 0.5, clip_grad_norm_)
    sd = model.state_dict()
    full = {k: v.full_tensor() for k, v in sd.items()}
    out = {
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "param_diff": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
        "placements": {
            k: (str(v.placements), v.device_mesh.mesh_dim_names)
            for k, v in sd.items()
            if k.startswith("blocks.0.") or k == "ln.weight"
        },
    }
    # reload the step-5 state (in place into fresh DTensors) and replay steps 5..7: same losses
    for k, v in msd.items():
        v.to_local().copy_(saved[k])
    for k, st in osd["state"].items():
        for kk, vv in st.items():
            if isinstance(vv, DTensor):
                vv.to_local().copy_(saved_opt[k][kk])
    set_state_dicts(model, opt, msd, osd)
    replay = _tp_train(model, opt, 3, 5, dp_rank, 2, dp_group, 0.5, clip_grad_norm_)
    out["replay_diff"] = max(abs(a - b) for a, b in zip(replay, losses[5:]))
    return {"tp": out}


EXTRAS_2 = [dcp_save_2, bytes_and_memory, no_sync_is_silent, errors, quantized, mixed_precision]
EXTRAS_4 = [dcp_load_4, bytes_and_memory, tp_compose_4]
EXTRAS_1 = [dcp_load_1]


def move_and_meta(rank, ws, d):
    """`.to()` after sharding keeps training right; a model sharded on the meta device, then
    `to_empty` + `load_state_dict` of plain full weights, trains like the reference."""
    ref_losses, ref_params = M.reference("gpt", "sgd", 4, M_GB)
    out = {}
    model = _ours()
    model.to(torch.float64).to(torch.float32)  # rebinds twice; values survive the round trip
    opt = M.make_optimizer("sgd", model)
    losses = M.train_steps("gpt", model, opt, 4, M_GB, rank, ws)
    out["moved_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    with torch.device("meta"):
        torch.manual_seed(0)
        meta = M.TinyGPT()
    M.shard_model(meta, "gpt", "ours", None, True)
    meta.to_empty(device="cpu")
    plain = M.make_model("gpt")
    meta.load_state_dict(plain.state_dict())
    opt = M.make_optimizer("sgd", meta)
    losses = M.train_steps("gpt", meta, opt, 4, M_GB, rank, ws)
    fp = M.full_params(meta)
    out["meta_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    out["meta_param_diff"] = max((fp[k] - ref_params[k]).abs().max().item() for k in ref_params)
    return {"move_meta": out}


EXTRAS_2.append(move_and_meta)
