"""Compile ahead in parallel: run each (operator, policy, schedule, shape) once, untimed, in a pool of
worker processes, so that Triton's on-disk cache holds every kernel variant (ours and FLA's) before a
single process measures. Compilation is CPU-bound and takes minutes on a fresh machine; timing needs the
GPU to itself, so the two are kept apart. fla-core's autotuned kernels are compiled first, their
configurations shared out over all the processes (`autotune_parts`).

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
    on the Triton interpreter (nothing is cached there: for tests of this machinery only).

    On CUDA with several processes, first every process compiles its share of fla-core's autotuning
    configurations for each (operator, policy) with FLA (`autotune_parts.config_part`): a task compiles FLA's
    kernels config after config in one process, and there are usually fewer tasks (one per head count) than
    processes. The tasks then run our side only: every FLA binary is compiled by then, and FLA run again here,
    in several processes at once, would only time its configurations on a shared GPU (and leave those picks in
    Triton's on-disk cache). The measuring process times them itself (`fla_baseline.autotune_here`)."""
    jobs = max(1, jobs or default_jobs())
    workers = [TrialWorker(device=device) for _ in range(jobs)]
    try:
        fla_compiled = device == "cuda" and jobs > 1
        if fla_compiled:
            _precompile_fla_shares(tasks, workers, timeout_s)
        return _run_tasks(tasks, workers[:max(1, min(jobs, len(tasks)))], timeout_s, device,
                          with_fla=not fla_compiled)
    finally:
        for w in workers:
            w.stop()


def _in_threads(fn, workers: list[TrialWorker]) -> None:
    threads = [threading.Thread(target=fn, args=(i, w), daemon=True) for i, w in enumerate(workers)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def fla_warm_request(op: str, policy: str, shapes, K: int, V: int, part: list[int] | None = None) -> dict[str, Any]:
    """A worker request that runs FLA once at each shape, untimed (our side not at all); with part=[i, n] its
    autotuners compile only their i-th share of configurations (`autotune_parts.config_part`)."""
    msg = {"kind": "warm", "device": "cuda", "op": op, "policy": policy, "shapes": [list(s) for s in shapes],
           "K": K, "V": V, "ours": False, "with_fla": True}
    if part is not None:
        msg["autotune_part"] = list(part)
    return msg


def precompile_fla_shares(groups: dict[tuple[str, str, int, int], list], workers: list[TrialWorker],
                          timeout_s: float, go_on=lambda: True) -> None:
    """Every worker at once runs FLA at the shapes of each (op, policy, K, V) group with its share of the
    autotuners' configurations, so fla-core's kernels compile in parallel instead of config after config in one
    process. `go_on()` False stops a worker before its next request. Outcomes are left to later runs to report."""
    def share(i: int, worker: TrialWorker) -> None:
        for (op, policy, K, V), shapes in groups.items():
            if not go_on():
                return
            worker.request(fla_warm_request(op, policy, shapes, K, V, part=[i, len(workers)]), timeout_s)

    _in_threads(share, workers)


def _precompile_fla_shares(tasks: list[WarmTask], workers: list[TrialWorker], timeout_s: float) -> None:
    groups: dict[tuple[str, str, int, int], list] = {}
    for t in tasks:
        if t.with_fla:
            groups.setdefault((t.op, t.policy, t.K, t.V), []).extend(t.shapes)
    precompile_fla_shares(groups, workers, timeout_s)


def _run_tasks(tasks: list[WarmTask], workers: list[TrialWorker], timeout_s: float, device: str,
               with_fla: bool = True) -> list[WarmResult]:
    """Each task in the first free worker; with_fla=False runs our side only, whatever the task says."""
    results: list[WarmResult | None] = [None] * len(tasks)
    lock = threading.Lock()
    queue = list(range(len(tasks)))

    def loop(_: int, worker: TrialWorker) -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            t = tasks[i]
            t0 = time.perf_counter()
            out = worker.request({"kind": "warm", "device": device, "op": t.op, "policy": t.policy,
                                  "schedule": t.schedule, "shapes": [list(s) for s in t.shapes], "K": t.K, "V": t.V,
                                  "with_fla": t.with_fla and with_fla}, timeout_s)
            results[i] = WarmResult(t, out.status, time.perf_counter() - t0, out.message, out.errors)

    _in_threads(loop, workers)
    return [r for r in results if r is not None]
