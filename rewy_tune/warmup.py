"""Compile ahead in parallel: run each (operator, policy, schedule, shape) once, untimed, in a pool of
worker processes, so that Triton's on-disk cache holds every kernel variant (ours and FLA's) before a
single process measures. Compilation is CPU-bound and takes minutes on a fresh machine; timing needs the
GPU to itself, so the two are kept apart.

A failure is reported per task, never raised: the measuring process then meets (and reports) it itself.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rewy_tune.trial_worker import TrialWorker


@dataclass
class WarmTask:
    op: str
    policy: str
    schedule: dict[str, Any]
    shapes: list[tuple[int, int, int]]
    K: int = 128
    V: int = 128
    with_fla: bool = True


@dataclass
class WarmResult:
    task: WarmTask
    status: str
    seconds: float
    message: str | None = None
    errors: dict[str, Any] = field(default_factory=dict)


def default_jobs() -> int:
    """Half the cores, at most 8 (each process holds a CUDA context and compiles on one core)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def warm(tasks: list[WarmTask], jobs: int | None = None, timeout_s: float = 600.0,
         device: str = "cuda") -> list[WarmResult]:
    """Run every task once in `jobs` worker processes; results in task order. `device="cpu"` runs our side
    on the Triton interpreter (nothing is cached there: for tests of this machinery only)."""
    jobs = max(1, min(jobs or default_jobs(), len(tasks) or 1))
    results: list[WarmResult | None] = [None] * len(tasks)
    lock = threading.Lock()
    queue = list(range(len(tasks)))

    def loop() -> None:
        worker = TrialWorker(device=device)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                t = tasks[i]
                t0 = time.perf_counter()
                out = worker.request({"kind": "warm", "device": device, "op": t.op, "policy": t.policy,
                                      "schedule": t.schedule, "shapes": [list(s) for s in t.shapes], "K": t.K, "V": t.V,
                                      "with_fla": t.with_fla}, timeout_s)
                results[i] = WarmResult(t, out.status, time.perf_counter() - t0, out.message, out.errors)
        finally:
            worker.stop()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(jobs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [r for r in results if r is not None]
