"""Adding a model family is one folder plus one YAML: a toy family kept in this test folder
(`toy_family/`: its module and its conf/model YAML) trains through `main.py` on 2 ranks, with
its own typed arguments, and a wrong argument is refused in one line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY, read_metrics, run_main

CONF = Path(__file__).resolve().parent / "toy_family" / "conf"
TOY = [f"hydra.searchpath=[file://{CONF}]", "model=toy_mlp"]


def test_a_family_from_a_test_folder_trains_through_main(tmp_path):
    run = tmp_path / "run"
    args = TINY + TOY + ["trainer.max_steps=12", "optimizer.lr=0.01", "checkpoint.save_final=false"]
    out = run_main(args + [f"hydra.run.dir={run}"], cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(run) if "loss" in row]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.1, losses  # it learns the synthetic sequences
    # its own arguments built it: 64 x 32 embedding, 3 blocks of (32x64 + 64 + 64x32 + 32), head 32 x 64 + 64
    params = 64 * 32 + 3 * (32 * 64 + 64 + 64 * 32 + 32) + 32 * 64 + 64
    assert f"model=toy_mlp ({params / 1e6:.1f}M parameters) on 2 rank(s)" in out.stderr + out.stdout


def test_a_family_argument_it_does_not_have_is_refused(tmp_path):
    out = run_main(TINY + TOY + ["+model.args.heads=4", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: model.args.heads: model.name=toy_mlp has no such argument; its arguments are vocab_size, width, depth"
    ]


def test_stage_plan_says_the_family_has_no_shapes(tmp_path):
    out = run_main(TINY + TOY + ["stage=plan", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: model.name=toy_mlp: stage=plan has no shapes for this family" in out.stdout
    assert "Traceback" not in out.stdout + out.stderr


def test_family_arguments_are_typed():
    """model.args against the family's dataclass: an int is a fine float, a bool is not an int."""
    import pytest

    from framework.config.schema import ModelConfig
    from framework.errors import UserInputError
    from framework.models.cnn.family import FAMILY as CNN

    args = CNN.args_of(ModelConfig(name="digits_cnn", args={"channels": 8, "dropout": 0}))
    assert (args.channels, args.dropout, args.hidden) == (8, 0, 128)
    for bad, said in (({"channels": True}, "give an integer"), ({"hidden": "wide"}, "give an integer")):
        with pytest.raises(UserInputError, match=f"model.args.{next(iter(bad))}=.*{said}"):
            CNN.args_of(ModelConfig(name="digits_cnn", args=bad))


def test_the_family_list_names_every_family_folder_and_each_record_agrees_with_its_spec():
    """The families of framework/models/ are an explicit list (framework/models/families.py), not
    the folders found by looking: a folder with a family.py left out of the list fails here, and
    each spec's NAMES are the names its record builds (one place says which names a family has)."""
    from framework.models.families import FAMILIES

    folders = sorted(p.parent.name for p in (REPO / "framework" / "models").glob("*/family.py"))
    assert sorted(spec.__name__.split(".")[-2] for spec in FAMILIES) == folders == ["cnn", "hf", "llama"]
    for spec in FAMILIES:
        assert spec.__name__.endswith(".spec")
        assert spec.record().names == spec.NAMES
    registry = (REPO / "framework" / "models" / "registry.py").read_text()
    assert "listdir" not in registry and "importlib" not in registry


def test_the_torch_free_checks_and_plans_load_no_torch_and_refuse_an_unknown_name():
    """The launcher's path (job checks, the planner's shapes, an unknown model.name) asks the specs
    alone: a fresh interpreter loads no torch through it, and an unknown name is refused in one
    line naming the choices, as the registry would."""
    from framework.models.families import family_names

    code = (
        "import sys\n"
        "from framework.config import compose_config, to_config\n"
        "from framework.errors import UserInputError\n"
        "from framework.models.families import job_model_problems, plan_shape\n"
        "cfg = to_config(compose_config(['model=debug', 'data=synthetic', 'parallelism.tp=3']))\n"
        "print(job_model_problems(cfg))\n"
        "print(plan_shape(cfg.model, 0).n_layers)\n"
        "cfg.model.name = 'gpt2'\n"
        "try:\n    plan_shape(cfg.model, 0)\nexcept UserInputError as exc:\n    print(exc)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    problems, layers, refusal, torch_modules = out.stdout.splitlines()
    assert "model.args.n_heads=4 is not divisible by parallelism.tp=3" in problems
    assert layers == "2"
    names = ", ".join(family_names())
    assert "digits_cnn, hf" in names and "debug" in names
    assert refusal == (
        f"model.name='gpt2' is not a model this framework builds; choose one of {names} "
        "(a Hugging Face model: model=hf model.path=<its directory>)"
    )
    assert torch_modules == "[]"
