"""`rewy-tune verify`: the correctness gate over a small case matrix, one table row per case and tensor."""

from __future__ import annotations

import os

import torch
from rich.console import Console
from rich.table import Table

from rewy_tune import gates

ALL_OPS = ("deltanet", "gdn", "kda", "gdn2")


def run_verify(ops: list[str], backend: str, device: str, policies: list[str], seed: int,
               console: Console) -> bool:
    """Run the gate for every (op, policy, case); print the table; return True when all pass."""
    runner = gates.op_runner(backend=backend)
    table = Table(title=f"rewy-tune verify  backend={backend} device={device} (reference: float64 torch chunk)")
    for col in ("case", "tensor", "rel RMS", "max |err|", "limit", "result"):
        table.add_column(col, justify="right" if col in ("rel RMS", "max |err|", "limit") else "left")
    all_ok = True
    worst: dict[str, float] = {}
    # Triton 3.6's interpreter truncates fp32 -> bf16 (tests/kernels/test_interpreter_quirks.py), so its bf16
    # results say nothing about the GPU kernels: on the interpreter only fp32 cases gate the Triton backend.
    skip_bf16 = backend != "torch" and os.environ.get("TRITON_INTERPRET") == "1"
    if skip_bf16:
        console.print("note: bf16 cases skipped on the Triton interpreter (it truncates fp32 -> bf16; "
                      "run on a GPU for the bf16 gate)")
    for op in ops:
        for policy in policies:
            cases = [c for c in gates.default_cases(op, policy, device=device)
                     if not (skip_bf16 and c.dtype == "bf16")]
            for i, case in enumerate(cases):
                result = gates.run_case(case, runner, seed=seed + i, device=device)
                all_ok &= result.passed
                if result.error:
                    table.add_row(case.name, "-", "-", "-", "-", f"[red]ERROR {result.error}[/red]")
                    continue
                for c in result.checks:
                    verdict = "[green]pass[/green]" if c.passed else "[red]FAIL[/red]"
                    table.add_row(case.name, c.tensor, f"{c.rel_rms:.2e}", f"{c.max_abs:.2e}",
                                  f"{c.rtol:.1%}", verdict)
                    worst[op] = max(worst.get(op, 0.0), c.rel_rms if c.finite else float("inf"))
    console.print(table)
    for op, err in worst.items():
        console.print(f"worst relative RMS error, {op}: {err:.2e}")
    console.print("[green]all gates passed[/green]" if all_ok else "[red]gate FAILED[/red]")
    return all_ok


def resolve_device(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is present; accepted here: cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device: got {device!r}; accepted: cpu, cuda")
    return device
