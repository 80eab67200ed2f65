"""The `rewy-tune` command: subcommands for verification (and, as they land, tuning, benchmarks, serving)."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tune and check ReWY backward kernels for delta-rule linear attention.")
# Written to a file or a pipe (a device log), rich would wrap at 80 columns and cut table cells ("80.1/1…"): wide
# enough there for the bench table whole; a terminal keeps its own width.
console = Console(width=None if sys.stdout.isatty() else 160)


@app.callback(invoke_without_command=True)
def root(
    ctx: typer.Context,
    device: Optional[str] = typer.Option(None, help="the GPU the results are for (h100, h200, ..., auto) or cpu"),
    op: Optional[str] = typer.Option(None, help="deltanet, gdn, kda, gdn2 or all"),
    policy: str = typer.Option("R", help="R, A or both"),
    shapes: Optional[list[str]] = typer.Option(None, help="B,T,H; repeat the option or quote a list (\"1,512,4 1,2048,16\"); default: the paper's six (cpu: tiny)"),
    workload: Optional[str] = typer.Option(None, help='JSON file {"shapes": [[B,T,H],...], "K":.., "V":.., "dtype":..}'),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="K = V (default 128; cpu: 32)"),
    trials: Optional[int] = typer.Option(None, help="trials per (op, policy, bucket) study (default 60; cpu: 4)"),
    time_budget: Optional[str] = typer.Option(None, "--time-budget", help="e.g. 30m, 90s, 1h30m"),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path (default: REWY_DB or the data dir)"),
    storage: Optional[str] = typer.Option(None, help="Optuna storage URL or journal file (default: beside the db)"),
    workers: int = typer.Option(1, help="worker processes sharing the study (one per GPU)"),
    share_trials: bool = typer.Option(True, "--share-trials/--no-share-trials", help="time each gated schedule on every bucket of its operator and policy (one compilation, a trial per bucket)"),
    compile_jobs: Optional[int] = typer.Option(None, "--compile-jobs", help="trials gated (and compiled) in parallel per worker before timing one by one (default: GPU min(8, cores/2/workers); cpu 1)"),
    resume: bool = typer.Option(False, "--resume", help="continue the newest campaign of the same studies"),
    trial_timeout: Optional[float] = typer.Option(None, "--trial-timeout", help="seconds per worker request"),
    seed: Optional[int] = typer.Option(None, help="sampler seed"),
) -> None:
    """Tune and check ReWY backward kernels for delta-rule linear attention.

    Without a subcommand: run a tuning campaign, e.g. `rewy-tune --device cpu --op gdn --trials 4`.
    """
    if ctx.invoked_subcommand is not None:
        return
    if device is None and op is None:
        console.print(ctx.get_help())
        raise typer.Exit(code=0)
    from rewy_tune.cli import campaign

    if op is None:
        _fail("--op is required for a campaign (deltanet, gdn, kda, gdn2 or all)")
    try:
        config = campaign.build_config(device=device or "auto", op=op, policy=policy, shapes=shapes,
                                       workload=workload, head_dim=head_dim, trials=trials,
                                       time_budget=time_budget, db=db, storage=storage, workers=workers,
                                       resume=resume, trial_timeout=trial_timeout, seed=seed,
                                       compile_jobs=compile_jobs, share_trials=share_trials)
    except campaign.BadInput as exc:
        _fail(str(exc))
    raise typer.Exit(code=campaign.run_campaign(config, console))


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}", soft_wrap=True)
    raise typer.Exit(code=2)


def _ops_and_policies(op: str, policy: str) -> tuple[list[str], list[str]]:
    """--op (an operator or all) and --policy (R, A or both) as lists; a bad value exits naming the option."""
    from rewy_tune.cli.verify import ALL_OPS

    if op != "all" and op not in ALL_OPS:
        _fail(f"--op: unknown operator {op!r}; accepted: {', '.join(ALL_OPS)}, all")
    if policy not in ("R", "A", "both"):
        _fail(f"--policy: got {policy!r}; accepted: R, A, both")
    return (list(ALL_OPS) if op == "all" else [op]), (["R", "A"] if policy == "both" else [policy])


@app.command()
def verify(
    op: str = typer.Option("all", help="deltanet, gdn, kda, gdn2 or all"),
    backend: str = typer.Option("torch", help="torch, triton or auto"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    policy: str = typer.Option("both", help="R, A or both"),
    seed: int = typer.Option(0, help="first random seed (each case draws fresh inputs)"),
) -> None:
    """Run the correctness gate: every output and gradient against the float64 reference."""
    from rewy_tune.cli.verify import resolve_device, run_verify

    ops, policies = _ops_and_policies(op, policy)
    if backend not in ("torch", "triton", "auto"):
        _fail(f"--backend: got {backend!r}; accepted: torch, triton, auto")
    try:
        device = resolve_device(device)
    except ValueError as exc:
        _fail(str(exc))
    ok = run_verify(ops, backend, device, policies, seed, console)
    raise typer.Exit(code=0 if ok else 1)


@app.command()
def bench(
    op: str = typer.Option(..., help="deltanet, gdn, kda, gdn2 or all"),
    policy: str = typer.Option("R", help="R (recompute), A (save all) or both"),
    schedule: str = typer.Option("default", help="default, a Schedule JSON file, or db: per shape what the runtime dispatcher picks (stored winners)"),
    shapes: Optional[list[str]] = typer.Option(None, help="B,T,H; repeat the option or quote a list (\"1,512,4 1,2048,16\"); default: the paper's six"),
    head_dim: int = typer.Option(128, "--head-dim", help="K = V"),
    rounds: int = typer.Option(30, help="interleaved observations per side (>= 30)"),
    seed: int = typer.Option(0),
    jobs: Optional[int] = typer.Option(None, "--jobs", help="processes that compile ahead in parallel before timing (default: min(8, cores/2); 1: none)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write every sample to this JSON file (several operators/policies, or an existing directory: bench-OP-POLICY.json in that directory)"),
    overrides: Optional[list[str]] = typer.Option(None, "--set", help="FIELD=VALUE or STAGE.MEMBER=VALUE changed on top of --schedule for every operator (repeat the option or quote a list), e.g. side_stream=reverse_scan"),
) -> None:
    """Time our complete backward against FLA's in one process (CUDA graphs, interleaved rounds)."""
    import torch

    from rewy_tune.cli.bench import apply_overrides, parse_overrides, parse_shapes, run_many, shape_schedules
    from rewy_tune.schedule import Schedule

    ops, policies = _ops_and_policies(op, policy)
    if rounds < 30:
        _fail(f"--rounds: the measurement protocol needs at least 30, got {rounds}")
    if jobs is not None and jobs < 1:
        _fail(f"--jobs must be at least 1, got {jobs}")
    try:
        params = parse_overrides(overrides)
        apply_overrides(Schedule(), params)  # names and values checked before any GPU work
    except ValueError as exc:
        _fail(str(exc))
    if not torch.cuda.is_available():
        _fail("bench needs a CUDA GPU (timings on the CPU interpreter are meaningless)")
    try:
        shape_list = parse_shapes(shapes)
        runs = [(o, p, shape_schedules(schedule, o, p, shape_list, head_dim, head_dim, params))
                for o in ops for p in policies]
    except ValueError as exc:
        _fail(str(exc))
    raise typer.Exit(code=run_many(runs, shape_list, head_dim, head_dim, rounds, seed, jobs,
                                           json_out, console))


