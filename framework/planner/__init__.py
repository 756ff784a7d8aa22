"""Will a job fit, and how fast will it run? Arithmetic over the config, no torch (the launcher
imports it). See docs/planner.md."""

from framework.planner.estimate import Job, Memory, Traffic, memory, timing, traffic  # noqa: F401
from framework.planner.plan import (  # noqa: F401
    estimate,
    fit_problems,
    format_plan,
    job_from_config,
    make_plan,
    plan_json,
    run_plan,
)
from framework.planner.zero import zero_model_state_bytes  # noqa: F401
