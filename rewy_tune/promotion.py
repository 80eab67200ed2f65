"""Promotion: the only step that writes winners.

For one study: the best few gate-passing (`ok`, complete) trials are re-measured shape by shape, paired
in one worker process with the baseline (FLA on CUDA; the torch reference on the CPU interpreter) and
the incumbent: the current winner for the bucket, or, without one, the built-in default schedule (what
the dispatcher runs until a winner exists). The best candidate replaces the incumbent only when its gain
exceeds the measured run-to-run spread (inter-quartile range over the median, the larger of the two
sides). A first campaign always writes a winner: the best trial, or the default itself when no trial beat
it beyond the spread (the H200 campaign of session 5 promoted trials 1.4x slower than the default, whose own
trial had not been timed before the budget ended). Interpreter winners are stored under the CPU
interpreter device and never used for a GPU.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import optuna

from rewy_tune.tuner import geomean, shape_label


@dataclass
class Contender:
    name: str
    schedule: dict[str, Any]
    samples: dict[str, list[float]] = field(default_factory=dict)
    baseline: dict[str, list[float]] = field(default_factory=dict)
    failed: str | None = None

    @property
    def latency_ms(self) -> float:
        return geomean([statistics.median(x) for x in self.samples.values()])

    @property
    def spread(self) -> float:
        spreads = []
        for xs in self.samples.values():
            if len(xs) >= 4:
                q1, _, q3 = statistics.quantiles(xs, n=4)
                spreads.append((q3 - q1) / statistics.median(xs))
            else:
                spreads.append((max(xs) - min(xs)) / statistics.median(xs))
        return max(spreads) if spreads else 0.0


@dataclass
class PromotionResult:
    label: str
    decision: str  # promoted | kept | none
    reason: str
    latency_ms: float | None = None
    baseline_ms: float | None = None
    speedup: float | None = None
    trial_number: int | None = None
    schedule: dict[str, Any] | None = None


def _measure(campaign, st, worker, c: Contender, reps: int) -> None:
    cfg = campaign.config
    for shape in st.shapes:
        msg = {**campaign.task(st.op, st.policy, c.schedule, seed=0), "kind": "measure", "reps": reps, "rounds": 30,
               "shape": list(shape)}
        out = worker.request(msg, cfg.trial_timeout_s)
        if out.status != "ok":
            c.failed = f"{shape_label(shape)}: {out.status}: {out.message}"
            return
        c.samples[shape_label(shape)] = out.data["ours_ms"]
        c.baseline[shape_label(shape)] = out.data.get("baseline_ms") or []


def promote(campaign, st, worker) -> PromotionResult:
    from rewy_tune.db import queries

    cfg = campaign.config
    complete = [t for t in st.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
                if t.user_attrs.get("status") == "ok"]
    if not complete:
        return PromotionResult(st.label, "none", "no trial passed the gates and finished its workload")
    complete.sort(key=lambda t: t.value)
    # Schedules are read back from the database rows (what the gates passed), deduplicated.
    with campaign.db.session() as s:
        rows = {r.number: r for r in queries.campaign_trials(s, st.campaign_id, status="ok", limit=100000).items}
        current = queries.winner_for(s, st.bucket, fingerprint=cfg.environment.fingerprint(cfg.device))
        current_schedule = dict(current.schedule) if current is not None else None
        schedules = {t.number: dict(rows[t.number].schedule) for t in complete if t.number in rows}
    contenders: list[Contender] = []
    numbers: dict[str, int] = {}
    for t in complete:
        sched = schedules.get(t.number)
        if sched is None or any(c.schedule == sched for c in contenders):
            continue
        contenders.append(Contender(f"trial {t.number}", sched))
        numbers[contenders[-1].name] = t.number
        if len(contenders) >= cfg.promote_top:
            break
    # The incumbent: the current winner, else the built-in default (the schedule calls run without a winner).
    if current_schedule is not None:
        incumbent_schedule, incumbent_name = current_schedule, "current winner"
    else:
        incumbent_schedule = campaign.default_schedule(st.op, st.policy).to_dict()
        incumbent_name = "built-in default"
    incumbent = next((c for c in contenders if c.schedule == incumbent_schedule), None)
    if incumbent is None:
        incumbent = Contender(incumbent_name, incumbent_schedule)
    reps = max(5, cfg.reps * 2) if cfg.device.is_cpu else 30
    extra = [incumbent] if all(incumbent is not c for c in contenders) else []
    for c in contenders + extra:
        _measure(campaign, st, worker, c, reps)
    measured = [c for c in contenders if c.failed is None and c.samples]
    if not measured:
        return PromotionResult(st.label, "none", "re-measurement failed for every candidate: "
                               + "; ".join(c.failed or "" for c in contenders))
    best = min(measured, key=lambda c: c.latency_ms)
    baseline_samples: dict[str, list[float]] = {}
    for c in measured + extra:
        for label, xs in c.baseline.items():
            baseline_samples.setdefault(label, []).extend(xs)
    baseline_ms = geomean([statistics.median(xs) for xs in baseline_samples.values()]) \
        if baseline_samples and all(baseline_samples.values()) else None
    incumbent_ok = incumbent.failed is None and bool(incumbent.samples)
    if incumbent is not best and incumbent_ok:
        gain = incumbent.latency_ms / best.latency_ms - 1
        noise = max(best.spread, incumbent.spread)
        if gain <= noise:
            trial = f"trial {numbers.get(best.name)}"
            reason = (f"{trial} is {-gain:.1%} slower than the {incumbent_name}" if gain <= 0 else
                      f"gain {gain:.1%} of {trial} within the measured spread {noise:.1%}")
            best = incumbent
        else:
            reason = f"gain {gain:.1%} over the {incumbent_name} exceeds the spread {noise:.1%}"
    elif incumbent is best:
        reason = f"the {incumbent_name} re-measured fastest"
    else:
        reason = f"{incumbent_name} failed re-measurement ({incumbent.failed})"
    if best is incumbent and current_schedule is not None:
        return PromotionResult(st.label, "kept", reason, best.latency_ms, baseline_ms,
                               baseline_ms / best.latency_ms if baseline_ms else None,
                               numbers.get(best.name), best.schedule)
    if best is incumbent:
        reason += "; the built-in default becomes the first winner"
    if baseline_ms is None:
        return PromotionResult(st.label, "none", "no baseline timing to compare against")
    with campaign.db.session() as s:
        now = queries.winner_for(s, st.bucket, fingerprint=cfg.environment.fingerprint(cfg.device))
        if (None if now is None else dict(now.schedule)) != current_schedule:
            return PromotionResult(st.label, "kept", "another worker promoted a winner meanwhile")
        for label, xs in baseline_samples.items():
            if xs:
                queries.add_baseline(s, st.campaign_id, shape=label, samples_ms=xs)
        queries.promote_winner(s, campaign_id=st.campaign_id, bucket=st.bucket, schedule=best.schedule,
                               latency_ms=best.latency_ms, fla_latency_ms=baseline_ms,
                               replace=current_schedule is not None)
    return PromotionResult(st.label, "promoted", reason, best.latency_ms, baseline_ms,
                           baseline_ms / best.latency_ms, numbers.get(best.name), best.schedule)
