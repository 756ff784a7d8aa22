"""Load balancing independent of the layout (framework/models/llama/moe.py, framework/routing.py):
the global-batch load-balancing loss, DeepSeek-V3's aux-loss-free bias, and the router's
statistics in metrics.jsonl."""

from __future__ import annotations

import re

import pytest
from conftest import TINY, read_metrics, run_main

MOE = [a for a in TINY if not a.startswith("data=")] + ["model=moe_debug", "trainer.eval_interval=0"]


def _records(tmp_path, stdlib_cache, name: str, extra: list, steps: int = 5) -> list:
    """The job's metrics.jsonl records, after checking that every step's router loads sum to the
    step's tokens x top_k (2) in each of the 2 layers."""
    run = tmp_path / name
    out = run_main([*MOE, stdlib_cache, f"trainer.max_steps={steps}", *extra, f"hydra.run.dir={run}"], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens = int(re.search(r"(\d+) tokens/step", out.stderr).group(1))
    records = read_metrics(run)
    for r in records:
        for layer in (0, 1):
            load = r[f"moe_load_l{layer}"]
            assert len(load) == 4 and sum(load) == tokens * 2, (r, tokens)
            assert r[f"moe_max_mean_l{layer}"] == pytest.approx(max(load) / (sum(load) / 4))
    return records


def test_global_batch_balancing_gives_the_same_losses_on_every_layout(tmp_path, stdlib_cache):
    """The same moe_debug job (global batch 16 rows) on one process in 4 micro-batches of 4, on 2
    ranks with ep=2 in one micro-batch of 8 each, and on 2 ranks with ep=2 in 4 micro-batches of 2
    each: the load-balancing loss is computed from the whole global batch's expert loads, so its 5
    losses agree to 1e-5 (float32 sums in another order differ by ~5e-7 over 5 steps). With the
    balancing loss per micro-batch (aux_loss_scope=micro_batch) they differed by 1.4e-4. Every
    step's record holds the router loads (checked in `_records`), the same on every layout."""
    scope = "model.args.aux_loss_scope=global_batch"
    one = _records(tmp_path, stdlib_cache, "one", [scope, "cluster.nproc_per_node=1", "trainer.micro_batch_size=4"])
    ep2 = _records(
        tmp_path,
        stdlib_cache,
        "ep2",
        [scope, "cluster.nproc_per_node=2", "parallelism.ep=2", "trainer.micro_batch_size=8"],
    )
    ep2_small = _records(
        tmp_path,
        stdlib_cache,
        "ep2_small",
        [scope, "cluster.nproc_per_node=2", "parallelism.ep=2", "trainer.micro_batch_size=2"],
    )
    a, b, c = ([r["loss"] for r in run] for run in (one, ep2, ep2_small))
    print("max |one - ep2|:", max(abs(x - y) for x, y in zip(a, b)), "mb2:", max(abs(x - y) for x, y in zip(a, c)))
    assert len(a) == 5 and b == pytest.approx(a, abs=1e-5) and c == pytest.approx(a, abs=1e-5)
    loads = [[r["moe_load_l0"] + r["moe_load_l1"] for r in run] for run in (one, ep2, ep2_small)]
    assert loads[0] == loads[1] == loads[2]


def test_aux_loss_free_bias_moves_towards_balance_and_is_restored_on_resume(tmp_path, stdlib_cache):
    """DeepSeek-V3's balancing alone (aux_loss_coef=0, bias_update_rate=0.005, capacity 1.0). Step 2
    starts from the same weights with and without the bias (step 1 routed with a zero bias, and
    the bias is outside the gradient), so its loads differ by the bias alone: every expert above
    step 1's mean load takes no more slots than without the bias, every one below no fewer, and
    the loads are closer to the mean (the sum of |load - mean| is smaller). The record counts the
    capacity's dropped slots. A job resumed from the step-3 checkpoint routes steps 4..6 exactly
    as the straight job did (the same loads and, within 1e-5, the same losses: one float32
    program): the bias came back with the weights (a zero bias would route otherwise)."""
    job = ["cluster.nproc_per_node=1", "model.args.aux_loss_coef=0", "model.args.capacity_factor=1.0"]
    biased = [*job, "model.args.bias_update_rate=0.005"]
    plain = _records(tmp_path, stdlib_cache, "plain", job, steps=2)
    straight = _records(tmp_path, stdlib_cache, "straight", [*biased, "checkpoint.interval=3"], steps=6)
    for r in straight:
        assert all(isinstance(r[f"moe_dropped_l{layer}"], int) for layer in (0, 1)), r
    for layer in (0, 1):
        key = f"moe_load_l{layer}"
        first, unbiased, moved = straight[0][key], plain[1][key], straight[1][key]
        assert first == plain[0][key]  # step 1: the bias is still zero
        mean = sum(first) / len(first)
        for before, without, with_bias in zip(first, unbiased, moved):
            if before > mean:
                assert with_bias <= without, (layer, first, unbiased, moved)
            elif before < mean:
                assert with_bias >= without, (layer, first, unbiased, moved)
        spread = [sum(abs(x - mean) for x in load) for load in (unbiased, moved)]
        print(f"layer {layer}: step 1 {first}, step 2 without bias {unbiased} with {moved}, spread {spread}")
        assert spread[1] < spread[0]

    ckpt = tmp_path / "straight" / "checkpoints" / "step_00000003"
    resumed = _records(tmp_path, stdlib_cache, "resumed", [*biased, f"checkpoint.resume={ckpt}"], steps=6)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for mine, theirs in zip(resumed, straight[3:]):
        assert mine["moe_load_l0"] == theirs["moe_load_l0"] and mine["moe_load_l1"] == theirs["moe_load_l1"]
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-5)


