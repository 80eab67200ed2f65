"""The compile-ahead pool (`rewy_tune.warmup`) on the CPU interpreter: tasks run in worker processes, results
come back in task order, a failing task is reported (not raised) and the others still run."""

from __future__ import annotations

from rewy_tune import warmup
from rewy_tune.search import default_schedule


def test_warm_reports_each_task_in_order_and_survives_a_bad_one():
    good = default_schedule("gdn", None, 32, 32).to_dict()
    tasks = [
        warmup.WarmTask("gdn", "R", good, [(1, 64, 1), (1, 80, 2)], K=32, V=32, with_fla=False),
        warmup.WarmTask("gdn", "R", good, [(1, 64, 1)], K=512, V=512, with_fla=False),  # K > 256: refused
        warmup.WarmTask("deltanet", "A", default_schedule("deltanet", None, 32, 32).to_dict(), [(1, 64, 1)],
                        K=32, V=32, with_fla=False),
    ]
    results = warmup.warm(tasks, jobs=2, timeout_s=300, device="cpu")
    assert [r.task for r in results] == tasks
    assert [r.status for r in results] == ["ok", "runtime_error", "ok"], [r.message for r in results]
    assert "B,T,H=[1, 64, 1]" in results[1].message and "256" in results[1].message
