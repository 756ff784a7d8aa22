"""Our Llama's mixture-of-experts block (framework/models/llama/moe.py): routing, dropless and
capacity-limited dispatch, the load-balancing loss, zero gradients for unchosen experts, and a
sharded run equal to one process."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, read_metrics, run_main

from framework.models.llama.args import LlamaArgs
from framework.models.llama.model import FeedForward
from framework.models.llama.moe import MoE


def _moe(**overrides) -> MoE:
    args = LlamaArgs(dim=16, ffn_dim=32, n_experts=4, top_k=2, moe_ffn_dim=24, **overrides)
    torch.manual_seed(0)
    moe = MoE(args)
    moe.reset_parameters(0.2, 0.2, generator=torch.Generator().manual_seed(1))
    if moe.shared is not None:
        for p in moe.shared.parameters():
            torch.nn.init.normal_(p, std=0.2)
    return moe


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(x, moe.experts.w1[e])) * f.linear(x, moe.experts.w3[e]), moe.experts.w2[e])


@pytest.mark.parametrize("shared", [0, 1])
def test_dropless_output_is_each_tokens_weighted_top_k_experts(shared):
    moe = _moe(n_shared_experts=shared)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2))
    out = moe(x).reshape(-1, 16)
    probs = torch.softmax(moe.router(x.reshape(-1, 16)), -1)
    for t, token in enumerate(x.reshape(-1, 16)):
        top = probs[t].topk(2)
        weights = top.values / top.values.sum()
        want = sum(w * _expert(moe, int(e), token) for w, e in zip(weights, top.indices))
        if shared:
            want = want + moe.shared(token)
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
    assert isinstance(moe.shared, FeedForward) == bool(shared)


def test_an_unchosen_expert_gets_exactly_zero_gradient():
    moe = _moe()
    with torch.no_grad():
        moe.router.weight[3] = -100.0  # expert 3 never wins
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(3)).abs()  # expert 3: logit < -100
    moe(x).square().sum().backward()
    assert 3 not in moe.last_choices
    for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2):
        assert torch.count_nonzero(w.grad[3]) == 0 and torch.count_nonzero(w.grad[:3]) > 0


def test_capacity_drops_the_tokens_past_an_experts_share():
    moe = _moe(capacity_factor=0.5)  # 12 tokens x 2 slots / 4 experts x 0.5 = 3 rows per expert
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(4))
    out = moe(x).reshape(-1, 16)
    tokens = x.reshape(-1, 16)
    weights, experts, _, _ = moe.route(tokens)
    taken = {e: (experts == e).nonzero()[:3].tolist() for e in range(4)}
    for t in range(12):
        want = torch.zeros(16)
        for e, rows in taken.items():
            for row, slot in rows:
                if row == t:
                    want = want + weights[t, slot] * _expert(moe, e, tokens[t])
        torch.testing.assert_close(out[t], want, atol=1e-5, rtol=1e-5)
    dropped = sum(len((experts == e).nonzero()) - len(taken[e]) for e in range(4))
    assert dropped > 0


def test_the_load_balancing_loss_is_its_coefficient_at_a_uniform_router():
    """Switch's loss: n_experts x sum_e (share of slots to e) x (mean probability of e); a router of
    zeros gives every expert probability 1/n, so the loss is 1 x coefficient, however ties fall."""
    moe = _moe(aux_loss_coef=0.01)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(2, 7, 16))
    assert moe.aux_loss.item() == pytest.approx(0.01)


def test_moe_debug_on_two_ranks_equals_one_process_and_learns(tmp_path):
    """The experts are sharded over the data-parallel ranks with the rest of each block: the same
    routing and losses as one process (1e-5: the sharded reduction's order), and the loss falls."""
    args = [*TINY, "model=moe_debug", "model.args.vocab_size=256", "data.seq_len=64", "trainer.eval_interval=0"]
    args += ["trainer.max_steps=12", "optimizer.lr=1e-2", "checkpoint.save_final=false"]
    losses = {}
    for ranks in (1, 2):
        run = tmp_path / f"r{ranks}"
        out = run_main([*args, f"cluster.nproc_per_node={ranks}", f"hydra.run.dir={run}"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "model=moe_debug" in out.stderr
        losses[ranks] = [r["loss"] for r in read_metrics(run)]
    assert losses[2] == pytest.approx(losses[1], abs=1e-5)
    assert losses[2][-1] < losses[2][0] - 0.3
