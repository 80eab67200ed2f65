"""The `rewy-tune` command: subcommands for verification (and, as they land, tuning, benchmarks, serving)."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tune and check ReWY backward kernels for delta-rule linear attention.")
console = Console()


@app.callback()
def root() -> None:
    """Tune and check ReWY backward kernels for delta-rule linear attention."""


def _fail(message: str) -> None:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(code=2)


@app.command()
def verify(
    op: str = typer.Option("all", help="deltanet, gdn, kda, gdn2 or all"),
    backend: str = typer.Option("torch", help="torch, triton or auto"),
    device: str = typer.Option("cpu", help="cpu or cuda"),
    policy: str = typer.Option("both", help="R, A or both"),
    seed: int = typer.Option(0, help="first random seed (each case draws fresh inputs)"),
) -> None:
    """Run the correctness gate: every output and gradient against the float64 reference."""
    from rewy_tune.cli.verify import ALL_OPS, resolve_device, run_verify

    ops = list(ALL_OPS) if op == "all" else [op]
    if any(o not in ALL_OPS for o in ops):
        _fail(f"--op: unknown operator {op!r}; accepted: {', '.join(ALL_OPS)}, all")
    if policy not in ("R", "A", "both"):
        _fail(f"--policy: got {policy!r}; accepted: R, A, both")
    if backend not in ("torch", "triton", "auto"):
        _fail(f"--backend: got {backend!r}; accepted: torch, triton, auto")
    try:
        device = resolve_device(device)
    except ValueError as exc:
        _fail(str(exc))
    policies = ["R", "A"] if policy == "both" else [policy]
    ok = run_verify(ops, backend, device, policies, seed, console)
    raise typer.Exit(code=0 if ok else 1)


@app.command()
def bench(
    op: str = typer.Option(..., help="deltanet, gdn, kda or gdn2"),
    policy: str = typer.Option("R", help="R (recompute) or A (save all)"),
    schedule: str = typer.Option("default", help="default, db, or a Schedule JSON file"),
    shapes: Optional[list[str]] = typer.Option(None, help="B,T,H (repeatable); default: the paper's six"),
    head_dim: int = typer.Option(128, "--head-dim", help="K = V"),
    rounds: int = typer.Option(30, help="interleaved observations per side (>= 30)"),
    seed: int = typer.Option(0),
    json_out: Optional[str] = typer.Option(None, "--json", help="write every sample to this JSON file"),
) -> None:
    """Time our complete backward against FLA's in one process (CUDA graphs, interleaved rounds)."""
    import torch

    from rewy_tune.cli.bench import load_schedule, parse_shapes, run_bench, write_json
    from rewy_tune.cli.verify import ALL_OPS

    if op not in ALL_OPS:
        _fail(f"--op: unknown operator {op!r}; accepted: {', '.join(ALL_OPS)}")
    if policy not in ("R", "A"):
        _fail(f"--policy: got {policy!r}; accepted: R, A")
    if rounds < 30:
        _fail(f"--rounds: the measurement protocol needs at least 30, got {rounds}")
    if not torch.cuda.is_available():
        _fail("bench needs a CUDA GPU (timings on the CPU interpreter are meaningless)")
    try:
        shape_list = parse_shapes(shapes)
        sched = load_schedule(schedule, op)
    except ValueError as exc:
        _fail(str(exc))
    data = run_bench(op, policy, sched, shape_list, head_dim, head_dim, rounds, seed, console)
    if json_out:
        write_json(json_out, data)
        console.print(f"wrote {json_out}")


def main(argv: Optional[list[str]] = None) -> None:
    app(args=argv)


if __name__ == "__main__":
    main()
