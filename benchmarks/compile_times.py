"""How long does each ReWY kernel take to compile for the H200, and why is a GPU trial slow?

Compiles, ahead of time for sm_90 on any machine (Triton bundles ptxas; no GPU needed), exactly the kernel
launches that one backward of an operator makes with a given schedule:
1. record: the backward runs once on the Triton interpreter at a small shape (same constexprs as the real
   launch: K, V, tiles, warps, stages); every `kernel[grid](...)` launch is recorded (argument types,
   constexpr values, options; host-built tensor descriptors as Triton's `tensordesc<...>` signature);
2. compile: a fresh process without the interpreter compiles each recorded launch with an empty Triton
   cache and prints the CPU seconds per kernel (ptxas included; wall time depends on the machine's load), its
   shared memory, and its registers and stack frame per thread from the cubin (`cuobjdump -res-usage`: a stack
   frame at 255 registers is register spilling, what ncu reports as local-memory spill requests on the GPU), and
   whether ptxas serialized its warpgroup products (its C75xx notes, `ir_hazards.serialized_products`).
   Pointer arguments carry the 16-byte divisibility a GPU launch specializes on (torch allocations are aligned),
   so the loads vectorize and pipeline as on the device; before session 12 they did not, and the static figures
   of earlier sessions (benchmarks/RESULTS.md) overstate instructions and spills of the pointer kernels.

    python benchmarks/compile_times.py --op gdn2 [--schedule FILE] [--policy R] [--head-dim 128] [--H 4]
                                       [--dtype bf16|fp32] [--gate] [--sass KERNEL,...] [--kernels REGEX]
                                       [--chase] [--flag MODULE.NAME=INT]

--sass prints the named kernels' static SASS opcode counts (nvdisasm): spill loads/stores, barriers, tensor-core
and global-memory instructions; and what one pass of the longest loop (a scan's chunk step) issues: instructions,
tensor-core ops, product waits, CTA barriers, MEMBARs, shared and global stores. With SASS_DUMP=DIR it also writes their SASS listings there (each instruction's
source line included, which benchmarks/ncu_lines.py joins with ncu's per-instruction stall samples), with IR_DUMP=DIR
their Triton GPU IR (.ttgir: the layouts each tl.dot was given) and PTX.

--gate records what one GPU trial of the tuner compiles instead: the gate's validation cases
(`trial_worker.validation_cases`) and the warm-up at a workload shape (no initial state, as the benchmark).
bf16 (default) records the launches a bf16 GPU run makes: the interpreter's "upcast" dot precision is compiled
as the GPU's "tf32" (16-bit operands on tensor cores); fp32 compiles exact-fp32 FMA products, several times
slower to compile for the scans.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time

MODULES = ("recompute", "scan", "scan_operands", "local", "consumer_tma", "query_side", "vector_local", "cumsum",
           "gate")
TORCH_TO_TRITON = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
                   "torch.int32": "i32", "torch.int64": "i64"}


def _record(args) -> list[dict]:
    os.environ["TRITON_INTERPRET"] = "1"
    import importlib

    import torch

    import rewy_tune
    from rewy_tune import gates
    from rewy_tune.schedule import Schedule
    from rewy_tune.search import default_schedule

    from rewy_tune.kernels.triton.flags import flag_home, parse_flag

    for item in args.flag or ():  # (imported under the interpreter, above; the kernels read them at launch)
        try:
            key, value = parse_flag(item)
        except ValueError as err:
            raise SystemExit(f"--flag {err}") from None
        setattr(*flag_home(key), value)
    launches: list[dict] = []

    class Recorder:
        def __init__(self, module, name, kernel):
            self.module, self.name, self.kernel = module, name, kernel

        def __getitem__(self, grid):
            def launch(*a, **kw):
                params = self.kernel.arg_names if hasattr(self.kernel, "arg_names") else None
                launches.append({"module": self.module, "name": self.name, "args": [_kind(x) for x in a],
                                 "kwargs": {k: _kind(v) for k, v in kw.items()}, "params": params})
                return self.kernel[grid](*a, **kw)
            return launch

    for m in MODULES:
        mod = importlib.import_module(f"rewy_tune.kernels.triton.{m}")
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("rewy_") and name.endswith("_kernel") or name.startswith("rewy_bwd_kernel"):
                setattr(mod, name, Recorder(m, name, obj))
    if args.chase:
        from rewy_tune.kernels.triton import pipeline

        pipeline.CONSUMER_CHASES_SCAN = True
    sched = Schedule.from_json(open(args.schedule).read()) if args.schedule else \
        default_schedule(args.op, (9, 0), args.head_dim, args.head_dim, args.dtype, args.policy)
    if args.gate:
        from dataclasses import replace

        from rewy_tune import trial_worker

        runner = gates.op_runner(backend="triton", schedule=sched)
        cases = [replace(c, H=1, dtype=args.dtype)  # H is a run-time argument: one head records the same launches
                 for c in trial_worker.validation_cases(args.op, args.policy, args.head_dim, args.head_dim, "cuda")]
        cases.append(replace(cases[0], T=512, initial_state=False, final_grad=False, label="warm"))
        for i, c in enumerate(cases):
            runner(c, gates.make_inputs(c, i, "cpu"))
        return launches
    case = gates.GateCase(op=args.op, policy=args.policy, B=1, T=128, H=args.H, K=args.head_dim, V=args.head_dim,
                          dtype=args.dtype)
    inputs = gates.make_inputs(case, 0, "cpu")
    names = gates.arg_names(args.op)
    leaves = [inputs[n].clone().requires_grad_(True) for n in names]
    fn = getattr(rewy_tune, f"chunk_{args.op}")
    if args.k_first_saved:
        from rewy_tune.kernels import triton_function

        triton_function.V_FIRST_SAVED_STATES = False
    gate = {}
    if args.gate_in_kernel:  # KDA/GDN2's in-kernel gate (g is then the raw input)
        gate = dict(use_gate_in_kernel=True, A_log=torch.zeros(args.H, requires_grad=True),
                    dt_bias=torch.zeros(args.H * args.head_dim, requires_grad=True))
    o, _ = fn(*leaves, policy=args.policy, backend="triton", schedule=sched, **gate)
    torch.autograd.grad(o, leaves, inputs["do"])
    return launches


def _kind(x):
    import torch

    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(x, torch.Tensor):
        return ("ptr", TORCH_TO_TRITON[str(x.dtype)])
    if isinstance(x, TensorDescriptor):  # consumer_tma's host-built descriptors: Triton's signature string
        block = ",".join(str(b) for b in x.block_shape)
        return ("desc", f"tensordesc<{TORCH_TO_TRITON[str(x.base.dtype)]}[{block}]>")
    if x == "upcast":  # the interpreter's stand-in for 16-bit tensor-core products (recompute.dot_precision)
        return ("const", "tf32")
    if x is None:
        return ("none", None)
    if isinstance(x, bool):
        return ("const", x)
    if isinstance(x, int):
        return ("int", x)
    if isinstance(x, float):
        return ("float", x)
    return ("const", x if isinstance(x, (str, int, float, bool)) else str(x))


def _cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (ptxas): wall time varies with machine load."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def sm90_signature(kernel, values: dict) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and attributes for an sm_90 compile of `kernel` (a JITFunction), from
    `values`: argument name -> (kind, value) as `_kind` records them ("ptr", "desc", "int", "float", "const",
    "none"); a missing name is None."""
    names = kernel.arg_names
    constexpr_names = {names[i] for i in kernel.constexprs}
    no_spec = {prm.name for prm in kernel.params if prm.do_not_specialize}
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(names):
        kind, val = values.get(n, ("none", None))
        # What a GPU launch specializes on (Triton's "D" key): 16-byte aligned pointers (torch allocations
        # are) and integers divisible by 16. Without it the compile vectorizes and pipelines less than the
        # GPU's (session 12: the forward scan's shared memory read 10 500 B here and 67 840 B in ncu).
        if kind == "ptr" or (kind == "int" and n not in no_spec and n not in constexpr_names and val % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if n in constexpr_names or kind in ("none", "const"):
            sig[n] = "constexpr"
            consts[n] = val
        elif kind == "ptr":
            sig[n] = "*" + val
        elif kind == "desc":
            sig[n] = val
        elif kind == "int":
            sig[n] = "i32"
        else:
            sig[n] = "fp32"
    return sig, consts, attrs


def compile_sm90(kernel, sig: dict, consts: dict, attrs: dict, opts: dict):
    """The compiled kernel for sm_90 (Triton bundles ptxas: no GPU needed)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


_DUMPED: dict[str, int] = {}


def _dump(env: str, name: str, opts: dict, ext: str, text) -> None:
    """Write text() to DIR/NAME-wW-sS.EXT where the environment variable env names DIR; the second and later
    launches of a kernel at the same warps and stages (other constexprs: a split scan's two phases) get -2, -3, ..."""
    folder = os.environ.get(env)
    if folder:
        os.makedirs(folder, exist_ok=True)  # a new folder name is the usual case, not an error
        stem = f"{name}-w{opts.get('num_warps')}-s{opts.get('num_stages')}"
        _DUMPED[stem + ext] = n = _DUMPED.get(stem + ext, 0) + 1
        path = os.path.join(folder, f"{stem}{'' if n == 1 else f'-{n}'}.{ext}")
        with open(path, "w") as f:
            f.write(text())
        print(f"   written to {path}")


def print_sass(name: str, opts: dict, cubin: bytes, asm: dict | None = None) -> None:
    """The opcode mix of one compiled kernel; with SASS_DUMP=DIR its whole listing (to read a loop body), and with
    IR_DUMP=DIR and the compiled kernel's asm its Triton GPU IR and PTX (to read how a product was lowered)."""
    print(f"{name} {opts}: {_instruction_mix(cubin)}")
    loop = _longest_loop_mix(_cubin_tool("nvdisasm", "-c", cubin))
    if loop:
        print(f"   longest loop: {loop}")
    # -g: each instruction's source line (a `//## File "...", line N` comment), for benchmarks/ncu_lines.py
    _dump("SASS_DUMP", name, opts, "sass", lambda: _cubin_tool("nvdisasm", "-c -g", cubin))
    for ext in ("ttgir", "ptx") if asm is not None else ():
        _dump("IR_DUMP", name, opts, ext, lambda: asm[ext])


def _compile(launches: list[dict], sass: set[str] = frozenset(), pdl: bool = False) -> list[tuple[str, float, int]]:
    """pdl: the kernels that publish to or chase the other (PUBLISH, CHASE) compile with PDL on, as on the H200
    (the interpreter records them with it off)."""
    os.environ.pop("TRITON_INTERPRET", None)
    import importlib

    from rewy_tune.ir_hazards import dropped_products, serialized_products, war_hazards

    out, seen = [], set()
    for rec in launches:
        mod = importlib.import_module(f"rewy_tune.kernels.triton.{rec['module']}")
        kernel = getattr(mod, rec["name"])
        values = dict(zip(kernel.arg_names, rec["args"]))
        opts = {}
        for k, v in rec["kwargs"].items():
            if k in ("num_warps", "num_stages"):
                opts[k] = v[1]
            elif k != "launch_pdl":  # (a launch option: the same code)
                values[k] = v
        if pdl and "PDL" in values and (values.get("CHASE", ("const", False))[1]
                                        or values.get("PUBLISH", ("const", False))[1]):
            values["PDL"] = ("const", True)
        sig, consts, attrs = sm90_signature(kernel, values)
        key = (rec["name"], json.dumps(consts, sort_keys=True, default=str), json.dumps(opts, sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        c0 = _cpu_seconds()
        c = compile_sm90(kernel, sig, consts, attrs, opts)
        hazards = war_hazards(c.asm["ttgir"])
        dropped = dropped_products(_cubin_tool("nvdisasm", "-c", c.asm["cubin"]))
        if dropped:  # (ptxas deleted products the PTX still reads: ir_hazards.dropped_products)
            hazards = hazards + [f"{dropped} warpgroup products dropped by ptxas (placeholder HGMMAs in the SASS)"]
        seconds = _cpu_seconds() - c0  # (before serialized_products' own ptxas run, which the compile does not make)
        out.append((rec["name"], seconds, c.metadata.shared, opts, _resource_usage(c.asm["cubin"]), hazards,
                    serialized_products(c.asm["ptx"])))  # None: not checked (no bundled ptxas, or it failed)
        if rec["name"] in sass:
            print_sass(rec["name"], opts, c.asm["cubin"], c.asm)
    return out


def _cubin_tool(name: str, option: str, cubin: bytes) -> str:
    """stdout of one of Triton's bundled CUDA binary tools (cuobjdump, nvdisasm) run on `cubin`."""
    from rewy_tune.ir_hazards import cubin_tool

    done = cubin_tool(name, option, cubin)
    if done is None:
        raise FileNotFoundError(f"Triton ships no {name} (triton/backends/nvidia/bin)")
    return done.stdout


# an instruction line of `nvdisasm -c`: /*addr*/, an optional predicate, the opcode
SASS_OPCODE = r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)"


def _instruction_mix(cubin: bytes, top: int = int(os.environ.get("SASS_TOP", "24"))) -> str:
    """Static SASS opcode counts (nvdisasm): spills (LDL/STL), barriers (BAR: layout conversions and reductions
    through shared memory), tensor-core ops (HGMMA), global loads (LDG: synchronous; LDGSTS: cp.async)."""
    import collections
    import re

    ops = collections.Counter(m.group(1) for m in re.finditer(SASS_OPCODE, _cubin_tool("nvdisasm", "-c", cubin)))
    return f"{sum(ops.values())} instructions; " + ", ".join(f"{k} {v}" for k, v in ops.most_common(top))


def _longest_loop_mix(sass: str) -> str:
    """What one pass of a kernel's longest loop (the span from a label to the furthest backward branch to it)
    issues: instructions, tensor-core ops, product waits (WARPGROUP.DEPBAR), CTA barriers, MEMBARs (the fence before
    each product that reads shared memory written from registers), shared-memory stores and global stores. The
    scans' chunk step is that loop; "" where a kernel has none."""
    import collections
    import re

    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", line)
        if m and labels.get(m.group(1), i) < i and (best is None or i - labels[m.group(1)] > best[1] - best[0]):
            best = (labels[m.group(1)], i)
    if best is None:
        return ""
    ops = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        m = re.search(SASS_OPCODE + r"(\.\w+)?", line)
        if m:
            ops[m.group(1)] += 1
            ops["WAIT"] += m.group(1) == "WARPGROUP" and (m.group(2) or "") == ".DEPBAR"
    total = sum(n for k, n in ops.items() if k != "WAIT")
    return (f"{total} instructions; HGMMA {ops['HGMMA']}, product waits {ops['WAIT']}, BAR {ops['BAR']}, "
            f"MEMBAR {ops['MEMBAR']}, STS {ops['STS'] + ops['STSM']}, STG {ops['STG']}")


def _resource_usage(cubin: bytes) -> str:
    """Registers per thread and local memory (spill) bytes per thread of a compiled kernel, from the cubin
    (Triton's bundled cuobjdump): the register pressure that ncu shows on the GPU, readable without one."""
    import re

    m = re.search(r"REG:(\d+) STACK:(\d+)", _cubin_tool("cuobjdump", "-res-usage", cubin))
    return f"regs {m.group(1):>3} stack {m.group(2):>5} B" if m else "regs ?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--op", default="gdn2")
    ap.add_argument("--policy", default="R")
    ap.add_argument("--schedule", help="Schedule JSON file (default: the operator's sm_90 default)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--gate", action="store_true", help="what one GPU trial compiles: gate cases and warm-up")
    ap.add_argument("--k-first-saved", action="store_true",
                    help="KDA/GDN2 policy A: S0 K-first, as before session 21 (triton_function.V_FIRST_SAVED_STATES "
                         "off; the default is FLA's V-first layout)")
    ap.add_argument("--gate-in-kernel", action="store_true",
                    help="KDA/GDN2: the op with FLA's in-kernel gate (use_gate_in_kernel, A_log, dt_bias)")
    ap.add_argument("--sass", default="", metavar="KERNELS",
                    help="comma-separated kernel names whose static SASS instruction mix is printed")
    ap.add_argument("--kernels", default="", metavar="REGEX",
                    help="compile only the launches whose kernel name matches (e.g. 'scan' for the two scans)")
    ap.add_argument("--chase", action="store_true",
                    help="the consumer chasing the reverse scan (pipeline.CONSUMER_CHASES_SCAN), compiled with PDL")
    ap.add_argument("--hazards", action="store_true",
                    help="exit 1 if a kernel's TTGIR has a shared-memory write-after-read hazard of an asynchronous "
                         "product, or its SASS a product ptxas dropped (rewy_tune/ir_hazards.py; always reported)")
    ap.add_argument("--flag", action="append", default=None, metavar="MODULE.NAME=INT",
                    help="set a kernels/triton module flag while the launches are recorded (as profile_stages' flag "
                         "variants), e.g. scan.EARLY_GATE_ROW=0")
    ap.add_argument("--_stage", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--_file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._stage == "record":
        pickle.dump(_record(args), open(args._file, "wb"))
        return
    if args._stage == "compile":
        launches = pickle.load(open(args._file, "rb"))
        if args.kernels:
            import re

            launches = [rec for rec in launches if re.search(args.kernels, rec["name"])]
        out = _compile(launches, set(filter(None, args.sass.split(","))), pdl=args.chase)
        for name, s, shared, opts, usage, hazards, serialized in out:
            print(f"{name:40s} {s:7.2f} CPU s  shared {shared:7d} B  {usage}  {opts}")
            for h in hazards:
                print(f"   HAZARD {h}")
            for note in serialized or []:
                print(f"   SERIALIZED warpgroup products, {note}")
        print(f"{len(out)} distinct compiles, {sum(s for _, s, *_ in out):.1f} CPU s")
        print(f"{sum(1 for *_, ser in out if ser)} kernels with serialized warpgroup products (ptxas C75xx; slower, "
              f"not wrong: rewy_tune/ir_hazards.serialized_products)")
        print(f"{sum(1 for *_, ser in out if ser is None)} kernels not checked for serialized products (no bundled "
              f"ptxas, or its second run failed)")
        n = sum(len(h) for *_, h, _ in out)
        print(f"{n} hazards: shared-memory write-after-read, or products dropped by ptxas (rewy_tune/ir_hazards.py)")
        if n and args.hazards:
            sys.exit(1)
        return
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "launches.pkl")
        base = [sys.executable, __file__] + [a for a in sys.argv[1:]]
        subprocess.run(base + ["--_stage", "record", "--_file", f], check=True)
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(tmp, "cache"))
        env.pop("TRITON_INTERPRET", None)
        t0 = time.perf_counter()
        done = subprocess.run(base + ["--_stage", "compile", "--_file", f], env=env)
        print(f"total {time.perf_counter() - t0:.1f} s wall (fresh cache, one process)")
        if done.returncode:
            sys.exit(done.returncode)


if __name__ == "__main__":
    main()
