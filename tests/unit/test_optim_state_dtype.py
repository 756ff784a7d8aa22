"""`optimizer.state_dtype=bf16`: the rounding that writes the state back
([Note: bf16 optimizer state and its rounding] in framework/optim/lowp.py), the state's bytes, and
the refusals."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from framework.config import compose_config, to_config
from framework.errors import UserInputError


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)


def test_stochastic_rounding_is_unbiased_deterministic_and_layout_free():
    from framework.optim.lowp import rounding_key, stochastic_round_bf16

    x = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    lower = (x.view(torch.int32) & -65536).view(torch.float32)  # toward zero: the smaller magnitude
    rounded = [stochastic_round_bf16(x, rounding_key(1234, step, 0, 1)).float() for step in range(1, 65)]
    for r in rounded:  # one of the two bf16 neighbours, never further
        gap = torch.where(x.abs() > 0, lower.abs() * 2**-7, torch.ones_like(x))
        assert bool(((r == lower) | ((r - lower).abs() <= gap * 1.0001)).all())
    # unbiased: over 64 steps the mean error of each element is ~1/8 of one rounding's
    one = (rounded[0] - x).abs().mean()
    mean = (torch.stack(rounded).mean(0) - x).abs().mean()
    nearest = (x.bfloat16().float() - x).abs().mean()
    assert mean < one / 5 and mean < nearest / 5, (float(mean), float(one), float(nearest))
    # deterministic, and the same for an element wherever it sits (another rank's piece, another order)
    key = rounding_key(1234, 7, 3, 2)
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_bits(stochastic_round_bf16(x, key)), _bits(stochastic_round_bf16(x, key)))
    assert torch.equal(_bits(stochastic_round_bf16(x[perm], key)), _bits(stochastic_round_bf16(x, key))[perm])
    assert torch.equal(_bits(stochastic_round_bf16(x[:777], key)), _bits(stochastic_round_bf16(x, key))[:777])
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1.0, -2.5])
    assert torch.equal(_bits(stochastic_round_bf16(special, key)), _bits(special))
    assert torch.isnan(stochastic_round_bf16(torch.tensor([float("nan")]), key)).all()


def test_an_average_kept_in_bf16_tracks_float32_only_with_stochastic_rounding():
    """An exponential average with beta 0.999 (Adam's usual beta2) moving from 1.0 towards 1.1: each
    step adds 1e-4, under half a bf16 gap at 1.0 (2^-8), so round-to-nearest never moves; the
    stochastic rounding follows float32's average (1.0950 after 3000 steps), on average over 4096
    elements within 0.005 (measured: 0.0006)."""
    from framework.optim.lowp import rounding_key, stochastic_round_bf16

    beta, target, n = 0.999, 1.1, 4096
    exact = torch.ones(n)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    stochastic = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, 3001):
        exact.mul_(beta).add_(target * (1 - beta))
        nearest = (nearest.float() * beta + target * (1 - beta)).bfloat16()
        stochastic = stochastic_round_bf16(stochastic.float() * beta + target * (1 - beta), rounding_key(0, step, 0, 2))
    assert abs(float(exact[0]) - 1.0950) < 1e-3
    assert bool((nearest == 1.0).all())
    assert abs(float(stochastic.float().mean()) - float(exact[0])) < 0.005


# The rounding's definition, written out in Python integers and int64 tensors as it was first
# written: `stochastic_round_bf16` (int32, in place) and `rounding_key` of a count tensor (on the
# count's device) must give the same bits.
def _key_reference(seed: int, step: int, slot: int, salt: int) -> int:
    x = 0
    for part in (seed, step, slot, salt):
        x = (x ^ part) & 0xFFFFFFFFFFFFFFFF
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0xFFFFFFFF


def _round_reference(x: torch.Tensor, key: int) -> torch.Tensor:
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    h = bits ^ key
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    h = (((h >> 16) ^ h) * 0x45D9F3B) & 0xFFFFFFFF
    rounded = (bits + (((h >> 16) ^ h) & 0xFFFF)) & 0xFFFF0000
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN, NaN at the same places (a NaN's payload is not kept)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


def test_rounding_in_int32_and_keys_on_the_device_keep_the_definition():
    from framework.optim.lowp import rounding_key, stochastic_round_bf16

    g = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    special = [float("inf"), float("-inf"), 0.0, -0.0, 3.3895e38, -3.3895e38, 1e-45, -1e-45, float("nan")]
    x = torch.cat([patterns.view(torch.float32), torch.randn(50_000, generator=g), torch.tensor(special)])
    for nan_bits in (0x7F800001, 0x7FFFFFFF, -1, -8388607):  # NaNs whose bits plus noise would be numbers
        x = torch.cat([x, torch.tensor([nan_bits], dtype=torch.int32).view(torch.float32)])
    for key in (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 3_000_000_000, _key_reference(5, 9, 2, 1)):
        assert _same_bits(stochastic_round_bf16(x, key), _round_reference(x, key)), key
    # keys from the count tensor: the same 32 bits (as int32), and the rounding with it the same
    steps = torch.tensor([1.0, 2.0, 77.0, 2.0**20, 2.0**24])
    slots = torch.tensor([0, 3, 1000, 7, 123456])
    for seed in (0, 1234, 2**40 + 7):
        for salt in (1, 2, 3):
            keys = rounding_key(seed, steps, slots, salt)
            assert keys.dtype == torch.int32 and keys.device == steps.device
            want = [_key_reference(seed, int(s), int(k), salt) for s, k in zip(steps, slots)]
            assert [int(k) & 0xFFFFFFFF for k in keys] == want
            assert rounding_key(seed, 77, 1000, salt) == want[2]
    key = rounding_key(1234, torch.tensor(7.0), 3, 2)
    assert _same_bits(stochastic_round_bf16(x, key), _round_reference(x, _key_reference(1234, 7, 3, 2)))


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records every read of a tensor's value on the host (a wait for the device on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__}
    READS |= {torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_state_step_reads_no_count_on_the_host(name):
    """The step count is a float32 tensor on the parameter's device and a step reads no tensor's
    value on the host (on a GPU each such read waits for the device): AdamW's step and Muon's
    rounding make the keys and bias corrections from the count where it is."""
    from framework.config.schema import OptimizerConfig
    from framework.optim import build_optimizer

    model = _debug_model()
    opt = build_optimizer(model, OptimizerConfig(name=name, state_dtype="bf16"), seed=1234)
    _step(model, opt, 0)  # the state made
    for step in (1, 2):
        with _HostReads() as reads:
            _step(model, opt, step)
        assert reads.seen == [], reads.seen
    counts = [st["step"] for st in opt.state.values()]
    assert len(counts) == 21 and all(c.dtype == torch.float32 and c.dim() == 0 for c in counts)
    assert {float(c) for c in counts} == {3.0}


def test_adamw_low_state_steps_on_a_device_without_host_reads():
    """On the meta device (no values: any read on the host raises) the step runs, the step count
    lives there, and the state is bfloat16 there: the path a GPU takes reads nothing back."""
    from framework.optim.lowp import AdamWLowState

    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in ((300, 7), (5,), (70_000,))]
    opt = AdamWLowState([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-3)
    for _ in range(2):
        for p in params:
            p.grad = torch.empty_like(p)
        opt.step()
    for p in params:
        st = opt.state[p]
        assert st["step"].device.type == "meta" and st["step"].dtype == torch.float32
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert st["exp_avg"].device.type == "meta"


@torch.no_grad()
def _reference_adamw_step(params, state, groups_of, seed, b1=0.9, b2=0.95, lr=3e-3, eps=1e-8):
    """AdamW with bf16 state one parameter at a time, as first written: Python-int counts and
    keys, the int64 rounding above; the square root correctly rounded (taken in float64: torch's
    float32 sqrt on a CPU is 1 ulp off in a fifth of the values, CUDA's and the compiled CPU
    loop's are not)."""
    for slot, p in enumerate(params):
        if p.grad is None:
            continue
        st = state.setdefault(slot, {"step": 0, "m": torch.zeros_like(p, dtype=torch.bfloat16)})
        st.setdefault("v", torch.zeros_like(p, dtype=torch.bfloat16))
        st["step"] += 1
        n = st["step"]
        m = st["m"].float().lerp_(p.grad, 1 - b1)
        v = st["v"].float().mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
        p.mul_(1 - lr * groups_of[slot])
        denom = (v.double().sqrt().float() / math.sqrt(1 - b2**n)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - b1**n))
        st["m"] = _round_reference(m, _key_reference(seed, n, slot, 1))
        st["v"] = _round_reference(v, _key_reference(seed, n, slot, 2))


@pytest.mark.parametrize("cpu_kernel", [False, True], ids=["torch-ops", "compiled-loop"])
def test_foreach_chunked_step_equals_the_per_parameter_step_bit_for_bit(monkeypatch, cpu_kernel):
    """The step over tensor lists, in chunks (small ones here, so that tensors are cut and packed:
    [Note: the bf16-state AdamW step on tensor lists]), equals AdamW with bf16 state stepped one
    parameter at a time with the rounding's definition: parameters and state, bit for bit, over
    steps where a parameter has no gradient (counts that differ), a transposed parameter (not
    cut), two groups, and a NaN and an infinity in a gradient. With the compiled CPU loop ([Note:
    the bf16-state AdamW step in one pass on a CPU]; where there is a compiler) the same, the
    transposed parameter stepped by the torch operations beside it."""
    from framework.optim import lowp, lowp_cpu

    if cpu_kernel and lowp_cpu.compiler() is None:
        pytest.skip("no C compiler: the compiled loop cannot be built")
    assert not cpu_kernel or lowp.cpu_library() is not None, lowp_cpu.unavailable_reason()

    monkeypatch.setattr(lowp, "CHUNK_CPU", 1000)
    g = torch.Generator().manual_seed(0)
    shapes = [(40, 60), (7,), (3000,), (999,), (2, 3, 4), (1001,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    ours.append(torch.nn.Parameter(torch.randn(50, 30, generator=g).t()))  # 1500 elements, not contiguous
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    decay = [0.1] * 4 + [0.0] * 3
    opt = lowp.AdamWLowState(
        [{"params": ours[:4]}, {"params": ours[4:], "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        seed=99,
        cpu_kernel=cpu_kernel,
    )
    state: dict = {}
    for step in range(5):
        for i, (p, q) in enumerate(zip(ours, ref)):
            skip = step == 1 and i in (1, 3)
            grad = None if skip else torch.randn(p.shape, generator=g) * 10.0 ** (i % 3 - 2)
            if grad is not None and step == 3 and i == 2:
                grad[5], grad[6] = float("nan"), float("inf")
            p.grad = None if grad is None else grad.clone()
            q.grad = grad
        opt.step()
        _reference_adamw_step(ref, state, decay, seed=99)
        for slot, (p, q) in enumerate(zip(ours, ref)):
            assert _same_bits(p.detach(), q.detach()), (step, slot)
            st = opt.state[p]
            assert _same_bits(st["exp_avg"], state[slot]["m"]) and _same_bits(st["exp_avg_sq"], state[slot]["v"])
            assert float(st["step"]) == state[slot]["step"]
    assert torch.isnan(opt.state[ours[2]]["exp_avg"]).any()  # the NaN reached the state and stayed NaN


def _debug_model():
    from framework.models.llama import build_llama

    cfg = to_config(compose_config(["model=debug"]))
    torch.manual_seed(0)
    model = build_llama(cfg.model)
    model.init_weights(0)
    return model


def _step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 256, (2, 33), generator=g)
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(0, 1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


STATE_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_state_is_half_the_bytes(name):
    """The optimizer state tensors of model=debug after a step, measured: in bf16 every moment and
    momentum buffer is bfloat16 and the total is half the fp32 state's (the float32 `step` scalars
    aside); the parameters stay float32."""
    from framework.config.schema import OptimizerConfig
    from framework.optim import build_optimizer

    held = {}
    for dtype in ("fp32", "bf16"):
        model = _debug_model()
        opt = build_optimizer(model, OptimizerConfig(name=name, state_dtype=dtype), seed=1234)
        _step(model, opt, 0)
        states = [v for st in opt.state.values() for k, v in st.items() if k in STATE_KEYS]
        # model=debug: 21 parameters; Muon's 14 block matrices have one buffer, the rest two moments
        assert len(states) == (14 + 2 * 7 if name == "muon" else 2 * 21)
        held[dtype] = {
            "dtypes": {v.dtype for v in states},
            "bytes": sum(v.untyped_storage().nbytes() for v in states),
            "elements": sum(v.numel() for v in states),
        }
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert held["fp32"]["dtypes"] == {torch.float32} and held["bf16"]["dtypes"] == {torch.bfloat16}
    assert held["bf16"]["elements"] == held["fp32"]["elements"]
    assert held["bf16"]["bytes"] * 2 == held["fp32"]["bytes"]


def test_our_adamw_is_torch_adamw_with_float32_state():
    """AdamWLowState makes torch.optim.AdamW's update: with float32 state the two agree bit for bit
    (so bf16 state differs from the default only by its rounding)."""
    from framework.optim.lowp import AdamWLowState

    model = _debug_model()
    ours = copy.deepcopy(model)
    ref = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    opt = AdamWLowState(ours.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, state_dtype=torch.float32)
    for step in range(3):
        _step(model, ref, step)
        _step(ours, opt, step)
    for a, b in zip(model.parameters(), ours.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bf16_state_survives_load_state_dict(name):
    """torch's `load_state_dict` casts state to the parameters' dtype; ours puts it back in bf16,
    unchanged, and the next step is the one the saved optimizer makes."""
    from framework.config.schema import OptimizerConfig
    from framework.optim import build_optimizer

    cfg = OptimizerConfig(name=name, state_dtype="bf16")
    model = _debug_model()
    opt = build_optimizer(model, cfg, seed=1234)
    for step in range(2):
        _step(model, opt, step)
    twin = copy.deepcopy(model)
    twin_opt = build_optimizer(twin, cfg, seed=1234)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(opt.param_groups[0]["params"], twin_opt.param_groups[0]["params"]):
        for k in STATE_KEYS:
            if k in opt.state[p]:
                assert twin_opt.state[q][k].dtype == torch.bfloat16
                assert torch.equal(twin_opt.state[q][k], opt.state[p][k])
    _step(model, opt, 2)
    _step(twin, twin_opt, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["optimizer.state_dtype=fp16"], "optimizer.state_dtype='fp16': unknown; choose one of fp32, bf16"),
        (
            ["optimizer=sgd", "optimizer.state_dtype=bf16"],
            "optimizer.state_dtype=bf16 with optimizer=sgd: bf16 state is for adamw and muon; "
            "set optimizer.state_dtype=fp32",
        ),
    ],
)
def test_state_dtype_refusals_name_the_field(overrides, line):
    with pytest.raises(UserInputError) as exc:
        to_config(compose_config(overrides))
    assert str(exc.value) == line
