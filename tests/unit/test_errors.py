"""[Note: bad input vs bugs] (framework/errors.py): only a UserInputError is a refusal; every other
exception a rank raises keeps its traceback and the crash status, in-process and without a group."""

import pytest
import torch

from framework.config.schema import Config
from framework.errors import EXIT_BAD_INPUT, EXIT_CRASH, UserInputError
from framework.runtime import Runtime


def _train_raising(monkeypatch, exc: BaseException) -> int:
    import framework.trainer as trainer
    from framework.stages import stage_of

    def raises(cfg, rt, data=None):
        raise exc

    monkeypatch.setattr(trainer, "build_job", raises)
    rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    return trainer._train(Config(), rt, stage_of("training"))


def test_refused_input_is_one_line_and_status_2(monkeypatch, capsys):
    status = _train_raising(monkeypatch, UserInputError("data.paths: /x.bin/.idx not found; prepare it"))
    err = capsys.readouterr().err
    assert status == EXIT_BAD_INPUT
    assert err == "error: data.paths: /x.bin/.idx not found; prepare it\n"


@pytest.mark.parametrize(
    "exc",
    [ValueError("a builtin ValueError from deep inside"), NotImplementedError("not written yet"), KeyError("exp_avg")],
)
def test_any_other_exception_keeps_its_traceback(monkeypatch, capsys, exc):
    status = _train_raising(monkeypatch, exc)
    err = capsys.readouterr().err
    assert status == EXIT_CRASH
    assert "Traceback (most recent call last)" in err and f"{type(exc).__name__}: " in err, err
    assert "rank 0" in err  # named by its rank
