"""Each trial runs in a worker process: a hang, a crash, an illegal memory access or an out-of-memory
kills the worker, not the campaign.

`TrialWorker` owns one long-lived `multiprocessing` (spawn) process and talks to it over a pipe; every
request has a timeout. A request that times out kills the process (status `timeout`); a process that
dies (segfault, os._exit, CUDA error that takes the context down) gives `runtime_error`. After any
failure the next request starts a fresh process, so no broken CUDA context is reused.

Inside the worker (`_serve`):
- ``gate``: the correctness gates (`gates.run_case` over a small validation matrix with a tail chunk,
  initial state and final-state gradient, zero beta, strong decay) and the run-twice bitwise check.
  Exceptions are classified: compilation failures → `compile_error`, anything else → `runtime_error`;
  gate failures → `incorrect`; run-twice mismatch → `nondeterministic`, and so (on a GPU) is a kernel the schedule
  compiled whose TTGIR has a shared-memory write-after-read hazard of an asynchronous product (`ir_hazards`);
  a kernel whose SASS lost products to ptxas (`ir_hazards.dropped_products`) is `incorrect`.
- ``measure``: one workload shape. On CUDA `measure.measure_shape` against FLA (backward CUDA graphs,
  interleaved, every sample; no FB, eager or memory figures, which trials do not keep). On the CPU the Triton
  interpreter is timed with `time.perf_counter` over a few interleaved repetitions against the torch reference
  backend: *interpreter timings*, never a GPU's.
- ``warm``: each shape once, untimed (compiles into Triton's on-disk cache); with ``autotune_part`` only a share
  of fla-core's autotuning configurations (`autotune_parts`).

Test-only faults (`task["fault"]`, from `REWY_TUNE_TEST_FAULTS=1` spaces): hang, crash (a real segfault
through ctypes), wrong (gradients off by 5 %), nondet (second run differs), compile (a compile error).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass, field
from typing import Any

STATUS_OK = "ok"


@dataclass
class Outcome:
    status: str
    message: str | None = None
    errors: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)


class TrialWorker:
    """A restartable worker process; `request(msg, timeout)` returns an Outcome and never raises for
    failures of the code under test."""

    def __init__(self, *, device: str, gpu_index: int | None = None, threads: int | None = None):
        """threads: torch's intra-op threads in the process (None: torch's default, all cores; the CPU
        device always uses 1). The gates' float64 reference runs on the CPU: 16 gate processes each with
        torch's default of one thread per core took 250-270 s per gate on the 32-core H200 host."""
        self.device = device
        self.gpu_index = gpu_index
        self.threads = threads
        self.proc = None
        self.conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        env = {"TRITON_INTERPRET": "1"} if self.device == "cpu" else {}
        if self.device != "cpu" and "TRITON_CACHE_AUTOTUNING" not in os.environ:
            # FLA's kernels autotune on first use (138 s for the six benchmark shapes on the H200): keep the
            # chosen configs in Triton's on-disk cache, so other worker processes and resumed campaigns on this
            # machine reuse them instead of autotuning again (an FLA user can do the same with this variable).
            env["TRITON_CACHE_AUTOTUNING"] = "1"
        if self.gpu_index is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_index)
        self.proc = ctx.Process(target=_serve, args=(child, env, self.threads), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=5)
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    close = stop

    def kill(self) -> None:
        """Kill the process from another thread; a request blocked on it returns runtime_error (and cleans up)."""
        proc = self.proc
        if proc is not None and proc.is_alive():
            proc.kill()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def request(self, msg: dict[str, Any], timeout: float) -> Outcome:
        if self.proc is None or not self.proc.is_alive():
            self.stop()
            self._start()
        try:
            self.conn.send(msg)
            ready = self.conn.poll(timeout)
            if not ready:
                self.stop()
                return Outcome("timeout", f"no answer within {timeout:.0f} s: worker killed")
            reply = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.exitcode if self.proc is not None else None
            if self.proc is not None:
                self.proc.join(timeout=5)
                code = self.proc.exitcode
            self.stop()
            return Outcome("runtime_error", f"worker process died (exit code {code})")
        outcome = Outcome(reply["status"], reply.get("message"), reply.get("errors") or {}, reply.get("data") or {})
        if outcome.status in ("runtime_error", "compile_error"):
            self.stop()  # a CUDA error may have poisoned the context: start afresh next time
        return outcome


