"""`trainer.profile=true`: every rank writes a Chrome trace (what Perfetto and TensorBoard's
profiler plugin open) of the scheduled steps, holding the engine's labels with unit names."""

from __future__ import annotations

import json

from conftest import TINY, run_main


def test_profile_writes_a_trace_per_rank_with_the_engines_unit_labels(tmp_path):
    run = tmp_path / "run"
    out = run_main(
        TINY + ["trainer.max_steps=4", "trainer.profile=true", "trainer.eval_interval=0", f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"profile of the traced steps written to {run}/profile" in out.stderr
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank_{rank:05d}.pt.trace.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]  # complete events, Chrome format
        names = {e["name"] for e in events}
        for label in ("fsdp::all_gather(layers.0)", "fsdp::reduce_scatter(layers.1)", "fsdp::pre_forward"):
            assert label in names, sorted(n for n in names if n.startswith("fsdp::"))
        assert all("ts" in e and "dur" in e for e in events[:100])
        # two recorded steps (profile_active=2): the optimizer ran twice in the trace
        assert sum(1 for e in events if e["name"].startswith("Optimizer.step")) == 2, sorted(names)[:50]
