"""`rewy-tune --device D --op OP ...` (the campaign) and `show`, `trials`, `export`, `import`.

Input is validated completely before the database or the study storage is touched: bad input prints
one line and exits with code 2, having written nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from rewy_tune.cli.files import write_text_atomic

OP_CHOICES = ("deltanet", "gdn", "kda", "gdn2", "all")
MAX_HEAD_DIM = 256


class BadInput(ValueError):
    """One clear line; exit code 2."""


def fail(console: Console, message: str) -> None:
    console.print(f"[red]error:[/red] {message}", soft_wrap=True)
    raise typer.Exit(code=2)


def check_head_dims(K: int, V: int, where: str) -> None:
    for name, d in (("K", K), ("V", V)):
        if isinstance(d, bool) or not isinstance(d, int) or not 16 <= d <= MAX_HEAD_DIM or d % 16:
            raise BadInput(f"{where}: {name}={d!r} is not supported; the Triton kernels take multiples of 16 "
                           f"in [16, {MAX_HEAD_DIM}]")


def load_workload(path: str) -> dict:
    """{"shapes": [[B,T,H], ...], "K": 128, "V": 128, "dtype": "bf16"} (K, V, dtype optional)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise BadInput(f"--workload {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"--workload {path}: not UTF-8 text (byte {exc.start}); expected a JSON file") from None
    except json.JSONDecodeError as exc:
        raise BadInput(f"--workload {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, list):
        data = {"shapes": data}
    if not isinstance(data, dict) or not isinstance(data.get("shapes"), list) or not data["shapes"]:
        raise BadInput(f"--workload {path}: expected an object with a non-empty 'shapes' list of [B, T, H]")
    shapes = []
    for i, s in enumerate(data["shapes"]):
        if not (isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) and not isinstance(x, bool)
                                                            and x > 0 for x in s)):
            raise BadInput(f"--workload {path}: shapes[{i}] = {s!r} is not [B, T, H] (three positive integers)")
        shapes.append(tuple(s))
    out = {"shapes": shapes}
    for key in ("K", "V"):
        if key in data:
            check_head_dims(data[key], 16, f"--workload {path}") if key == "K" else \
                check_head_dims(16, data[key], f"--workload {path}")
            out[key] = data[key]
    if "dtype" in data:
        if data["dtype"] not in ("bf16", "fp16", "fp32"):
            raise BadInput(f"--workload {path}: dtype {data['dtype']!r}; accepted: bf16, fp16, fp32")
        out["dtype"] = data["dtype"]
    return out