# -- inside the worker process ---------------------------------------------------------------------

def _serve(conn, env: dict[str, str], threads: int | None = None) -> None:
    os.environ.update(env)
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    elif threads is not None:
        torch.set_num_threads(max(1, threads))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if msg["kind"] == "gate":
                reply = _gate(msg)
            elif msg["kind"] == "measure":
                reply = _measure(msg)
            elif msg["kind"] == "warm":
                reply = _warm(msg)
            else:
                reply = {"status": "runtime_error", "message": f"unknown request {msg['kind']!r}"}
        except Exception as exc:  # noqa: BLE001 - classified and reported, never raised
            reply = {"status": classify(exc), "message": f"{type(exc).__name__}: {exc}"[:2000]}
        conn.send(reply)


def classify(exc_or_text: BaseException | str) -> str:
    """compile_error for compilation / resource failures at build time, runtime_error otherwise."""
    text = exc_or_text if isinstance(exc_or_text, str) else f"{type(exc_or_text).__name__}: {exc_or_text}"
    head = text.split(":", 1)[0]
    if any(s in head for s in ("Compil", "OutOfResources", "PTXAS", "MLIR")):
        return "compile_error"
    return "runtime_error"


class CompilationError(RuntimeError):
    """Raised by the test-only `compile` fault."""


def _runner(msg: dict[str, Any]):
    from rewy_tune import gates
    from rewy_tune.schedule import Schedule

    schedule = Schedule.from_dict(msg["schedule"])
    base = gates.op_runner(backend=msg["backend"], schedule=schedule)
    fault = msg.get("fault", "none")
    if fault == "none":
        return base
    calls = {"n": 0}

    def faulty(case, inputs):
        if fault == "hang":
            time.sleep(3600)
        if fault == "crash":
            import ctypes

            ctypes.string_at(0)  # segfault
        if fault == "compile":
            raise CompilationError("test fault: the kernel does not compile")
        out = base(case, inputs)
        calls["n"] += 1
        if fault == "wrong":
            out["dq"] = out["dq"] * 1.05
        if fault == "nondet" and calls["n"] % 2 == 0:
            out["dk"] = out["dk"] * (1 + 1e-6)
        return out

    return faulty


def validation_cases(op: str, policy: str, K: int, V: int, device: str):
    """The gate matrix for one trial: tail chunk with initial state and final-state gradient, zero beta,
    strong decay (gated ops); tiny on the CPU interpreter.

    On a GPU every distinct specialization is a Triton compile, and compiling is what a trial spends its time
    on. The zero-beta and strong-decay cases therefore run at the tail case's length (eight chunks: the
    sequence-split scans use as many segments as at the benchmark shapes) without initial state or final-state
    gradient, as the workload shapes do: they compile nothing that the warm-up at the workload shapes does not
    compile anyway. At T = 64 with an initial state they compiled two more scan variants per trial (one
    segment; an initial state), 17 distinct kernel compiles instead of 15 for GDN2's H200 default."""
    from dataclasses import replace

    from rewy_tune import gates

    if device == "cpu":
        base = gates.GateCase(op=op, policy=policy, B=1, T=100, H=1, K=K, V=V, dtype="fp32")
        short = dict(T=64)
    else:
        base = gates.GateCase(op=op, policy=policy, B=1, T=512 - 28, H=4, K=K, V=V, dtype="bf16")
        short = dict(initial_state=False, final_grad=False)
    cases = [replace(base, label="tail-h0"), replace(base, beta="zero", label="beta-zero", **short)]
    if op != "deltanet":
        cases.append(replace(base, decay="strong", label="strong-decay", **short))
    return cases


