"""The compile-ahead pool (`rewy_tune.warmup`) on the CPU interpreter: tasks run in worker processes, results
come back in task order, a failing task is reported (not raised) and the others still run."""

from __future__ import annotations

import types

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


def test_cuda_compile_ahead_splits_fla_autotuning_configs_over_every_process_first(monkeypatch):
    # Bench compiled ahead in one task per head count (4 tasks for gdn2 R and A on 12 processes): each compiled
    # fla-core's autotuning configurations one after another. Now all processes first compile a share each.
    log = []

    class Stub:
        def __init__(self, device):
            self.id = len(stubs)
            stubs.append(self)

        def request(self, msg, timeout):
            log.append((self.id, msg))
            return types.SimpleNamespace(status="ok", message=None, errors={})

        def stop(self):
            pass

    stubs = []
    monkeypatch.setattr(warmup, "TrialWorker", Stub)
    sched = default_schedule("gdn2", (9, 0), 128, 128, "bf16").to_dict()
    tasks = [warmup.WarmTask("gdn2", policy, sched, shapes) for policy in ("R", "A")
             for shapes in ([(1, 512, 4), (1, 8192, 4)], [(1, 2048, 16)])]
    results = warmup.warm(tasks, jobs=3, device="cuda")
    assert [r.status for r in results] == ["ok"] * 4 and len(stubs) == 3
    shares = [(i, m["policy"], tuple(m["autotune_part"])) for i, m in log if "autotune_part" in m]
    assert sorted(shares) == [(i, p, (i, 3)) for i in range(3) for p in ("A", "R")]
    share_msgs = [m for _, m in log if "autotune_part" in m]
    assert all(not m["ours"] and m["with_fla"] for m in share_msgs)
    assert sorted(map(tuple, share_msgs[0]["shapes"])) == [(1, 512, 4), (1, 2048, 16), (1, 8192, 4)]
    last_share = max(k for k, (_, m) in enumerate(log) if "autotune_part" in m)
    assert all("autotune_part" not in m for _, m in log[last_share + 1:]) and len(log) - last_share - 1 == 4
    # the tasks then run our side only: FLA run again there, several processes at once, would time its
    # configurations on a shared GPU and leave those picks in Triton's on-disk cache
    assert all(m.get("ours", True) and not m["with_fla"] for _, m in log[last_share + 1:])


def test_one_process_runs_fla_with_the_task(monkeypatch):
    # without the shared precompile (one process, or the interpreter) a task still warms FLA's side itself
    log = []

    class Stub:
        def __init__(self, device):
            pass

        def request(self, msg, timeout):
            log.append(msg)
            return types.SimpleNamespace(status="ok", message=None, errors={})

        def stop(self):
            pass

    monkeypatch.setattr(warmup, "TrialWorker", Stub)
    sched = default_schedule("gdn", (9, 0), 128, 128, "bf16").to_dict()
    warmup.warm([warmup.WarmTask("gdn", "R", sched, [(1, 512, 4)])], jobs=1, device="cuda")
    assert [m["with_fla"] for m in log] == [True] and "autotune_part" not in log[0]
