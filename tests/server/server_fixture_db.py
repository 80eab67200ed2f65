"""A dashboard fixture database written through `rewy_tune.db.queries` only (also used by the benchmark).

Two devices (h200, a100), two operators (gdn, deltanet), four campaigns with mixed trial statuses,
FLA baselines, promoted winners (one under an older Triton, so stale), and the a100 winner's schedule
also measured on the h200 so the cross-device cost is known.
"""

from __future__ import annotations

import random

from rewy_tune.db import queries
from rewy_tune.db.engine import open_db
from rewy_tune.device import Device, current_environment
from rewy_tune.problem import Problem
from rewy_tune.schedule import Schedule

H200 = Device("NVIDIA H200", (9, 0), 132, 150_013_493_248)
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85_100_000_000)
SHAPES = ((1, 2048, 16), (4, 4096, 32), (8, 1024, 8))
STATUSES = ("ok",) * 14 + ("constraint", "compile_error", "runtime_error", "timeout", "incorrect", "nondeterministic")


def label(shape) -> str:
    B, T, H = shape
    return f"B{B}-T{T}-H{H}"


def environment(gpu: bool = True, **changes):
    env = current_environment()
    values = env.to_dict() | ({"driver": "570.86.15", "cuda": "12.8"} if gpu else {}) | changes
    return type(env)(**values)


def random_schedule(rng: random.Random) -> dict:
    return Schedule().replace(
        chunk_size=rng.choice((32, 64)),
        consumer=rng.choice(("joint", "separate")),
        consumer_cfg={"num_warps": rng.choice((2, 4, 8)), "block_v": rng.choice((32, 64, 128))},
        reverse_scan={"num_stages": rng.choice((1, 2, 3))},
    ).to_dict()


def latency(schedule: dict, shape, device_factor: float, rng: random.Random) -> float:
    B, T, H = shape
    base = 1e-5 * B * T * H * device_factor
    warps = {2: 1.5, 4: 1.0, 8: 0.85}[schedule["consumer_cfg"]["num_warps"]]
    block = {32: 1.2, 64: 1.0, 128: 0.9}[schedule["consumer_cfg"]["block_v"]]
    return base * warps * block * (1.05 if schedule["consumer"] == "separate" else 1.0) * rng.uniform(0.97, 1.03)


def fill(session, device: Device, env, op: str, n_trials: int, rng: random.Random, *,
         extra_schedules=(), status: str = "finished") -> tuple[int, dict]:
    """One campaign of `n_trials` (trial 0 is the default schedule); returns (campaign id, best schedule)."""
    factor = 1.0 if device is H200 else 1.6
    c = queries.create_campaign(session, device=device, environment=env, op=op, policies=("R",),
                                workload={"shapes": [list(s) for s in SHAPES], "dtype": "bf16", "K": 128, "V": 128},
                                budget={"trials": n_trials, "time_budget_s": 3600})
    best: tuple[float, dict] | None = None
    schedules = [Schedule().to_dict(), *extra_schedules]
    for number in range(n_trials):
        schedule = schedules[number] if number < len(schedules) else random_schedule(rng)
        st = "ok" if number < len(schedules) else rng.choice(STATUSES)
        samples = {}
        if st in ("ok", "incorrect", "nondeterministic"):
            for shape in SHAPES:
                mid = latency(schedule, shape, factor, rng)
                samples[label(shape)] = [mid * rng.uniform(0.98, 1.02) for _ in range(7)]
        queries.add_trial(session, c.id, number=number, schedule=schedule, status=st, samples_ms=samples,
                          errors={"dq": {"rel_rms": 1e-3}} if st == "incorrect" else {},
                          compile_s=rng.uniform(1, 5), bench_s=rng.uniform(0.1, 1),
                          message=None if st == "ok" else f"{st}: synthetic")
        if st == "ok":
            total = sum(sum(v) for v in samples.values())
            if best is None or total < best[0]:
                best = (total, schedule)
    for shape in SHAPES:
        mid = latency(Schedule().to_dict(), shape, factor, rng) * 1.3
        queries.add_baseline(session, c.id, shape=label(shape), samples_ms=[mid * rng.uniform(0.98, 1.02)
                                                                            for _ in range(7)])
    queries.finish_campaign(session, c.id, status)
    return c.id, best[1]


def promote(session, campaign_id: int, op: str, schedule: dict, device: Device, rng: random.Random) -> None:
    factor = 1.0 if device is H200 else 1.6
    for shape in SHAPES:
        B, T, H = shape
        bucket = Problem(op, "R", "bf16", B=B, T=T, H=H, K=128, V=128).bucket()
        ms = latency(schedule, shape, factor, rng)
        queries.promote_winner(session, campaign_id=campaign_id, bucket=bucket, schedule=schedule,
                               latency_ms=ms, fla_latency_ms=latency(Schedule().to_dict(), shape, factor, rng) * 1.3,
                               replace=True)


def build(path: str, trials: int = 80, big: int = 0, seed: int = 0) -> str:
    """Write the fixture database at `path`; `big` adds one campaign of that many trials (h200, kda)."""
    rng = random.Random(seed)
    db = open_db(path)
    try:
        with db.session() as s:
            a_gdn, a_best = fill(s, A100, environment(), "gdn", trials, rng)
            promote(s, a_gdn, "gdn", a_best, A100, rng)
            old = environment(triton="3.5.0")
            h_old, h_old_best = fill(s, H200, old, "gdn", trials // 2, rng, status="interrupted")
            h_gdn, h_best = fill(s, H200, environment(), "gdn", trials, rng, extra_schedules=[a_best])
            promote(s, h_gdn, "gdn", h_best, H200, rng)
            promote(s, h_old, "gdn", h_old_best, H200, rng)  # same buckets under the old fingerprint: stale
            h_dn, h_dn_best = fill(s, H200, environment(), "deltanet", trials, rng)
            promote(s, h_dn, "deltanet", h_dn_best, H200, rng)
            if big:
                fill(s, H200, environment(), "kda", big, rng)
    finally:
        db.close()
    return path


def build_empty(path: str) -> str:
    open_db(path).close()
    return path
