"""Cost of `rewy_tune.lookup` after warm-up (the dispatcher's hot path: one dictionary hit).

Bar (issue 6): <= 2 us per call. Runs on any machine (CPU: the interpreter device); no database needed
(`--db` points it at one; a missing file gives the built-in defaults).

    python benchmarks/lookup_cost.py [--calls 200000] [--db PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--db", default=None, help="database URL or SQLite path (default: REWY_DB or the data dir)")
    args = parser.parse_args()

    from rewy_tune.dispatch import lookup
    from rewy_tune.problem import Problem

    problems = [Problem("gdn", "R", "bf16", B=b, T=t, H=16, K=128, V=128) for b, t in ((1, 2048), (4, 4096), (8, 1000))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for p in problems:  # warm-up: fills the cache
            schedule, reason = lookup(p, db_url=args.db)
            print(f"{p.bucket().label}: {reason}")
    n = args.calls // len(problems)
    per_call = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            for p in problems:
                lookup(p, db_url=args.db)
        per_call.append((time.perf_counter() - t0) / (n * len(problems)) * 1e6)
    print(f"lookup after warm-up: median {statistics.median(per_call):.3f} us/call "
          f"(min {min(per_call):.3f}, {args.repeats} repeats x {n * len(problems)} calls; bar 2 us)")


if __name__ == "__main__":
    main()