@app.command()
def schedule(
    op: str = typer.Option(..., help="deltanet, gdn, kda or gdn2"),
    policy: str = typer.Option("R", help="R or A"),
    shape: str = typer.Option("1,2048,16", help="B,T,H of the call"),
    head_dim: int = typer.Option(128, "--head-dim", help="K = V"),
    dtype: str = typer.Option("bf16", help="the call's dtype: bf16, fp16 or fp32"),
    cc: Optional[str] = typer.Option(None, "--cc", help="a compute capability such as 9.0: its built-in default, no database read"),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path (default: REWY_DB or the data dir)"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write the schedule to this file (for bench --schedule FILE)"),
) -> None:
    """The schedule a call of this shape runs on this machine (the dispatcher's pick and why), as JSON."""
    from rewy_tune.cli.bench import parse_shapes
    from rewy_tune.cli.schedule import pick, show_schedule
    from rewy_tune.db.engine import as_db_url

    try:
        try:
            shapes = parse_shapes([shape])
        except ValueError as exc:
            raise ValueError(str(exc).replace("--shapes:", "--shape:", 1)) from None
        if len(shapes) != 1:
            raise ValueError(f"--shape: give one B,T,H, got {shape!r}")
        chosen, reason = pick(op, policy, shapes[0], head_dim, head_dim, dtype, cc, as_db_url(db) if db else None)
        show_schedule(console, chosen, reason, json_out)
    except ValueError as exc:
        _fail(str(exc))


@app.command()
def show(
    device: Optional[str] = typer.Option(None, help="device short name (h200, cpu, ...)"),
    op: Optional[str] = typer.Option(None, help="deltanet, gdn, kda or gdn2"),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path"),
) -> None:
    """Stored winners with their speedups."""
    from rewy_tune.cli import campaign

    campaign.show(console, db, device, op)


@app.command()
def trials(
    campaign_id: int = typer.Argument(..., metavar="CAMPAIGN", help="campaign id (printed by the campaign)"),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path"),
) -> None:
    """The trials of one campaign with their statuses."""
    from rewy_tune.cli import campaign

    campaign.trials(console, db, campaign_id)


@app.command("export")
def export_cmd(
    file: str = typer.Argument(..., help="JSON file to write"),
    device: Optional[str] = typer.Option(None), op: Optional[str] = typer.Option(None),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path"),
) -> None:
    """Write the winners as JSON with their provenance."""
    from rewy_tune.cli import campaign

    campaign.export(console, db, file, device, op)


@app.command("import")
def import_cmd(
    file: str = typer.Argument(..., help="JSON file written by `rewy-tune export`"),
    replace: bool = typer.Option(False, "--replace", help="replace existing winners for the same key"),
    db: Optional[str] = typer.Option(None, help="database URL or SQLite path"),
) -> None:
    """Add the winners of an export to the database."""
    from rewy_tune.cli import campaign

    campaign.import_(console, db, file, replace)


@app.command()
def serve(
    db: Optional[str] = typer.Option(None, "--db", help="database URL or file (default: $REWY_DB or the user data dir)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (localhost only by default)"),
    port: int = typer.Option(8000, min=1, max=65535),
) -> None:
    """Serve the read-only dashboard and its JSON API (/api; schema at /openapi.json)."""
    from rewy_tune.cli.serve import run_serve

    run_serve(db, host, port, console)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_cmd(
    command: Optional[list[str]] = typer.Argument(None, help="the command, after --: rewy-tune run -- python train.py"),
) -> None:
    """Run a command with fla-core's chunk ops routed through ReWY; print the dispatch report at exit."""
    from rewy_tune.cli.run import run_command

    raise typer.Exit(code=run_command(list(command or [])))


def main(argv: Optional[list[str]] = None) -> None:
    app(args=argv)


if __name__ == "__main__":
    main()