def build_config(*, device: str, op: str, policy: str, shapes, workload, head_dim, trials, time_budget, db,
                 storage, workers, resume, trial_timeout, seed, compile_jobs=None, share_trials=True):
    """Validate every option (no side effects) and return a CampaignConfig."""
    from rewy_tune.cli.bench import parse_shapes
    from rewy_tune.db.engine import as_db_url, default_db_url
    from rewy_tune.device import current_environment, resolve_device_name
    from rewy_tune.tuner import CPU_SHAPES, CampaignConfig, parse_duration

    if op not in OP_CHOICES:
        raise BadInput(f"--op: unknown operator {op!r}; accepted: {', '.join(OP_CHOICES)}")
    if policy not in ("R", "A", "both"):
        raise BadInput(f"--policy: got {policy!r}; accepted: R, A, both")
    try:
        dev = resolve_device_name(device)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if shapes and workload:
        raise BadInput("--shapes and --workload exclude each other")
    K = V = head_dim if head_dim is not None else (32 if dev.is_cpu else 128)
    dtype = "fp32" if dev.is_cpu else "bf16"
    if workload:
        wl = load_workload(workload)
        shape_list = wl["shapes"]
        K, V, dtype = wl.get("K", K), wl.get("V", V), wl.get("dtype", dtype)
    elif shapes:
        try:
            shape_list = parse_shapes(shapes)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    else:
        from rewy_tune import measure

        shape_list = list(CPU_SHAPES if dev.is_cpu else measure.DEFAULT_SHAPES)
    check_head_dims(K, V, "head dims")
    if trials is not None and trials < 1:
        raise BadInput(f"--trials must be at least 1, got {trials}")
    try:
        budget_s = parse_duration(time_budget)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    if trials is None and budget_s is None:
        trials = 4 if dev.is_cpu else 60
    if workers < 1:
        raise BadInput(f"--workers must be at least 1, got {workers}")
    if not dev.is_cpu:
        import torch

        if workers > torch.cuda.device_count():
            raise BadInput(f"--workers {workers}: only {torch.cuda.device_count()} GPU(s) present (one worker per GPU)")
    # a trial must at least start its request in a worker: below a second every trial times out
    if trial_timeout is not None and not (math.isfinite(trial_timeout) and trial_timeout >= 1):
        raise BadInput(f"--trial-timeout must be a number of seconds >= 1, got {trial_timeout}")
    if seed is not None and not 0 <= seed < 2**32:  # Optuna's samplers take 0 .. 2**32 - 1
        raise BadInput(f"--seed must be in [0, {2**32 - 1}], got {seed}")
    if compile_jobs is None:  # GPU: half the cores per worker compile ahead, at most 8; the interpreter: 1
        compile_jobs = 1 if dev.is_cpu else max(1, min(8, (os.cpu_count() or 2) // (2 * workers)))
    elif compile_jobs < 1:
        raise BadInput(f"--compile-jobs must be at least 1, got {compile_jobs}")
    ops = ["deltanet", "gdn", "kda", "gdn2"] if op == "all" else [op]
    return CampaignConfig(
        device=dev, environment=current_environment(), ops=ops,
        policies=["R", "A"] if policy == "both" else [policy], shapes=shape_list, K=K, V=V, dtype=dtype,
        trials=trials, time_budget_s=budget_s, db_url=as_db_url(db) if db else default_db_url(),
        storage_url=storage, workers=workers, resume=resume, compile_jobs=compile_jobs, share_trials=share_trials,
        trial_timeout_s=trial_timeout if trial_timeout is not None else (120.0 if dev.is_cpu else 300.0), seed=seed)


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def progress_table(campaign) -> Table:
    cfg = campaign.config
    timing = "interpreter timings (CPU), baseline: torch reference" if cfg.device.is_cpu else \
        "CUDA-graph backward, baseline: FLA"
    elapsed = time.monotonic() - campaign.started
    table = Table(title=f"rewy-tune campaign on {cfg.device.short_name}  ({timing})  "
                        f"elapsed {_fmt_s(elapsed)}  ETA {_fmt_s(campaign.eta_s())}")
    for col in ("op", "policy", "bucket", "done", "running", "best ms", "vs baseline", "default ms", "statuses"):
        table.add_column(col, justify="right" if col in ("done", "running", "best ms", "vs baseline",
                                                         "default ms") else "left")
    for st in campaign.states:
        with st.lock:
            statuses = " ".join(f"{k}={v}" for k, v in sorted(st.counts.items())) or "-"
            table.add_row(st.op, st.policy, st.bucket.label, f"{st.done}/{st.target or '∞'}", str(st.running),
                          f"{st.best_ms:.3f}" if st.best_ms else "-",
                          f"{st.best_speedup:.2f}x" if st.best_speedup else "-",
                          f"{st.default_ms:.3f}" if st.default_ms else "-", statuses)
    return table


def run_campaign(config, console: Console) -> int:
    from rewy_tune.db import DatabaseError, open_db
    from rewy_tune.db.engine import display_url
    from rewy_tune.tuner import Campaign

    try:
        db = open_db(config.db_url)
    except (DatabaseError, OSError) as exc:
        fail(console, str(exc).splitlines()[0])
    campaign = Campaign(config, db)
    try:
        campaign.plan()
    except Exception as exc:  # noqa: BLE001 - an unreachable --storage, for example
        db.close()
        fail(console, f"cannot set up the study storage {config.storage_url or campaign.storage_label}: {exc}")
    for op, why in campaign.skipped.items():
        console.print(f"[yellow]skipped[/yellow] {op}: {why}")
    if not campaign.states:
        console.print("nothing to tune")
        db.close()
        return 0
    code = 0
    campaign.run()
    try:
        with Live(progress_table(campaign), console=console, refresh_per_second=2, transient=False) as live:
            last_line = time.monotonic()
            while campaign.running():
                campaign.join(0.5)
                live.update(progress_table(campaign))
                if not console.is_terminal and time.monotonic() - last_line > 60:
                    # a log file gets the live table only at the end: one line a minute, so that a run
                    # killed from outside still says how far it got
                    last_line = time.monotonic()
                    console.print(f"progress: {campaign.throughput()}", highlight=False, soft_wrap=True)
            for st in campaign.states:
                campaign._refresh(st)
            live.update(progress_table(campaign))
        campaign.search_s = time.monotonic() - campaign.started
        console.print("\n" + campaign.throughput(), highlight=False, soft_wrap=True)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/yellow]: stopping workers; running trials are re-enqueued "
                      "(continue with --resume)")
        campaign.stop_now()
        campaign.join(30)
        code = 130
    for err in campaign.errors:
        console.print(f"[red]worker loop failed:[/red] {err}")
        code = 1
    if not campaign.interrupted and not campaign.errors:
        console.print("promoting: re-measuring the best candidates against the baseline and the current winner")
        results = campaign.promote()
        table = Table(title="winners" + (" (interpreter timings)" if config.device.is_cpu else ""))
        for col in ("study", "decision", "trial", "latency ms", "baseline ms", "speedup", "reason"):
            table.add_column(col)
        for r in results:
            table.add_row(r.label, r.decision, str(r.trial_number if r.trial_number is not None else "-"),
                          f"{r.latency_ms:.3f}" if r.latency_ms else "-",
                          f"{r.baseline_ms:.3f}" if r.baseline_ms else "-",
                          f"{r.speedup:.2f}x" if r.speedup else "-", r.reason)
        console.print(table)
    campaign.finish()
    console.print("campaigns: " + ", ".join(f"{st.campaign_id} ({st.label})" for st in campaign.states))
    console.print(f"database: {display_url(config.db_url)}   study storage: {campaign.storage_label}")
    db.close()
    return code