def _gate(msg: dict[str, Any]) -> dict[str, Any]:
    from rewy_tune import gates, ir_hazards

    device = "cpu" if msg["device"] == "cpu" else "cuda"
    runner = _runner(msg)
    cases = validation_cases(msg["op"], msg["policy"], msg["K"], msg["V"], msg["device"])
    errors: dict[str, Any] = {}
    kernels = ir_hazards.kernel_functions() if device == "cuda" else []
    ir_hazards.forget_compiled(kernels)  # what is compiled after this is this schedule's (hazards, below)
    t0 = time.perf_counter()
    compile_s = None
    for i, case in enumerate(cases):
        result = gates.run_case(case, runner, seed=msg.get("seed", 0) + i, device=device)
        if compile_s is None:
            compile_s = time.perf_counter() - t0
        if result.error is not None:
            return {"status": classify(result.error), "message": f"{case.label}: {result.error}"[:2000],
                    "data": {"compile_s": compile_s}}
        for c in result.checks:
            errors[f"{case.label}/{c.tensor}"] = {"rel_rms": c.rel_rms, "max_abs": c.max_abs, "passed": c.passed}
        if not result.passed:
            bad = [c.tensor for c in result.checks if not c.passed]
            return {"status": "incorrect", "message": f"{case.label}: gate failed for {', '.join(bad)}",
                    "errors": errors, "data": {"compile_s": compile_s}}
    case = cases[0]
    inputs = gates.make_inputs(case, msg.get("seed", 0), device)
    differ = gates.check_deterministic(case, runner, inputs)
    if differ:
        return {"status": "nondeterministic", "message": f"run twice, bitwise different: {', '.join(differ)}",
                "errors": errors, "data": {"compile_s": compile_s}}
    data = {"compile_s": compile_s}
    if msg.get("warm_shapes"):
        t1 = time.perf_counter()
        for shape in msg["warm_shapes"]:
            try:
                _warm_shape(msg, tuple(shape))
            except Exception as exc:  # noqa: BLE001 - reported with the shape that failed
                return {"status": classify(exc), "message": f"warm-up B,T,H={shape}: {type(exc).__name__}: {exc}"[:2000],
                        "errors": errors, "data": data}
        data["warm_s"] = time.perf_counter() - t1
    hazard = _hazard_message(kernels)
    if hazard:
        return {"status": "nondeterministic", "message": hazard, "errors": errors, "data": data}
    dropped = ir_hazards.compiled_dropped_products(kernels)
    if dropped:  # a binary without some of its products computes wrong values wherever it runs
        name, n = dropped[0]
        return {"status": "incorrect", "errors": errors, "data": data,
                "message": f"{name}: {n} warpgroup products dropped by ptxas (rewy_tune/ir_hazards.py)"[:2000]}
    return {"status": STATUS_OK, "errors": errors, "data": data}


def _hazard_message(kernels: list) -> str | None:
    """A shared-memory write-after-read hazard in a kernel this schedule compiled (`ir_hazards`): a race that the
    run-twice gate catches only sometimes (session 34's showed only beside the reverse scan). None: none found."""
    from rewy_tune import ir_hazards

    found, _ = ir_hazards.compiled_hazards(kernels)
    if not found:
        return None
    name, h = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"shared-memory write-after-read hazard in {name}: {h}{more} (rewy_tune/ir_hazards.py)"[:2000]


def _warm_shape(msg: dict[str, Any], shape: tuple[int, int, int]) -> None:
    """One untimed forward and backward at a workload shape: Triton compiles the kernel variants this
    shape needs into its on-disk cache, where the measuring process finds them."""
    from rewy_tune import measure
    from rewy_tune.schedule import Schedule

    fn = measure.rewy_op_fn(msg["op"], msg["policy"], Schedule.from_dict(msg["schedule"]))
    measure.run_once(msg["op"], fn, shape, K=msg["K"], V=msg["V"], device="cpu" if msg["device"] == "cpu" else "cuda")


def _warm(msg: dict[str, Any]) -> dict[str, Any]:
    """`warmup.warm`'s request: each shape once, ours (unless ours=False) and (with_fla) FLA's, untimed.
    ``autotune_part=[i, n]``: FLA's autotuners compile only their i-th of n shares of configurations
    (`autotune_parts.config_part`), n gate processes splitting a cold machine's compiling between them."""
    import importlib

    from rewy_tune import autotune_parts

    part = msg.get("autotune_part")
    if part is None or not msg.get("with_fla"):
        return _warm_shapes(msg)
    importlib.import_module(autotune_parts.FLA_PACKAGES[msg["op"]])  # its autotuners must exist to be split
    with autotune_parts.config_part(*part):
        return _warm_shapes(msg)


