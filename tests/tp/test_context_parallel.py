"""Context parallelism (framework/distributed/context_parallel.py): each rank holds 1/cp of every
sequence and attends over the whole of it by all-to-all; the numbers are one process's."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, read_metrics, run_main

from tests.distributed.harness import run_ranks

SEQ = 32


def _model():
    from framework.models.llama.args import LlamaArgs
    from framework.models.llama.model import Transformer

    torch.manual_seed(0)
    model = Transformer(
        LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=64)
    )
    model.init_weights(seed=3)
    return model


def _batch(documents: bool):
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}
    batch["labels"][0, 3:11] = -100  # prompt tokens: rank 0's chunk has fewer labels than rank 1's
    if documents:  # packed rows: documents of 7, 13 and 12 tokens, positions from 0 in each
        ids = torch.tensor([0] * 7 + [1] * 13 + [2] * 12)
        batch["document_ids"] = ids.expand(2, SEQ).clone()
        batch["positions"] = torch.cat([torch.arange(7), torch.arange(13), torch.arange(12)]).expand(2, SEQ).clone()
    return batch


def _attention_inputs(model):
    """Keep the gradient of every attention module's input."""
    seen = []

    def keep(_module, args):
        x = args[0]
        x.retain_grad()
        seen.append(x)

    for layer in model.layers:
        layer.attention.register_forward_pre_hook(keep)
    return seen


def _cp_worker(rank: int, world: int, documents: bool):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from framework.distributed.context_parallel import active, apply_context_parallel, split_batch
    from framework.models.tasks import IGNORE_INDEX, causal_lm_summed, cross_entropy

    batch = _batch(documents)
    reference = _model()
    ref_inputs = _attention_inputs(reference)
    packed = {k: batch[k] for k in ("positions", "document_ids") if k in batch}
    ref_loss = cross_entropy(reference(batch["input_ids"], **packed), batch["labels"])
    ref_loss.backward()

    model = _model()
    inputs = _attention_inputs(model)
    apply_context_parallel(model, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))["cp"])
    part, labelled = split_batch(batch, rank, world, IGNORE_INDEX)
    with active(model):
        loss = causal_lm_summed(model, part) * world / labelled
        loss.backward()
    whole = loss.detach().clone()
    dist.all_reduce(whole)  # the engine's average over the cp ranks
    chunk = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    grads = []
    for p, q in zip(model.parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        grads.append((g / world - q.grad).abs().max().item())
    return {
        "loss": abs(whole.item() / world - ref_loss.item()),
        # each rank's attention input gets the gradient of every rank's loss through the exchange:
        # cp x the mean loss's, which is one process's
        "attention_inputs": max(
            (x.grad / world - r.grad[:, chunk]).abs().max().item() for x, r in zip(inputs, ref_inputs)
        ),
        "params": max(grads),
    }


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "packed_documents"])
def test_two_ranks_split_each_sequence_and_match_one_process(documents):
    """cp=2: each rank holds 16 of 32 tokens; the loss over the whole sequence (labels masked
    unevenly between the chunks), the gradients of the attention inputs and of every parameter
    equal one process's (1e-5, float32 sums in another order), causal and with packed documents
    (positions restart, no attention across documents)."""
    for res in run_ranks(_cp_worker, 2, args=(documents,), timeout_s=120):
        assert res["loss"] < 1e-5 and res["attention_inputs"] < 1e-5 and res["params"] < 1e-5, res


def test_cp2_and_dp2_x_cp2_jobs_match_one_process(tmp_path):
    """The command on 2 ranks (cp=2) and 4 (dp_shard=2 x cp=2), and cp=2 x tp=2 on 4 with each
    engine (torch's `fully_shard` joins the flattened dp_shard x cp mesh with the tp mesh: [Note:
    flattened dims stay in their mesh]): the losses of 5 steps at 1024 tokens per sequence equal
    one process's (1e-5)."""
    args = [*TINY, "parallelism.cp=2", "data.seq_len=1024", "trainer.max_steps=5", "trainer.eval_interval=0"]
    args += ["checkpoint.save_final=false", "trainer.global_batch_size=4"]
    losses = {}
    layouts = {
        "one": (1, ["parallelism.cp=1"]),
        "cp2": (2, []),
        "dp2xcp2": (4, []),
        "cp2xtp2": (4, ["parallelism.tp=2"]),
        "cp2xtp2-torch": (4, ["parallelism.tp=2", "parallelism.engine=torch"]),
    }
    for name, (ranks, extra) in layouts.items():
        run = tmp_path / name
        out = run_main([*args, *extra, f"cluster.nproc_per_node={ranks}", f"hydra.run.dir={run}"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert name == "one" or " cp=2," in out.stderr, out.stderr[-2000:]
        losses[name] = [r["loss"] for r in read_metrics(run)]
    for name in ("cp2", "dp2xcp2", "cp2xtp2", "cp2xtp2-torch"):
        assert losses[name] == pytest.approx(losses["one"], abs=1e-5), name


def test_cp2_with_hybrid_sharding_matches_one_process(tmp_path):
    """dp_replicate=2 x cp=2 on 4 ranks (strategy=hybrid: gradients reduced over the cp pair, then
    all-reduced over the replicas), both engines: the losses and gradient norms of 5 steps and the
    exported weights equal one process's (1e-5, float32 sums in another order). 4 ranks is the
    smallest layout with both (2 ranks hold a replica pair or a cp pair, not both)."""
    from safetensors.torch import load_file

    args = [*TINY, "data.seq_len=1024", "trainer.max_steps=5", "trainer.eval_interval=0", "checkpoint.save_final=false"]
    args += ["trainer.global_batch_size=4", "checkpoint.export_safetensors=true"]
    hybrid = ["parallelism.strategy=hybrid", "parallelism.dp_replicate=2", "parallelism.cp=2"]
    layouts = {
        "one": (1, []),
        "rep2xcp2-native": (4, hybrid),
        "rep2xcp2-torch": (4, [*hybrid, "parallelism.engine=torch"]),
    }
    runs = {}
    for name, (ranks, extra) in layouts.items():
        run = tmp_path / name
        out = run_main([*args, *extra, f"cluster.nproc_per_node={ranks}", f"hydra.run.dir={run}"], tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        assert name == "one" or "dp_replicate=2 dp_shard=1 tp=1 cp=2" in out.stderr, out.stderr[-2000:]
        runs[name] = (read_metrics(run), load_file(str(run / "checkpoints" / "export" / "model.safetensors")))
    one, one_w = runs.pop("one")
    for name, (metrics, weights) in runs.items():
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in metrics] == pytest.approx([r[key] for r in one], abs=1e-5), (name, key)
        for tensor, want in one_w.items():
            assert (weights[tensor] - want).abs().max().item() <= 1e-5, (name, tensor)
