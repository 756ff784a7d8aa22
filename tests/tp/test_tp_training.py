"""Tensor parallel (composed with sharding) trains exactly like one process, and its checkpoints
reshard across layouts.

Two spawns for the whole module (a spawn costs seconds, a layout's 10 steps a fraction of it):
    4 ranks: dp_shard=2 x tp=2, +-sequence parallel, both engines; hybrid dp_replicate=2 x
             dp_shard=1 x tp=2, both engines (native also with sequence parallel); also writes a
             checkpoint after 5 steps (dp2 x tp2 + sequence parallel, torch engine)
    2 ranks: tp=2, +-sequence parallel, both engines; a vocabulary tp does not divide (255 rows:
             uneven shards); tied embeddings; and the checkpoint loaded at tp=1 x dp=2 and at tp=2 x dp=1, trained
             on to step 10

[Note: tolerance of the tensor-parallel comparisons]
fp32, 1e-5 absolute on every step's loss, every final parameter and the final logits (gathered from
the vocabulary shards with `full`, as sampling does; 1e-4, see LOGITS_TOL). The parallel runs compute
the same sums in another order: a row-wise layer adds t partial matmuls (the all-reduce) where one
process does one matmul, the vocabulary-parallel log-softmax combines per-shard maxima and sums,
and gradients are averaged over dp ranks. Each reordering changes a result by a few ulps
(~1e-7 relative); 10 SGD steps with momentum carry and amplify those differences, which stay
around 1e-6 on weights of size ~0.02-1 and on losses of ~5.5. A real bug (a gradient missing its
all-reduce, scaled by t or dp, a wrong shard of the vocabulary, a misplaced norm) moves the
losses by 1e-3 or more from the first step on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.tp.tp_cases import Job, Layout, job_key, rank_main, reference

TOL = 1e-5  # see [Note: tolerance of the tensor-parallel comparisons]
# The final logits sum dim=64 products of RMS-normalised activations (size ~1) with head weights
# that each may differ by ~1e-6 (above): the differences add up to ~64 x 1e-6. Logits are ~1-2.
LOGITS_TOL = 1e-4
SAVE_AT = 5
ENGINES = ["torch", "native"]

FOUR_RANK = [Layout(2, 2, sp, engine) for engine in ENGINES for sp in (False, True)]
# Hybrid sharding composed with tp: replicate 2 x shard 1 x tp 2.
HYBRID = [Layout(1, 2, False, "torch", dp_replicate=2)] + [
    Layout(1, 2, sp, "native", dp_replicate=2) for sp in (False, True)
]
TWO_RANK = [Layout(1, 2, sp, engine) for engine in ENGINES for sp in (False, True)]
UNEVEN_VOCAB = [Layout(1, 2, sp, "torch", vocab=255) for sp in (False, True)]
TIED = [Layout(1, 2, True, "torch", tie=True)]
# The checkpoint's source layout, and the layouts it is loaded into.
SOURCE = Layout(2, 2, True, "torch")
# (One rank is covered through main.py and the CheckpointManager in test_tp_checkpoint.py, which
# saves a spawn here.)
TARGETS = [Layout(2, 1), Layout(1, 2), Layout(1, 2, True)]


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.fixture(scope="module")
def ckpt_dir() -> Path:
    # Not tmp_path_factory: a concurrent pytest session prunes old base temp dirs (see
    # test_tp_checkpoint.py).
    with tempfile.TemporaryDirectory(prefix="tp_ckpt_") as tmp:
        yield Path(tmp) / "step5"


@pytest.fixture(scope="module")
def four_rank(ckpt_dir):
    jobs = [
        Job(layout, save=str(ckpt_dir) if layout == SOURCE else None, save_at=SAVE_AT) for layout in FOUR_RANK + HYBRID
    ]
    return run_ranks(rank_main, 4, args=(jobs,), timeout_s=240)[0]


@pytest.fixture(scope="module")
def two_rank(four_rank, ckpt_dir):
    jobs = [Job(layout) for layout in TWO_RANK + UNEVEN_VOCAB + TIED]
    jobs += [Job(t, first_step=SAVE_AT, load=str(ckpt_dir)) for t in TARGETS if t.dp_shard * t.tp == 2]
    return run_ranks(rank_main, 2, args=(jobs,), timeout_s=180)[0]


def _check(result: dict, ref, first_step: int = 0) -> None:
    if "refused" in result:  # no layout here is expected to be refused
        pytest.fail(result["refused"], pytrace=False)
    ref_losses, ref_params = ref
    expected = ref_losses[first_step:]
    assert len(result["losses"]) == len(expected)
    for step, (got, want) in enumerate(zip(result["losses"], expected), start=first_step + 1):
        assert abs(got - want) <= TOL, f"step {step}: loss {got:.8f}, single process {want:.8f}"
    assert set(result["params"]) == set(ref_params)
    for name, want in ref_params.items():
        got = torch.from_numpy(result["params"][name])
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        err = (got - want).abs().max().item()
        tol = LOGITS_TOL if name == "logits" else TOL
        assert err <= tol, f"{name}: max |diff| {err:.2e} from the single-process run"


@pytest.mark.parametrize("layout", FOUR_RANK, ids=lambda layout: layout.name)
def test_dp2_tp2_matches_single_process(four_rank, ref, layout):
    _check(four_rank[job_key(Job(layout))], ref)


@pytest.mark.parametrize("layout", HYBRID, ids=lambda layout: layout.name)
def test_hybrid_rep2_dp1_tp2_matches_single_process(four_rank, ref, layout):
    """Gradients reduce-scattered over dp_shard, then all-reduced over dp_replicate, of TP-local
    tensors: the same numbers as one process."""
    _check(four_rank[job_key(Job(layout))], ref)


@pytest.mark.parametrize("layout", TWO_RANK, ids=lambda layout: layout.name)
def test_tp2_matches_single_process(two_rank, ref, layout):
    _check(two_rank[job_key(Job(layout))], ref)


@pytest.mark.parametrize("layout", UNEVEN_VOCAB, ids=lambda layout: layout.name)
def test_tp2_uneven_vocabulary_matches_single_process(two_rank, layout):
    """255 rows over 2 ranks (128 + 127): DTensor's uneven shards give the same numbers, which
    is why validation only warns when tp does not divide the vocabulary."""
    _check(two_rank[job_key(Job(layout))], reference(vocab=layout.vocab))


@pytest.mark.parametrize("layout", TIED, ids=lambda layout: layout.name)
def test_tp2_tied_embeddings_match_single_process(two_rank, layout):
    """The head and the embedding share one vocabulary-sharded table after the plan is applied."""
    _check(two_rank[job_key(Job(layout))], reference(tie=True))


@pytest.mark.parametrize("target", TARGETS, ids=lambda layout: layout.name)
def test_checkpoint_reshards_and_continues(two_rank, ref, ckpt_dir, target):
    """Written at dp2 x tp2 (+SP) after 5 steps, loaded into another layout: steps 6-10 and the
    final weights are those of the uninterrupted single-process run."""
    _check(two_rank[job_key(Job(target, load=str(ckpt_dir)))], ref, first_step=SAVE_AT)


def test_an_engine_refusal_fails_its_layout(monkeypatch):
    """No layout here is expected to be refused: an engine's NotImplementedError (a tensor-parallel
    composition it lacks) fails that layout's test with the engine's message, never skips it."""
    from types import SimpleNamespace

    from tests.tp import tp_cases

    def refuse(*args, **kwargs):
        raise NotImplementedError("fully_shard: this composition is not supported")

    monkeypatch.setattr(tp_cases, "build_mesh", lambda dims, device: None)
    monkeypatch.setattr(tp_cases, "parallelize", refuse)
    monkeypatch.setattr(tp_cases, "dist", SimpleNamespace(barrier=lambda: None))
    for engine in ENGINES:
        job = Job(Layout(1, 2, engine=engine))
        result, outcome = rank_main(0, 2, [job])[job_key(job)], None
        try:
            _check(result, ref=None)
        except BaseException as exc:  # pytest's skip and fail outcomes are BaseExceptions
            outcome = exc
        assert isinstance(outcome, pytest.fail.Exception), (engine, type(outcome))
        assert str(outcome) == (
            f"the {engine} engine refused {job.layout.name}: fully_shard: this composition is not supported"
        )