def _global_batch_worker(rank: int, world: int, rows_per_micro: int, scope: str):
    """This rank's half of an 8-row global batch in micro-batches of `rows_per_micro` rows, the
    trainer's way (each micro-batch's loss / micro-batches, backward, then the mean over ranks),
    against one process's single micro-batch of all 8 rows (where the micro-batch is the global
    batch, so scope=micro_batch is the global-batch loss by definition)."""
    import torch
    import torch.distributed as dist

    from framework.models.llama.args import LlamaArgs
    from framework.models.llama.model import Transformer
    from framework.routing import RouterSteps

    def build(aux_loss_scope):
        args = LlamaArgs(n_experts=4, top_k=2, moe_ffn_dim=24, aux_loss_coef=1.0, aux_loss_scope=aux_loss_scope)
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights(seed=0)
        return model

    gen = torch.Generator().manual_seed(5)
    tokens, labels = torch.randint(0, 256, (8, 16), generator=gen), torch.randint(0, 256, (8, 16), generator=gen)

    def loss_of(model, rows):
        logits = model(tokens[rows])
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[rows].flatten())
        return ce + model.aux_loss

    reference = build("micro_batch")
    want = loss_of(reference, slice(0, 8))
    want.backward()

    model = build(scope)
    mine = range(rank * 4, rank * 4 + 4)
    micro = [slice(s, s + rows_per_micro) for s in mine[::rows_per_micro]]
    steps = RouterSteps.of(model)
    steps.begin(micro, lambda rows: loss_of(model, rows))
    total = torch.zeros(())
    for rows in micro:
        loss = loss_of(model, rows) / len(micro)
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    worst = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, (grad / world - q.grad).abs().max().item() / q.grad.abs().max().clamp(min=1e-12).item())
    router = [r.global_load.tolist() if r.global_load is not None else None for r in steps.routers]
    return {"loss": abs(total.item() / world - want.item()), "grad": worst, "global_load": router}


@pytest.mark.parametrize("rows_per_micro", [4, 1])
def test_global_batch_loss_and_gradients_equal_one_micro_batch_of_the_whole_batch(rows_per_micro):
    """[Note: global-batch load balancing] on 2 gloo ranks, in micro-batches of 4 rows and of 1
    row: the loss and every parameter's gradient (aux_loss_coef=1, so the balancing term is not
    lost in the cross-entropy's) equal one micro-batch of the whole batch's within float32
    rounding (1e-5 of the largest gradient entry: sums in another order); per micro-batch
    (scope=micro_batch) they do not (> 1e-3), which is what the pass ahead fixes."""
    from tests.distributed.harness import run_ranks

    exact = run_ranks(_global_batch_worker, 2, args=(rows_per_micro, "global_batch"), timeout_s=120)
    for res in exact:
        assert res["loss"] < 1e-5 and res["grad"] < 1e-5, res
        assert sum(res["global_load"][0]) == 8 * 16 * 2  # every token of both ranks, top 2
    apart = run_ranks(_global_batch_worker, 2, args=(rows_per_micro, "micro_batch"), timeout_s=120)
    assert apart[0]["grad"] > 1e-3, apart[0]


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("aux_loss_scope", "global", "model.args.aux_loss_scope='global': choose one of global_batch, micro_batch"),
        ("bias_update_rate", -0.1, "model.args.bias_update_rate=-0.1: must be >= 0"),
        ("bias_update_rate", 1.0, "model.args.bias_update_rate=1.0: must be >= 0"),
    ],
)
def test_bad_balancing_fields_are_refused_in_one_line(field, value, says):
    from framework.errors import UserInputError
    from framework.models.llama.args import LlamaArgs

    with pytest.raises(UserInputError) as refused:
        LlamaArgs(n_experts=4, **{field: value})
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_activation_checkpointing_recompute_counts_each_token_once():
    """Under full activation checkpointing each block's forward runs again in backward; the
    router loads of a forward and backward still sum to tokens x top_k (they would be twice that
    if the recompute counted: framework/recompute.py)."""
    import torch

    from framework.config.schema import ActivationCheckpointing
    from framework.distributed.parallelize import apply_activation_checkpointing
    from framework.models.llama.args import LlamaArgs
    from framework.models.llama.model import Transformer

    torch.manual_seed(0)
    model = Transformer(LlamaArgs(n_experts=4, top_k=2, moe_ffn_dim=24))
    model.init_weights(seed=0)
    apply_activation_checkpointing(list(model.layers), ActivationCheckpointing.full)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    (model(tokens).square().mean() + model.aux_loss).backward()
    assert all(layer.feed_forward.step_load.sum().item() == 2 * 16 * 2 for layer in model.layers)