def _warm_shapes(msg: dict[str, Any]) -> dict[str, Any]:
    from rewy_tune import fla_baseline, measure

    for shape in msg["shapes"]:
        try:
            if msg.get("ours", True):
                _warm_shape(msg, tuple(shape))
        except Exception as exc:  # noqa: BLE001 - reported with the shape that failed
            return {"status": classify(exc), "message": f"ours B,T,H={shape}: {type(exc).__name__}: {exc}"[:2000]}
        if msg.get("with_fla"):
            if msg["op"] == "gdn":
                fla_baseline.bypass_hopper_guard()
            measure.run_once(msg["op"], fla_baseline.fla_op(msg["op"], msg["policy"]), tuple(shape),
                             K=msg["K"], V=msg["V"])
    return {"status": STATUS_OK}


def _measure(msg: dict[str, Any]) -> dict[str, Any]:
    import torch

    from rewy_tune.schedule import Schedule

    op, policy, K, V = msg["op"], msg["policy"], msg["K"], msg["V"]
    shape = tuple(msg["shape"])
    schedule = Schedule.from_dict(msg["schedule"])
    t0 = time.perf_counter()
    if msg["device"] != "cpu":
        from rewy_tune import fla_baseline, measure

        if op == "gdn":
            fla_baseline.bypass_hopper_guard()
        ours = measure.rewy_op_fn(op, policy, schedule)
        fla = fla_baseline.fla_op(op, policy) if msg.get("with_baseline", True) else None
        # the backward samples are what a trial keeps: no FB graphs, eager timings or peak memory
        r = measure.measure_shape(op, ours, fla, shape, K=K, V=V, rounds=max(30, msg.get("rounds", 30)), extras=False)
        data = {"ours_ms": r.ours.backward_ms, "baseline_ms": r.fla.backward_ms if fla else [],
                "baseline": "fla", "timing": "cuda-graph"}
    else:
        data = _interpreter_timing(msg, op, policy, K, V, shape, schedule, torch)
    data["bench_s"] = time.perf_counter() - t0
    return {"status": STATUS_OK, "data": data}


def _interpreter_timing(msg, op, policy, K, V, shape, schedule, torch) -> dict[str, Any]:
    """perf_counter over interleaved repetitions of the backward (forward excluded); baseline: the torch
    reference backend on the same inputs (FLA needs CUDA)."""
    import rewy_tune
    from rewy_tune import gates

    B, T, H = shape
    case = gates.GateCase(op=op, policy=policy, B=B, T=T, H=H, K=K, V=V, dtype="fp32", initial_state=False,
                          final_grad=False)
    inputs = gates.make_inputs(case, msg.get("seed", 0), "cpu")
    names = gates.arg_names(op)
    fn = getattr(rewy_tune, f"chunk_{op}")
    fault = msg.get("fault", "none")

    def side(backend, sched):
        leaves = [inputs[n].clone().requires_grad_(True) for n in names]
        o, _ = fn(*leaves, policy=policy, backend=backend, schedule=sched)

        def once() -> float:
            t = time.perf_counter()
            torch.autograd.grad(o, leaves, inputs["do"], retain_graph=True)
            return (time.perf_counter() - t) * 1e3
        once()  # warm-up (the interpreter's first launch pays for parsing)
        return once

    ours = side(msg["backend"], schedule)
    base = side("torch", None) if msg.get("with_baseline", True) else None
    ours_ms, base_ms = [], []
    for _ in range(max(1, msg.get("reps", 3))):
        ours_ms.append(ours())
        if fault == "slow":
            ours_ms[-1] *= 3
        if base is not None:
            base_ms.append(base())
    return {"ours_ms": ours_ms, "baseline_ms": base_ms, "baseline": "torch-reference",
            "timing": "interpreter"}
