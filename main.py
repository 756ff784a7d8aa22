"""Entry point: compose the config, validate it, then train (or prepare data) on every rank.

python main.py                              # the main job: a small GPT on 2 local ranks
python main.py model=debug data=synthetic trainer.max_steps=10
torchrun --nproc_per_node=4 main.py parallelism.tp=2
"""

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from framework.config import register_schema
from framework.entrypoint import fix_run_dir_under_torchrun, start
from framework.errors import EXIT_BAD_INPUT, record_status

register_schema()
_started = False  # set once the task runs: an exit before that is a refused config


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> int:
    global _started
    _started = True
    code = start(dict_cfg, HydraConfig.get().runtime.output_dir)
    record_status(code)
    if code:
        sys.exit(code)
    return 0


def _end(code: int) -> None:
    """Exit with `code` without the interpreter's teardown: everything is written and closed by
    now, and unloading torch and its atexit hooks costs a second of every job's wall time."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.argv = fix_run_dir_under_torchrun(sys.argv)
    try:
        main()
    except SystemExit as exc:
        # Hydra exits 1 when it refuses a composition (a typo, a wrong type, an unknown group
        # option); report that as bad input, like every other config error.
        if exc.code == 1 and not _started:
            record_status(EXIT_BAD_INPUT)
            if os.environ.get("RANK", "0") == "0":
                raise SystemExit(EXIT_BAD_INPUT) from None
        if _started and isinstance(exc.code, int):
            _end(exc.code)
        raise
    if _started:
        _end(0)
