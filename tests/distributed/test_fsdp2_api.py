"""FSDP2's public API on our engine, in PyTorch's FSDP2 test style: each case trains a small model
sharded with our `fully_shard` on 4 gloo ranks and compares it with the same model, from the same
weights, in one process on the global batch (SGD with momentum), or checks the collectives the
API promises. All cases run in ONE spawned process group; a case that raises records its
traceback and the others still run. Tolerance: TOL of test_fsdp2_behaviours.py (1e-5 in fp32,
reduction order only); float64 runs are closer still.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.harness import passed, recorded, records_of, run_ranks
from tests.distributed.test_fsdp2_behaviours import (
    GB,
    STEPS,
    TOL,
    Deep,
    _batch,
    _compare,
    _fs,
    _global_mean,
    _mse,
    _ok,
    _sgd,
    _snapshot,
    _train,
)

pytestmark = pytest.mark.timeout(600)
N = 4


def _shard_deep(m, **kw):
    for lin in m.layers:
        _fs(lin, **kw)
    return _fs(m, **kw)


def _parity(shard, build=Deep, **kw) -> dict:
    rank, n = dist.get_rank(), dist.get_world_size()
    ref = build()
    init = _snapshot(ref)
    ref_losses = _train(ref, _mse, torch.device("cpu"), 0, 1, **kw)
    ours = shard(build())
    our_losses = _train(ours, _mse, torch.device("cpu"), rank, n, **kw)
    return _compare(init, ref, ours, ref_losses, our_losses)


# ------------------------------------------------------------------------------------- names
def c_names_and_offload_policy(rank, n):
    from framework.distributed.fsdp import FSDPModule, OffloadPolicy, UnshardHandle

    out = _parity(lambda m: _shard_deep(m, offload_policy=OffloadPolicy()))
    m = _shard_deep(Deep())
    out["isinstance"] = [isinstance(m, FSDPModule), isinstance(m.layers[0], FSDPModule), isinstance(m.head, FSDPModule)]
    handle = m.layers[0].unshard(async_op=True)
    out["handle"] = type(handle) is UnshardHandle
    handle.wait()
    m.layers[0].reshard()
    return out


# ------------------------------------------------------------------- unshard / reshard by hand
def c_unshard_async_and_reshard(rank, n):
    ref, m = Deep(), _shard_deep(Deep())
    layer = m.layers[1]
    before = tuple(layer[0].weight.shape)  # the sharded piece: 1-D
    handle = layer.unshard(async_op=True)
    handle.wait()
    gathered = layer[0].weight.detach().clone()  # the module now computes with the full weight
    layer.reshard()
    after = tuple(layer[0].weight.shape)
    out = _parity(_shard_deep)
    out.update(
        before=before,
        after=after,
        full_equal=torch.equal(gathered, ref.layers[1][0].weight.detach()),
    )
    return out


# ----------------------------------------------------------------- register_fsdp_forward_method
class Generator(Deep):
    @torch.no_grad()
    def generate(self, x, steps: int = 3):
        """Feeds the model its own output: several forwards inside one method."""
        outs = []
        for _ in range(steps):
            y = self(x)
            outs.append(y)
            x = x + y  # broadcast over the width: a new input each round
        return torch.cat(outs, dim=1)


def c_forward_method(rank, n):
    from framework.distributed.fsdp import register_fsdp_forward_method

    ref, ours = Generator(), _shard_deep(Generator())
    register_fsdp_forward_method(ours, "generate")
    x, _ = _batch(0, torch.device("cpu"), rank, n)
    ours.reset_comm_stats()
    got = ours.generate(x)
    expected = ref.generate(x)
    gathers = ours.comm_stats()["allgather_bytes"]
    # the method's output trains like forward's afterwards
    out = _parity(_shard_deep, build=Generator)
    out.update(
        diff=(got - expected).abs().max().item(), gathers=gathers, resharded=ours.layers[0]._fsdp_unit.state.value
    )
    return out


# ----------------------------------------------------------------------------- ignored_params
def c_ignored_params(rank, n):
    ref, ours = Deep(), Deep()
    ignored = ours.head.weight
    _shard_deep(ours, ignored_params={ignored})
    x, y = _batch(0, torch.device("cpu"), rank, n)
    _mse(ours, 0, x, y).backward()
    # the reference on this rank's rows alone: an ignored parameter's gradient is not reduced
    _mse(ref, 0, x, y).backward()
    return {
        "shape": tuple(ignored.shape),
        "same_object": ours.head.weight is ignored,
        "grad_is_local": torch.allclose(ignored.grad, ref.head.weight.grad, atol=1e-6),
        "names": sorted(k for k, p in ours.named_parameters() if p.dim() == 2),
    }


# ---------------------------------------------------------------- reshard_after_forward at run time
def c_reshard_after_forward(rank, n):
    from framework.distributed.fsdp import UnitState

    seen = {}

    def shard(m):
        _shard_deep(m)
        m.layers[0].set_reshard_after_forward(False)  # ZeRO-2 for one block
        m.set_reshard_after_forward(True, recurse=False)  # the root frees after forward too

        def probe(mod, a, o):
            units = (mod.layers[0], mod, mod.layers[1])
            seen.setdefault("after_forward", [u._fsdp_unit.state for u in units])

        m.register_forward_hook(probe)
        return m

    out = _parity(shard)
    s = seen["after_forward"]
    out["states"] = [u == UnitState.UNSHARDED for u in s]
    return out


# ------------------------------------------------------------------- set_gradient_divide_factor
def c_gradient_divide_factor(rank, n):
    from framework.distributed.fsdp import clip_grad_norm_

    norms = {}
    for factor in (None, 1.0):
        m = _shard_deep(Deep())
        if factor is not None:
            m.set_gradient_divide_factor(factor)
        x, y = _batch(0, torch.device("cpu"), rank, n)
        _mse(m, 0, x, y).backward()
        norms[factor] = clip_grad_norm_(m.parameters(), 1e9).item()
    return {"ratio": norms[1.0] / norms[None]}


# ------------------------------------------------- HSDP: set_requires_all_reduce for accumulation
def c_requires_all_reduce(rank, n):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    counts = []

    def shard(m):
        return _shard_deep(m, mesh=mesh)

    rank_, n_ = dist.get_rank(), dist.get_world_size()
    ref, ours = Deep(), shard(Deep())
    init = _snapshot(ref)
    opts = [_sgd(ref.parameters()), _sgd(ours.parameters())]
    ref_losses, our_losses = [], []
    for step in range(STEPS):
        x, y = _batch(step, torch.device("cpu"), rank_, n_)
        xr, yr = _batch(step, torch.device("cpu"))
        half = x.shape[0] // 2
        total = 0.0
        for micro in range(2):
            ours.set_requires_all_reduce(micro == 1)
            ours.reset_comm_stats()
            loss = _mse(ours, step, x[micro * half : (micro + 1) * half], y[micro * half : (micro + 1) * half]) / 2
            loss.backward()
            counts.append(ours.comm_stats()["allreduce_bytes"] > 0)
            total += float(loss)
        ref_total = 0.0
        for micro in range(2):
            rows = [r * (GB // n_) + micro * half + i for r in range(n_) for i in range(half)]
            lr = _mse(ref, step, xr[rows], yr[rows]) / 2
            lr.backward()
            ref_total += float(lr)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        our_losses.append(_global_mean(total, n_))
        ref_losses.append(ref_total)
    out = _compare(init, ref, ours, ref_losses, our_losses)
    out["all_reduced"] = counts
    return out


# ------------------------------------------------ set_reshard_after_backward for accumulation
def c_reshard_after_backward(rank, n):
    from framework.distributed.fsdp import UnitState

    ours = _shard_deep(Deep())
    ours.set_reshard_after_backward(False)
    ours.set_requires_gradient_sync(False)
    x, y = _batch(0, torch.device("cpu"), rank, n)
    _mse(ours, 0, x, y).backward()
    kept = [u.state == UnitState.UNSHARDED for u in ours._units()]
    ours.reset_comm_stats()
    with torch.no_grad():
        ours(x)
    gathers_next_forward = ours.comm_stats()["allgather_bytes"]
    ours.set_reshard_after_backward(True)
    ours.set_requires_gradient_sync(True)
    for u in ours._units():
        u.reshard()
    out = _parity(lambda m: _accumulating(m), accum=2)
    out.update(kept=kept, gathers_next_forward=gathers_next_forward)
    return out


def _accumulating(m):
    """A model whose units keep their parameters between the micro-steps of an accumulation and
    free them after the last (FSDP2's recipe: the user sets it back before the optimizer step)."""
    _shard_deep(m)
    plain = m.set_requires_gradient_sync

    def sync(flag, *, recurse=True):
        plain(flag, recurse=recurse)
        m.set_reshard_after_backward(flag)

    m.set_requires_gradient_sync = sync
    return m


# --------------------------------------------------------- fully_shard([m1, m2]): one unit
def c_module_group(rank, n):
    from framework.distributed.fsdp import FSDPModule, UnitState

    seen = []

    def shard(m):
        group = [m.layers[0], m.head]  # not adjacent: gathered from layers.0 until the head has run
        returned = _fs(group)
        for lin in m.layers[1:]:
            _fs(lin)
        _fs(m)
        m.layers[2].register_forward_pre_hook(lambda mod, a: seen.append(m.layers[0]._fsdp_unit.state))
        assert returned is group
        return m

    out = _parity(shard)
    m = shard(Deep())
    out["one_unit"] = m.layers[0]._fsdp_unit is m.head._fsdp_unit and len(m._units()) == 5
    out["isinstance"] = isinstance(m.head, FSDPModule)
    out["gathered_in_between"] = all(s == UnitState.UNSHARDED for s in seen[:STEPS]) and len(seen) >= STEPS
    x, y = _batch(0, torch.device("cpu"), rank, n)
    m.reset_comm_stats()
    _mse(m, 0, x, y).backward()
    out["collectives"] = m.comm_stats()["num_collectives"]
    return out


# ------------------------------------------- a dp mesh over part of the world (pp x dp)
def c_submesh_of_a_pipeline_mesh(rank, n):
    """A (pp=2, dp=2) mesh: each pipeline stage shards its model over its own 2 ranks (FSDP2
    accepts a dp submesh). Stage s trains on inputs scaled by 1 + s, so a reduction that crossed
    stages would mix the two and miss the reference."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("pp", "dp"))
    stage, dp_rank, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), n // 2
    dev = torch.device("cpu")
    ref, ours = Deep(), _shard_deep(Deep(), mesh=mesh["dp"])
    init = _snapshot(ref)
    worst_loss = 0.0
    for model, r, world in ((ref, 0, 1), (ours, dp_rank, dp)):
        opt = _sgd(model.parameters())
        for step in range(STEPS):
            x, y = _batch(step, dev, r, world)
            loss = _mse(model, step, x * (1 + stage), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if model is ref:
                model._losses = getattr(model, "_losses", []) + [float(loss)]
            else:
                t = torch.tensor([float(loss)], dtype=torch.float64)
                dist.all_reduce(t, group=mesh["dp"].get_group())
                worst_loss = max(worst_loss, abs(float(t) / dp - ref._losses[step]))
    names = [k for k, _ in ref.named_parameters()]
    full = {k: v.full_tensor() for k, v in ours.state_dict().items() if k in names}
    return {
        "loss_diff": worst_loss,
        "param_diff": max((full[k] - ref.state_dict()[k]).abs().max().item() for k in names),
        "params_moved": max((ref.state_dict()[k] - init[k]).abs().max().item() for k in names),
    }


# ------------------------------------------------------- mixed precision next to torch's FSDP2
MP_D = 64


def _mp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(MP_D, MP_D), nn.ReLU(), nn.Linear(MP_D, MP_D), nn.ReLU(), nn.Linear(MP_D, 1))


def _mp_rows(rank, n):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, MP_D, generator=g), torch.randn(16, 1, generator=g)
    per = 16 // n
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _mp_grads(fully_shard, policy, rank, n) -> dict:
    """The reduced gradient of one step, read back whole: SGD with lr 1 moves each parameter by it."""
    m = _mp_model()
    for i in (0, 2, 4):
        fully_shard(m[i], mp_policy=policy)
    fully_shard(m, mp_policy=policy)
    x, y = _mp_rows(rank, n)
    ((m(x).float() - y) ** 2).mean().backward()
    whole = lambda: {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in m.state_dict().items()
    }
    before = whole()
    torch.optim.SGD(m.parameters(), lr=1.0).step()
    after = whole()
    return {k: before[k] - after[k] for k in before}


def c_mixed_precision_next_to_fsdp2(rank, n):
    """Gradients of bf16/fp16 compute with fp32 or bf16 reduction: ours, torch's fully_shard and
    the one-process run in the same compute dtype on the whole batch (what one GPU computes)."""
    from torch.distributed import fsdp as torch_fsdp

    from framework.distributed import fsdp as ours

    out = {}
    for pdt, rdt in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)):
        g_ours = _mp_grads(ours.fully_shard, ours.MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=rdt), rank, n)
        g_torch = _mp_grads(
            torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=rdt), rank, n
        )
        ref = _mp_model().to(pdt)
        x, y = _mp_rows(0, 1)
        ((ref(x.to(pdt)).float() - y) ** 2).mean().backward()
        g_ref = {k: p.grad.float() for k, p in ref.named_parameters()}

        def rel(a, b):
            return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in b)

        out[f"{pdt}/{rdt}"] = {
            "ours_ref": rel(g_ours, g_ref),
            "torch_ref": rel(g_torch, g_ref),
            "ours_torch": rel(g_ours, g_torch),
        }
    return out


# ------------------------------------- torch's distributed state-dict API on our optimizer
def c_dcp_state_dict_api(rank, n):
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict (what DCP users call)
    on a model of ours: the state comes out as DTensors of each parameter's full shape, saves with
    DCP, and loads into a fresh model and optimizer that then train exactly as the original."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    from framework.distributed.fsdp import prepare_optimizer

    dev = torch.device("cpu")

    def steps(model, opt, first, count):
        losses = []
        for step in range(first, first + count):
            x, y = _batch(step, dev, rank, n)
            loss = _mse(model, step, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(_global_mean(float(loss), n))
        return losses

    shapes = {k: tuple(v.shape) for k, v in Deep().named_parameters()}
    ours = _shard_deep(Deep())
    opt = prepare_optimizer(torch.optim.AdamW(ours.parameters(), lr=0.01))
    steps(ours, opt, 0, 2)
    osd = get_optimizer_state_dict(ours, opt)
    kinds = sorted(
        {
            (k, isinstance(v, DTensor) and tuple(v.shape) == shapes[fqn])
            for fqn, st in osd["state"].items()
            for k, v in st.items()
        }
    )
    where = [tempfile.mkdtemp(prefix="dcp-api-") if rank == 0 else None]
    dist.broadcast_object_list(where)
    dcp.save({"model": get_model_state_dict(ours), "optim": osd}, checkpoint_id=where[0])
    fresh = _shard_deep(Deep())
    fresh_opt = prepare_optimizer(torch.optim.AdamW(fresh.parameters(), lr=0.01))
    sd = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(sd, checkpoint_id=where[0])
    set_model_state_dict(fresh, sd["model"])
    set_optimizer_state_dict(fresh, fresh_opt, sd["optim"])
    go_on, loaded = steps(ours, opt, 2, 2), steps(fresh, fresh_opt, 2, 2)
    a, b = ours.state_dict(), fresh.state_dict()
    return {
        "kinds": kinds,
        "loss_diff": max(abs(x - y) for x, y in zip(go_on, loaded)),
        "param_diff": max((a[k].full_tensor() - b[k].full_tensor()).abs().max().item() for k in shapes),
        "pieces_stay_local": all(
            not isinstance(v, DTensor) for st in opt.state.values() for v in st.values()
        ),  # the optimizer's own state is untouched by state_dict()
    }


# ------------------------------------------------------------------------- shard_placement_fn
def c_shard_placement_fn(rank, n):
    """Mirrors torch's `test_train_parity_single_group_shard_largest_dim` and
    `test_dp_state_dict_save_load_shard_placement_fn`: every matrix placed on its last dim
    (Shard(-1)), biases on the default: training equals one process; the model's and the
    optimizer's state dicts (torch's functions) give Shard(1) DTensors chunked as torch.chunk;
    a DCP checkpoint saved so loads into a model with the default placement, and back."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import Shard

    from framework.distributed.fsdp import prepare_optimizer

    def last_dim(p):
        return Shard(-1) if p.dim() == 2 else None

    out = _parity(lambda m: _shard_deep(m, shard_placement_fn=last_dim))
    ref = Deep()
    placed = _shard_deep(Deep(), shard_placement_fn=last_dim)
    opt = prepare_optimizer(torch.optim.AdamW(placed.parameters(), lr=0.01))
    x, y = _batch(0, torch.device("cpu"), rank, n)
    _mse(placed, 0, x, y).backward()
    opt.step()
    sd = get_model_state_dict(placed)
    out["placements"] = {k: [str(p) for p in v.placements] for k, v in sd.items()}
    want_local = {k: tuple(t.chunk(n, dim=1)[rank].shape) for k, t in ref.state_dict().items() if k.endswith("weight")}
    out["local_shapes_ok"] = all(
        tuple(v.to_local().shape) == want_local[k] for k, v in sd.items() if k.endswith("weight")
    )
    osd = get_optimizer_state_dict(placed, opt)
    out["optim_placements"] = sorted(
        {str(v.placements[0]) for st in osd["state"].values() for k, v in st.items() if k == "exp_avg"}
    )
    where = [tempfile.mkdtemp(prefix="dcp-placement-") if rank == 0 else None]
    dist.broadcast_object_list(where)
    dcp.save(sd, checkpoint_id=where[0])
    plain = _shard_deep(Deep())
    with torch.no_grad():
        for p in plain.parameters():
            p.zero_()
    plain_sd = get_model_state_dict(plain)
    dcp.load(plain_sd, checkpoint_id=where[0])
    set_model_state_dict(plain, plain_sd)
    full = {k: v.full_tensor() for k, v in sd.items()}
    out["default_loaded_diff"] = max(
        (v.full_tensor() - full[k]).abs().max().item() for k, v in plain.state_dict().items()
    )
    again = _shard_deep(Deep(), shard_placement_fn=last_dim)
    again.load_state_dict(plain.state_dict())
    out["placed_loaded_diff"] = max(
        (v.full_tensor() - full[k]).abs().max().item() for k, v in again.state_dict().items()
    )
    out["moved"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


# ----------------------------------------------------------------------------- refusals
def c_refusals(rank, n):
    out = {}
    try:  # False is FSDP2's and works (test_fsdp2_behaviours.py); a non-bool is refused
        _shard_deep(Deep()).layers[0].set_unshard_in_backward("no")
    except ValueError as exc:
        out["unshard_in_backward"] = str(exc)
    try:
        from torch.distributed.tensor import Replicate

        _fs(Deep().layers[0], shard_placement_fn=lambda p: Replicate())
    except ValueError as exc:
        out["shard_placement_fn"] = str(exc)
    m = _shard_deep(Deep())
    m.set_is_last_backward(True)  # accepted: nothing to defer
    return out


# ----------------------------------------------------------------------------- reset_iter_state
def c_reset_iter_state(rank, n):
    ours = _shard_deep(Deep())
    x, y = _batch(0, torch.device("cpu"), rank, n)
    calls = []

    def boom(mod, a):
        if not calls:
            calls.append(1)
            raise RuntimeError("injected")

    handle = ours.layers[2].register_forward_pre_hook(boom)
    try:
        _mse(ours, 0, x, y)
    except RuntimeError:
        ours.reset_iter_state()
    handle.remove()
    ref = Deep()
    init = _snapshot(ref)
    ref_losses = _train(ref, _mse, torch.device("cpu"), 0, 1)
    our_losses = _train(ours, _mse, torch.device("cpu"), rank, n)
    return _compare(init, ref, ours, ref_losses, our_losses)


# ----------------------------------------------------- float64 after sharding, swapping params
def c_to_float64_with_swap(rank, n):
    def mse64(model, step, x, y):
        return _mse(model, step, x.double(), y.double())

    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ref = Deep().to(torch.float64)
        init = _snapshot(ref)
        ref_losses = _train(ref, mse64, torch.device("cpu"), 0, 1)
        ours = _shard_deep(Deep()).to(torch.float64)
        our_losses = _train(ours, mse64, torch.device("cpu"), rank, n)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    out = _compare(init, ref, ours, ref_losses, our_losses)
    out["dtypes"] = sorted({str(p.dtype) for p in ours.parameters()})
    return out


CASES = {name[2:]: f for name, f in list(globals().items()) if name.startswith("c_") and callable(f)}


def _worker(rank, n, names):
    out = {}
    for name in names:
        out[name] = recorded(CASES[name], rank, n)  # a raise: the test of this case fails with it
    return out


@pytest.fixture(scope="module")
def results():
    return records_of(run_ranks(_worker, N, args=(sorted(CASES),), timeout_s=300))


def _get(results, name):
    return passed(results[name])


def test_fsdp2_names_and_offload_policy(results):
    r = _get(results, "names_and_offload_policy")
    _ok(r)
    assert r["isinstance"] == [True, True, False] and r["handle"], r


def test_unshard_async_exposes_the_full_weight_and_reshard_frees_it(results):
    r = _get(results, "unshard_async_and_reshard")
    _ok(r)
    assert len(r["before"]) == 1 and r["after"] == r["before"] and r["full_equal"], r


def test_registered_forward_method_gathers_like_forward(results):
    r = _get(results, "forward_method")
    _ok(r)
    assert r["diff"] < TOL and r["gathers"] > 0 and r["resharded"] == "sharded", r


def test_ignored_params_stay_whole_local_and_unreduced(results):
    r = _get(results, "ignored_params")
    assert r["shape"] == (1, 8) and r["same_object"] and r["grad_is_local"], r
    assert r["names"] == ["head.weight"], r  # the only 2-D parameter left: the others are 1-D pieces


def test_reshard_after_forward_set_at_run_time(results):
    r = _get(results, "reshard_after_forward")
    _ok(r)
    # layer 0 kept (False), the root freed (True), layer 1 the default (freed)
    assert r["states"] == [True, False, False], r


def test_gradient_divide_factor_one_sums(results):
    r = _get(results, "gradient_divide_factor")
    assert abs(r["ratio"] - N) < 1e-4, r  # the sum over N ranks is N times the mean


def test_requires_all_reduce_false_accumulates_then_all_reduces_once(results):
    r = _get(results, "requires_all_reduce")
    _ok(r)
    assert r["all_reduced"] == [False, True] * STEPS, r


def test_reshard_after_backward_false_keeps_parameters_for_the_next_forward(results):
    r = _get(results, "reshard_after_backward")
    _ok(r)
    assert all(r["kept"]) and r["gathers_next_forward"] == 0, r


def test_refusals_name_the_reason(results):
    r = _get(results, "refusals")
    assert r["unshard_in_backward"] == "set_unshard_in_backward: 'no'; give True or False", r
    assert r["shard_placement_fn"] == (
        "fully_shard: shard_placement_fn returned Replicate() for 0.weight; return Shard(dim) or None (Shard(0))"
    ), r


def test_shard_placement_fn_trains_and_names_the_checkpoints_split(results):
    r = _get(results, "shard_placement_fn")
    _ok(r)
    for k, placements in r["placements"].items():
        assert placements == (["S(1)"] if k.endswith("weight") else ["S(0)"]), (k, r)  # str(Shard(1)) is S(1)
    assert r["local_shapes_ok"] and r["optim_placements"] == ["S(0)", "S(1)"], r
    assert r["default_loaded_diff"] == 0 and r["placed_loaded_diff"] == 0 and r["moved"] > 0, r


def test_reset_iter_state_after_an_exception_mid_forward(results):
    _ok(_get(results, "reset_iter_state"))


def test_float64_after_sharding_with_swapped_params(results):
    r = _get(results, "to_float64_with_swap")
    _ok(r)
    assert r["dtypes"] == ["torch.float64"], r


def test_a_group_of_modules_is_one_unit(results):
    """fully_shard([layers.0, head]): one unit, gathered once per forward from its first member
    to its last, trained exactly like the reference, its state dict across both members."""
    r = _get(results, "module_group")
    _ok(r)
    assert r["one_unit"] and r["isinstance"] and r["gathered_in_between"], r
    # 4 units with parameters (the group, layers 1-3; the root has none of its own): 4 gathers in
    # forward (one for the group: it is not freed between layers.0 and the head), 4 in backward,
    # 4 reduce-scatters. Freed after each member it would gather 5 times in forward.
    assert r["collectives"] == 4 + 4 + 4, r


def test_a_dp_submesh_of_a_pipeline_mesh_shards_within_its_stage(results):
    _ok(_get(results, "submesh_of_a_pipeline_mesh"))


def test_mixed_precision_gradients_as_close_as_fsdp2s(results):
    """bf16/fp16 compute, fp32 or bf16 reduction, on 4 ranks: our reduced gradients are as close
    to the one-process run in the same dtype as torch's fully_shard's are, so no precision is lost
    on our side. Measured (relative error of each gradient tensor, the worst one): with fp32
    reduction ours equals FSDP2's bit for bit (both cast to fp32, sum, divide once), 2.6e-3 from
    the reference in bf16 (the reference sums 16 rows in bf16 matmuls, the ranks 4 rows each);
    with bf16 reduction ours and FSDP2 differ by 3.2e-3 (both sum, then divide by 4, but each
    element's four-term bf16 sum runs in the order of the rank that holds it, which the layout
    decides: a different rounding at bf16's 2^-8; bit for bit on two ranks per sum, see
    test_fsdp2_behaviours.py), each 3.9e-3 from the reference. Bounds: each engine within 1e-2 of
    the reference (a few bf16 roundings) and ours within 1.25x FSDP2's distance plus 1e-3; a lost
    factor or a bf16 accumulation of the fp32 path would be far outside."""
    r = _get(results, "mixed_precision_next_to_fsdp2")
    for key, v in r.items():
        assert v["ours_ref"] < 1e-2 and v["torch_ref"] < 1e-2, (key, v)
        assert v["ours_ref"] <= 1.25 * v["torch_ref"] + 1e-3, (key, v)
        if key.endswith("float32"):
            assert v["ours_torch"] == 0.0, (key, v)  # fp32 reduction: the same numbers as FSDP2


def test_torch_state_dict_api_saves_dtensors_and_resumes_exactly(results):
    r = _get(results, "dcp_state_dict_api")
    assert r["kinds"] == [("exp_avg", True), ("exp_avg_sq", True), ("step", False)], r
    assert r["loss_diff"] == 0.0 and r["param_diff"] == 0.0 and r["pieces_stay_local"], r  # a resume is bitwise
