"""The bf16-state AdamW step compiled as one C loop on a CPU ([Note: the bf16-state AdamW step in
one pass on a CPU] in framework/optim/lowp_cpu.py): the same bits as the torch operations, the
torch path wherever the loop cannot be had, and a stochastic rounding that is unbiased."""

from __future__ import annotations

import pytest
import torch

from framework.optim import lowp, lowp_cpu

needs_cc = pytest.mark.skipif(lowp_cpu.compiler() is None, reason="no C compiler: the compiled loop cannot be built")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not built or checked the loop yet, with its own cache folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(lowp_cpu, "_state", {})
    return tmp_path


def _run(cpu_kernel: bool, threads: int = 2):
    """Four steps of AdamWLowState on odd shapes, three groups (torch's default betas; betas whose
    lerp weight is 0.5 or more, the other lerp form; no weight decay), a parameter above two
    threads' share of the loop and above the torch path's chunk (cut there), one without a
    gradient at a step, a transposed one (never the loop's), a NaN and infinities in a gradient.
    Every parameter and state tensor after every step."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        shapes = [(260, 513), (7,), (1,), (4099,), (2, 3, 5), (70_001,)]
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        params.append(torch.nn.Parameter(torch.randn(40, 30, generator=g).t()))
        opt = lowp.AdamWLowState(
            [
                {"params": params[:3]},
                {"params": params[3:5], "betas": (0.3, 0.99)},
                {"params": params[5:], "weight_decay": 0.0},
            ],
            lr=3e-3,
            weight_decay=0.1,
            seed=7,
            cpu_kernel=cpu_kernel,
        )
        seen = []
        for step in range(4):
            for i, p in enumerate(params):
                p.grad = None if (step == 1 and i == 1) else torch.randn(p.shape, generator=g) * 10.0 ** (i % 4 - 3)
            params[3].grad[10:13] = torch.tensor([float("nan"), float("inf"), float("-inf")]) if step == 2 else 0.0
            opt.step()
            seen.append(
                [t.detach().clone() for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
            )
        return seen
    finally:
        torch.set_num_threads(saved)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit where not NaN, NaN at the same places (torch's own conversions to
    bfloat16 give a NaN 0x7FC0 or 0xFFFF, the loop 0x7FC0)."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@needs_cc
def test_a_library_someone_else_could_have_written_is_never_loaded(fresh):
    """A library in the cache is code run by every bf16-state job: one behind a link, or writable by
    others, is replaced by this process's own build; a cache folder others can write to is not
    used at all (a private folder of this process's instead)."""
    assert lowp.cpu_library() is not None, lowp_cpu.unavailable_reason()
    (built,) = (fresh / "framework" / "kernels").glob("lowp_*.so")
    planted = fresh / "planted.so"
    planted.write_bytes(b"not a library")
    built.unlink()
    built.symlink_to(planted)
    lowp_cpu._state.clear()
    assert lowp.cpu_library() is not None, lowp_cpu.unavailable_reason()
    assert not built.is_symlink() and planted.read_bytes() == b"not a library"
    built.chmod(0o777)
    lowp_cpu._state.clear()
    assert lowp.cpu_library() is not None and built.stat().st_mode & 0o777 == 0o755
    folder = built.parent
    folder.chmod(0o777)
    try:
        for leftover in folder.iterdir():
            leftover.unlink()
        lowp_cpu._state.clear()
        assert lowp.cpu_library() is not None, lowp_cpu.unavailable_reason()
        assert not list(folder.iterdir()), "built in a folder others can write to"
    finally:
        folder.chmod(0o700)


@needs_cc
def test_compiled_loop_steps_the_torch_paths_bits(fresh):
    """Where a compiler is found the loop is built, passes its check, and every parameter and
    state bit equals the torch path's over four steps (one and two threads)."""
    assert lowp.cpu_library() is not None, lowp_cpu.unavailable_reason()
    assert list((fresh / "framework" / "kernels").glob("lowp_*.so")), "built into the user's cache folder"
    want = _run(cpu_kernel=False, threads=1)  # torch's operations: the same bits on any number of threads
    for threads in (1, 2):
        got = _run(cpu_kernel=True, threads=threads)
        for step, (a, b) in enumerate(zip(got, want)):
            for k, (x, y) in enumerate(zip(a, b)):
                assert _same_bits(x, y), (threads, step, k // 3, ("param", "exp_avg", "exp_avg_sq")[k % 3])
    assert torch.isnan(got[-1][3 * 3 + 1].float()).any()  # the NaN reached the state and stayed NaN
    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.ones(5)
    opt = lowp.AdamWLowState([p], lr=0.1, cpu_kernel=True)
    opt.step()
    before = [t._version for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    opt.step()  # the loop writes behind autograd's back: the in-place writes are counted all the same
    after = [t._version for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(1))
    x[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
    key = lowp.rounding_key(3, torch.tensor(5.0), 2, lowp.SALT_MOMENTUM)  # as Muon's rounding takes it
    assert _same_bits(lowp.stochastic_round_bf16(x, key), lowp._torch_round(x, key))


def test_without_a_compiler_the_step_is_the_torch_paths(fresh, monkeypatch):
    """No compiler (`$CC` names none): no loop, the reason said, and the step is made by the torch
    operations, the same bits as with the loop."""
    monkeypatch.setenv("CC", str(fresh / "no-such-compiler"))
    assert lowp.cpu_library() is None
    assert lowp_cpu.unavailable_reason() == "no C compiler ($CC or cc)"
    got = _run(cpu_kernel=True)
    want = _run(cpu_kernel=False)
    assert all(_same_bits(x, y) for a, b in zip(got, want) for x, y in zip(a, b))


def test_a_failed_compile_keeps_the_torch_path(fresh, monkeypatch):
    """A compiler that fails (here `false`): no loop, the reason names the compiler, the step runs."""
    monkeypatch.setenv("CC", "false")
    assert lowp.cpu_library() is None
    assert lowp_cpu.unavailable_reason().startswith("compile or load failed")
    p = torch.nn.Parameter(torch.ones(5))
    p.grad = torch.ones(5)
    opt = lowp.AdamWLowState([p], lr=0.1)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and bool((p < 1).all())


@needs_cc
def test_a_loop_that_differs_from_the_torch_path_is_not_used(fresh, monkeypatch):
    """The check against the torch path at load refuses a loop whose bits differ (here its hash's
    multiplier changed): the torch path steps."""
    monkeypatch.setattr(lowp_cpu, "_SOURCE", lowp_cpu._SOURCE.replace("0x45D9F3Bu", "0x45D9F3Du"))
    assert lowp.cpu_library() is None
    assert "differs from the torch path" in lowp_cpu.unavailable_reason()


@pytest.mark.parametrize("path", ["torch-ops", "compiled-loop"])
def test_stochastic_rounding_is_unbiased(path):
    """Rounded at 256 steps (the optimizer's keys: seed, step, slot, salt), each value goes up to
    its upper bf16 neighbour at the rate of its distance from the lower one (in gaps). Counted
    over 8192 values x 256 steps: a rate that is the fraction exactly makes sum(up - fraction) a
    sum of independent zero-mean draws with variance sum(fraction (1 - fraction)); the z-score
    |sum / sd| stays under 5 (a 5.7e-7 chance for a sound rounding), overall, in each of 16 bins of
    the fraction and for each value's mean over its 256 roundings (each under 6 sd: 8192 values
    x 2e-9), and the decisions of consecutive steps are uncorrelated (|r| < 5 / sqrt(n) of their residuals). The
    rounding is deterministic, so a pass is not luck that may turn."""
    if path == "compiled-loop":
        if lowp_cpu.compiler() is None:
            pytest.skip("no C compiler: the compiled loop cannot be built")
        lib = lowp.cpu_library()
        assert lib is not None, lowp_cpu.unavailable_reason()
        rnd = lambda x, key: lowp_cpu.round_bf16(lib, x, key)  # noqa: E731
    else:
        rnd = lowp._torch_round
    g = torch.Generator().manual_seed(0)
    # magnitudes from 1e-6 to 1e3, both signs, and some with small fractions of a gap
    x = torch.randn(8192, generator=g) * torch.exp(torch.randn(8192, generator=g) * 3)
    bits = x.view(torch.int32)
    lower = bits & -65536
    frac = (bits & 0xFFFF).double() / 65536  # the chance of going up (in magnitude)
    steps = 256
    up = torch.stack(
        [
            (rnd(x, lowp.rounding_key(1234, s, 3, lowp.SALT_EXP_AVG)).float().view(torch.int32) != lower)
            for s in range(1, steps + 1)
        ]
    ).double()
    assert bool(((up == 0) | (up == 1)).all())

    def z(mask: torch.Tensor) -> float:
        dev = (up[:, mask] - frac[mask]).sum()
        return float(dev / (steps * (frac[mask] * (1 - frac[mask])).sum()).sqrt())

    assert abs(z(torch.ones_like(frac, dtype=torch.bool))) < 5
    for b in range(16):
        in_bin = (frac >= b / 16) & (frac < (b + 1) / 16)
        assert abs(z(in_bin)) < 5, (b, z(in_bin))
    # each value: the mean of its 256 rounded values is the float32 value, in units of its gap
    sd = (frac * (1 - frac) / steps).sqrt().clamp_min(1 / steps)
    assert bool(((up.mean(0) - frac).abs() < 6 * sd).all())
    # the steps' decisions independent: the residuals (up - fraction) of consecutive steps uncorrelated
    res = up - frac
    a, b = res[:-1].flatten(), res[1:].flatten()
    r = float((a * b).sum() / ((a * a).sum() * (b * b).sum()).sqrt())
    assert abs(r) < 5 / a.numel() ** 0.5, r
