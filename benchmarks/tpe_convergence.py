"""Search efficiency of the tuner's TPE on an exhaustively measured schedule space (issue #5).

Question answered: on a space small enough to enumerate, does the tuner's TPE sampler get within 3 % of the
exhaustive best latency in at most a quarter of the evaluations (space size / 4)? Random sampling is the
baseline. Nothing is measured here: every study looks its proposals up in a recorded table.

    python benchmarks/tpe_convergence.py TABLE.json [--seeds 50] [--max-evals N] [--png PATH] [--json PATH]
    python benchmarks/tpe_convergence.py --synthetic [--write-table PATH] ...   # no GPU data needed

Input table (JSON), produced on the GPU by measuring every combination once:

    {"op": "gdn", "policy": "R", "shape": [1, 8192, 4], "device": "NVIDIA H200", "command": "...",
     "space": {"param_name": [choice, ...], ...},
     "results": [{"params": {"param_name": value, ...}, "status": "ok" | "<failure status>",
                  "median_ms": float | null}, ...],
     "default": {"param_name": value, ...}}                      # optional

- `space`: the categorical choices of each parameter, in the order given to `suggest_categorical`; the
  space is their full Cartesian product (no conditional parameters).
- `results`: every combination exactly once (checked; missing, duplicate and unknown combinations are
  reported by name). `status` is one of the tuner's statuses ("ok", "constraint", "compile_error",
  "timeout", ...); `median_ms` is required for "ok" and ignored otherwise.
- `default` (optional): a combination enqueued as the first trial of every study, TPE and random alike,
  as the tuner seeds a fresh study with the default schedule.

Replay, per sampler and seed: an in-memory Optuna study (minimize) with the tuner's own sampler
(`rewy_tune.tuner._sampler(seed)`: TPE, multivariate, grouped, 5 start-up trials) or `RandomSampler(seed)`.
Each trial suggests every parameter with `suggest_categorical` and the exact choices, and gets the table's
`median_ms`; as the tuner does, a "constraint" combination is told PRUNED with a positive trial constraint
(infeasible, which TPE models), any other failure FAIL; each still counts as an evaluation. A
repeated proposal counts again too (the tuner does not deduplicate). Evaluations run to `--max-evals`
(default: the space size).

Output: a PNG of best-so-far / exhaustive best versus evaluations (median and interquartile band over seeds,
per sampler; a line at 1 + tolerance and one at space size / 4), and a summary (printed; JSON with --json).
The bar holds when the median over seeds of "evaluations until best-so-far <= 1.03 x exhaustive best" is at
most floor(space size / 4); the median is `statistics.median` (mean of the two middle seeds for an even
count) and a seed that never gets within 3 % counts as infinity.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STATISTIC = ("median over seeds (statistics.median: mean of the two middle seeds for an even count) of the "
             "evaluations until best-so-far <= (1 + tolerance) x exhaustive best; a seed that never gets "
             "there counts as infinity (reported as null)")


class TableError(ValueError):
    """The table is malformed or does not cover its space exactly once."""


# -- table ----------------------------------------------------------------------------------------------
def _key(space: dict[str, list], params: dict[str, Any]) -> tuple:
    return tuple(params[name] for name in space)


def _describe(space: dict[str, list], key: tuple) -> str:
    return "{" + ", ".join(f"{name}={value!r}" for name, value in zip(space, key)) + "}"


def _check_entry(space: dict[str, list], i: int, entry: dict) -> None:
    if not isinstance(entry, dict):
        raise TableError(f"results[{i}]: expected an object with params, status, median_ms; got {entry!r}")
    params = entry.get("params")
    if not isinstance(params, dict) or set(params) != set(space):
        raise TableError(f"results[{i}]: params must name exactly {sorted(space)}, got {params!r}")
    for name, value in params.items():
        if value not in space[name]:
            raise TableError(f"results[{i}]: {name}={value!r} is not one of the choices {space[name]!r}")
    if not isinstance(entry.get("status"), str) or not entry["status"]:
        raise TableError(f"results[{i}]: status must be 'ok' or a failure status, got {entry.get('status')!r}")
    ms = entry.get("median_ms")
    if entry["status"] == "ok" and not (isinstance(ms, (int, float)) and ms > 0 and math.isfinite(ms)):
        raise TableError(f"results[{i}]: status ok needs a positive median_ms, got {ms!r}")


def index_table(table: dict) -> dict[tuple, tuple[str, float | None]]:
    """Combination key (values in space order) -> (status, median_ms); raises TableError unless every
    combination of the space appears exactly once."""
    if not isinstance(table, dict):
        raise TableError("the table must be a JSON object")
    space = table.get("space")
    if not isinstance(space, dict) or not space or not all(isinstance(v, list) and v for v in space.values()):
        raise TableError("'space' must map each parameter name to a non-empty list of choices")
    index: dict[tuple, tuple[str, float | None]] = {}
    duplicates = []
    for i, entry in enumerate(table.get("results") or []):
        _check_entry(space, i, entry)
        key = _key(space, entry["params"])
        if key in index:
            duplicates.append(_describe(space, key))
        ms = entry.get("median_ms")
        index[key] = (entry["status"], float(ms) if entry["status"] == "ok" else None)
    missing = [_describe(space, k) for k in itertools.product(*space.values()) if k not in index]
    problems = []
    if missing:
        problems.append(f"{len(missing)} of {space_size(space)} combinations missing: " + "; ".join(missing[:20])
                        + (" ..." if len(missing) > 20 else ""))
    if duplicates:
        problems.append(f"{len(duplicates)} duplicated: " + "; ".join(duplicates[:20]))
    if problems:
        raise TableError("incomplete table: " + " | ".join(problems))
    if not any(status == "ok" for status, _ in index.values()):
        raise TableError("no combination has status ok")
    return index


def space_size(space: dict[str, list]) -> int:
    return math.prod(len(v) for v in space.values())


def exhaustive_best(space: dict[str, list], index: dict) -> tuple[dict[str, Any], float]:
    key, (_, ms) = min(((k, v) for k, v in index.items() if v[0] == "ok"), key=lambda kv: kv[1][1])
    return dict(zip(space, key)), ms


# -- synthetic table ------------------------------------------------------------------------------------
def synthetic_table(seed: int = 0) -> dict:
    """4 parameters x 3-4 choices (144 combinations): a smooth latency with one interaction, 2 % log-normal
    noise, a shared-memory-like infeasible corner and a few random timeouts."""
    rng = np.random.default_rng(seed)
    space = {"block_v": [16, 32, 64, 128], "num_warps": [2, 4, 8], "num_stages": [1, 2, 3],
             "segments": [1, 2, 4, 8]}
    results = []
    for bv, nw, ns, seg in itertools.product(*space.values()):
        params = {"block_v": bv, "num_warps": nw, "num_stages": ns, "segments": seg}
        if bv == 128 and (ns == 3 or nw == 2):  # the infeasible corner
            results.append({"params": params, "status": "constraint", "median_ms": None})
            continue
        if rng.random() < 0.04:
            results.append({"params": params, "status": "timeout", "median_ms": None})
            continue
        lb, lw = math.log2(bv), math.log2(nw)
        ms = 1.0 + 0.08 * (lb - 5.6) ** 2 + 0.10 * (lw - 2.0) ** 2 + 0.06 * (ns - 2) ** 2 \
            + 0.05 * (math.log2(seg) - 1.5) ** 2 + 0.04 * (lb - 5.6) * (lw - 2.0)
        results.append({"params": params, "status": "ok", "median_ms": round(ms * math.exp(rng.normal(0, 0.02)), 5)})
    return {"op": "synthetic", "policy": "-", "shape": None, "device": "synthetic",
            "command": f"benchmarks/tpe_convergence.py --synthetic --synthetic-seed {seed}",
            "space": space, "results": results,
            "default": {"block_v": 32, "num_warps": 4, "num_stages": 2, "segments": 1}}


# -- replay ---------------------------------------------------------------------------------------------
def tuner_sampler(seed: int):
    """The tuner's TPE sampler, imported (not copied) so the study follows the tuner's configuration."""
    from rewy_tune.tuner import _sampler

    return _sampler(seed)


def random_sampler(seed: int):
    import optuna

    return optuna.samplers.RandomSampler(seed=seed)


SAMPLERS: dict[str, Callable[[int], Any]] = {"tpe": tuner_sampler, "random": random_sampler}


def replay(space: dict[str, list], index: dict, sampler, max_evals: int, default: dict | None = None):
    """One study: returns (best-so-far ms after each evaluation, inf before the first feasible one; study)."""
    import optuna

    study = optuna.create_study(direction="minimize", sampler=sampler)
    if default is not None:
        study.enqueue_trial(default)
    best, curve = math.inf, []
    for _ in range(max_evals):
        trial = study.ask()
        key = tuple(trial.suggest_categorical(name, choices) for name, choices in space.items())
        status, ms = index[key]
        if status == "ok":
            study.tell(trial, ms)
            best = min(best, ms)
        elif status == "constraint":  # as the tuner tells a rejection: infeasible, seen by TPE
            trial.set_constraint("limits", 1.0)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        curve.append(best)
    return curve, study


def run_sampler(name: str, table: dict, index: dict, seeds: int, max_evals: int) -> np.ndarray:
    """[seeds, max_evals] array of best-so-far / exhaustive best (inf before the first feasible evaluation)."""
    _, opt = exhaustive_best(table["space"], index)
    rows = []
    for seed in range(seeds):
        curve, _ = replay(table["space"], index, SAMPLERS[name](seed), max_evals, table.get("default"))
        rows.append(np.array(curve) / opt)
    return np.vstack(rows)


# -- statistics -----------------------------------------------------------------------------------------
def quantile(curves: np.ndarray, q: float) -> np.ndarray:
    """Per-column linear-interpolation quantile over seeds in which an infinite neighbour gives infinity."""
    s = np.sort(curves, axis=0)
    pos = q * (s.shape[0] - 1)
    lo, hi, frac = math.floor(pos), math.ceil(pos), pos - math.floor(pos)
    if frac == 0:
        return s[lo]
    with np.errstate(invalid="ignore"):
        mixed = s[lo] + (s[hi] - s[lo]) * frac
    return np.where(np.isinf(s[lo]) | np.isinf(s[hi]), math.inf, mixed)


def evals_to_reach(curves: np.ndarray, target: float) -> list[float]:
    """Per seed: the 1-based evaluation at which best-so-far / best first is <= target (inf if never)."""
    hit = curves <= target
    return [float(np.argmax(row) + 1) if row.any() else math.inf for row in hit]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def sampler_summary(curves: np.ndarray, target: float, quarter: int) -> dict:
    reach = evals_to_reach(curves, target)
    median = statistics.median(reach)
    at_quarter = quantile(curves[:, :quarter], 0.5)[-1] if quarter else math.inf
    return {"seeds": int(curves.shape[0]),
            "median_evals_to_target": _finite_or_none(median),
            "fraction_within_target_by_quarter": sum(r <= quarter for r in reach) / len(reach),
            "fraction_within_target_by_max_evals": sum(math.isfinite(r) for r in reach) / len(reach),
            "median_best_ratio_at_quarter": _finite_or_none(float(at_quarter)),
            "evals_to_target_per_seed": [_finite_or_none(r) for r in reach],
            "bar_holds": bool(median <= quarter)}


def summarise(table: dict, index: dict, curves: dict[str, np.ndarray], tolerance: float, max_evals: int) -> dict:
    space = table["space"]
    n = space_size(space)
    params, opt = exhaustive_best(space, index)
    target = 1.0 + tolerance
    quarter = n // 4
    ok = [ms for status, ms in index.values() if status == "ok"]
    samplers = {name: sampler_summary(c, target, quarter) for name, c in curves.items()}
    return {"op": table.get("op"), "policy": table.get("policy"), "shape": table.get("shape"),
            "device": table.get("device"), "command": table.get("command"),
            "space_size": n, "feasible": len(ok), "within_target_in_space": sum(ms <= target * opt for ms in ok),
            "exhaustive_best": {"params": params, "median_ms": opt},
            "tolerance": tolerance, "quarter_budget": quarter, "max_evals": max_evals,
            "default_enqueued": table.get("default"),
            "statistic": STATISTIC.replace("tolerance", f"{tolerance:g}"),
            "samplers": samplers,
            "bar": {"statement": f"TPE within {tolerance:.0%} of the exhaustive best in <= {quarter} "
                                 f"evaluations (space size {n} / 4)",
                    "holds": samplers["tpe"]["bar_holds"] if "tpe" in samplers else None}}


# -- output ---------------------------------------------------------------------------------------------
def title(summary: dict) -> str:
    if summary.get("op") == "synthetic":
        return "synthetic table"
    shape = "x".join(map(str, summary.get("shape") or [])) or "?"
    return f"{summary.get('op')} policy {summary.get('policy')} (B, T, H) = {shape} on {summary.get('device')}"


def plot(curves: dict[str, np.ndarray], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {"tpe": "tab:blue", "random": "tab:orange"}
    for name, c in curves.items():
        x = np.arange(1, c.shape[1] + 1)
        lo, med, hi = (np.where(np.isfinite(v), v, np.nan) for v in (quantile(c, q) for q in (0.25, 0.5, 0.75)))
        colour = colours.get(name)
        ax.plot(x, med, color=colour, label=f"{name}: median over {c.shape[0]} seeds")
        ax.fill_between(x, lo, hi, color=colour, alpha=0.2, label=f"{name}: interquartile range")
    target, quarter = 1.0 + summary["tolerance"], summary["quarter_budget"]
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"{target:g} x exhaustive best")
    ax.axvline(quarter, color="grey", linestyle=":", linewidth=1, label=f"space size / 4 = {quarter}")
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xlabel("evaluations (failed and repeated proposals included)")
    ax.set_ylabel("best-so-far latency / exhaustive best")
    ax.set_title(f"{title(summary)}: {summary['space_size']} combinations, best "
                 f"{summary['exhaustive_best']['median_ms']:.4g} ms", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(x: float | None) -> str:
    return "none feasible" if x is None else f"{x:.4f}"


def report(summary: dict) -> str:
    best = summary["exhaustive_best"]
    lines = [f"space: {summary['space_size']} combinations, {summary['feasible']} feasible, "
             f"{summary['within_target_in_space']} within {summary['tolerance']:.0%} of the best",
             f"exhaustive best: {best['median_ms']:.5g} ms at {best['params']}",
             f"quarter budget: {summary['quarter_budget']} evaluations (of max {summary['max_evals']})",
             f"statistic: {summary['statistic']}"]
    for name, s in summary["samplers"].items():
        med = s["median_evals_to_target"]
        lines.append(f"  {name:6s} median evals to target: {'never' if med is None else f'{med:g}'}; "
                     f"seeds within target by the quarter budget: {s['fraction_within_target_by_quarter']:.0%}, "
                     f"by max evals: {s['fraction_within_target_by_max_evals']:.0%}; "
                     f"median best/opt at the quarter budget: {_fmt(s['median_best_ratio_at_quarter'])}")
    bar = summary["bar"]
    lines.append(f"bar: {bar['statement']}: {'HOLDS' if bar['holds'] else 'DOES NOT HOLD'} (median over seeds)")
    return "\n".join(lines)


def default_png(table: dict) -> Path:
    parts = [table.get("op"), table.get("policy"), "x".join(map(str, table.get("shape") or []))]
    return RESULTS_DIR / ("tpe-convergence-" + "-".join(str(x) for x in parts if x and x != "-") + ".png")


# -- command line ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("table", nargs="?", help="exhaustive table (JSON, format in the module docstring)")
    p.add_argument("--synthetic", action="store_true", help="use a synthetic 144-combination table instead")
    p.add_argument("--synthetic-seed", type=int, default=0)
    p.add_argument("--write-table", type=Path, help="also write the (synthetic) table used to this JSON file")
    p.add_argument("--seeds", type=int, default=50, help="studies per sampler (seeds 0..N-1)")
    p.add_argument("--max-evals", type=int, help="evaluations per study (default: the space size)")
    p.add_argument("--tolerance", type=float, default=0.03, help="target: best-so-far <= (1 + tol) x best")
    p.add_argument("--png", type=Path, help="convergence plot (default: benchmarks/results/tpe-convergence-...)")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--no-default", action="store_true",
                   help="do not enqueue the table's default first: measures the search alone (when the default "
                        "is the best combination, enqueueing it makes the bar hold at evaluation 1)")
    args = p.parse_args(argv)
    if args.synthetic == bool(args.table):
        p.error("give exactly one of TABLE or --synthetic")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    return args


def load(args: argparse.Namespace) -> dict:
    if args.synthetic:
        return synthetic_table(args.synthetic_seed)
    with open(args.table) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    table = load(args)
    if args.no_default:
        table.pop("default", None)
    try:
        index = index_table(table)
    except TableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.write_table:
        args.write_table.write_text(json.dumps(table, indent=1) + "\n")
    n = space_size(table["space"])
    max_evals = args.max_evals or n
    if max_evals < n // 4 or max_evals < 1:
        print(f"error: --max-evals {max_evals} is below the quarter budget {n // 4}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    curves = {name: run_sampler(name, table, index, args.seeds, max_evals) for name in SAMPLERS}
    summary = summarise(table, index, curves, args.tolerance, max_evals)
    summary["replay_s"] = round(time.monotonic() - t0, 1)
    png = args.png or default_png(table)
    plot(curves, summary, png)
    summary["png"] = str(png)
    print(report(summary))
    print(f"plot: {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