# -- read commands --------------------------------------------------------------------------------

def _open_read(db: str | None, console: Console):
    from rewy_tune.db import DatabaseError, open_db

    try:
        return open_db(db, read_only=True)
    except (DatabaseError, OSError) as exc:
        fail(console, str(exc).splitlines()[0])


def show(console: Console, db: str | None, device: str | None, op: str | None) -> None:
    from rewy_tune.db import queries

    if op is not None and op not in OP_CHOICES[:-1]:
        fail(console, f"--op: unknown operator {op!r}; accepted: {', '.join(OP_CHOICES[:-1])}")
    database = _open_read(db, console)
    device_name = stored_device_name(device)
    table = Table(title="winners")
    for col in ("device", "op", "policy", "dtype", "K", "V", "T≤", "B·H≤", "latency ms", "baseline ms", "speedup",
                "campaign", "fingerprint"):
        table.add_column(col)
    with database.session() as s:
        rows = queries.winners(s, device=device_name, op=op)
        for w in rows:
            table.add_row(w.environment.device.short_name, w.op, w.policy, w.dtype, str(w.K), str(w.V),
                          str(w.t_bucket), str(w.bh_bucket), f"{w.latency_ms:.4f}", f"{w.fla_latency_ms:.4f}",
                          f"{w.speedup:.2f}x", str(w.campaign_id or "-"), w.environment.fingerprint)
        missing = None if rows else no_winners(s, device, op)
    console.print(table if rows else missing, soft_wrap=True, highlight=False)
    database.close()


def stored_device_name(device: str | None) -> str | None:
    """--device as the database names it: 'cpu' is stored as the interpreter's 'cpu-interpreter'."""
    from rewy_tune.device import CPU_INTERPRETER

    return CPU_INTERPRETER if device == "cpu" else device


