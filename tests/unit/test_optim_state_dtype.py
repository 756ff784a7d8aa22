"""`optimizer.state_dtype=bf16`: the rounding that writes the state back
([Note: bf16 optimizer state and its rounding] in framework/optim/lowp.py), the state's bytes, and
the refusals."""

from __future__ import annotations

import copy

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