def cli_device_name(short_name: str) -> str:
    """A stored device short name as --device takes it."""
    from rewy_tune.device import CPU_INTERPRETER

    return "cpu" if short_name == CPU_INTERPRETER else short_name


def no_winners(session, device: str | None, op: str | None) -> str:
    """'no winners stored', and where filters found none, what the database does hold (a misspelt --device
    otherwise reads as an empty database)."""
    from rewy_tune.db import queries

    filters = " ".join(f"--{k} {v}" for k, v in (("device", device), ("op", op)) if v is not None)
    if not filters:
        return "no winners stored"
    held: dict[str, set[str]] = {}
    for w in queries.winners(session):
        held.setdefault(cli_device_name(w.environment.device.short_name), set()).add(w.op)
    stored = "; ".join(f"{d}: {', '.join(sorted(ops))}" for d, ops in sorted(held.items())) or "none"
    return f"no winners stored for {filters} (winners in this database, by --device: {stored})"


def trials(console: Console, db: str | None, campaign_id: int) -> None:
    from rewy_tune.db import queries

    database = _open_read(db, console)
    with database.session() as s:
        campaign = queries.get_campaign(s, campaign_id)
        if campaign is None:
            database.close()
            fail(console, f"no campaign with id {campaign_id}")
        page = queries.campaign_trials(s, campaign_id, limit=100000)
        table = Table(title=f"campaign {campaign_id}: {campaign.op} {','.join(campaign.policies)} "
                            f"{campaign.workload.get('bucket', '')} ({campaign.status}, {page.total} trials)")
        for col in ("#", "status", "median ms per shape", "compile s", "bench s", "message"):
            table.add_column(col)
        for t in page.items:
            medians = " ".join(f"{k}:{v:.3f}" for k, v in t.medians_ms.items()) or "-"
            table.add_row(str(t.number), t.status, medians, f"{t.compile_s:.2f}" if t.compile_s else "-",
                          f"{t.bench_s:.2f}" if t.bench_s else "-", (t.message or "")[:80])
    console.print(table)
    database.close()


def export(console: Console, db: str | None, file: str, device: str | None, op: str | None) -> None:
    from rewy_tune.db import exchange

    if op is not None and op not in OP_CHOICES[:-1]:
        fail(console, f"--op: unknown operator {op!r}; accepted: {', '.join(OP_CHOICES[:-1])}")
    database = _open_read(db, console)
    with database.session() as s:
        data = exchange.export_winners(s, device=stored_device_name(device), op=op)
        # an empty export is still written (a valid file), but said why it is empty
        missing = None if data["winners"] else no_winners(s, device, op)
    database.close()
    try:
        write_text_atomic(file, json.dumps(data, indent=1, default=str))
    except OSError as exc:
        fail(console, f"{file}: cannot write it ({exc.strerror})")
    if missing:
        console.print(missing, soft_wrap=True, highlight=False)
    console.print(f"exported {len(data['winners'])} winner(s) to {file}")


def import_(console: Console, db: str | None, file: str, replace: bool) -> None:
    from rewy_tune.db import DatabaseError, exchange, open_db

    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except OSError as exc:
        fail(console, f"{file}: cannot read it ({exc.strerror})")
    except UnicodeDecodeError as exc:
        fail(console, f"{file}: not UTF-8 text (byte {exc.start}); expected a JSON file written by export")
    except json.JSONDecodeError as exc:
        fail(console, f"{file}: not JSON ({exc.msg} at line {exc.lineno})")
    try:
        exchange._parse_document(data)  # validate before opening (and creating) the database
    except exchange.ImportFormatError as exc:
        fail(console, str(exc))
    try:
        database = open_db(db)
    except (DatabaseError, OSError) as exc:
        fail(console, str(exc).splitlines()[0])
    with database.session() as s:
        n = exchange.import_winners(s, data, replace=replace)
    database.close()
    console.print(f"imported {n} winner(s) from {file}")
