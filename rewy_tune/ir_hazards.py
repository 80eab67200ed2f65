"""Shared-memory write-after-read hazards of asynchronous tensor-core products in a compiled kernel's Triton GPU IR.

On Hopper `tl.dot` becomes an asynchronous `warp_group_dot` that reads its operands from shared memory until a later
`warp_group_dot_wait` retires it. Triton 3.6's software pipeliner can leave a loaded tile in a buffer of one slot
(``local_alloc`` of ``memdesc<1x...>``) when the tile feeds both a product and a register use (``local_load``), then
queue the next iteration's ``async_copy_global_to_local`` into that slot while the product reading it may still be in
flight (its wait keeps ``pendings`` > 0). The product then reads a mix of two iterations' tiles, depending on timing:
session 34's query-side stage changed dk from run to run on the H200 only when it shared SMs with the reverse scan.
Upstream fixed related cases (triton-lang/triton#3106, 2024: both operands must be multi-buffered; #8554, 2025: a
load feeding two products); a load feeding a product and a register read still gets one slot in Triton 3.6.0.

`war_hazards(ttgir)` replays each loop body twice (its second pass sees the products the first left pending, as the
next iteration does), tracking the outstanding products and the buffers each reads, and reports every write into a
single-slot buffer (an async copy, a TMA copy, a ``local_store``, or the next run of a ``local_alloc`` filled from
registers) that an outstanding product still reads.

`dropped_products(sass)` counts another sm_90 failure, one the TTGIR cannot show: ptxas (CUDA 12.8 bundled with
Triton 3.6, and 12.9; not 13.0) at -O3 can delete a chain of `wgmma.mma_async` whose accumulators the PTX still reads,
leaving a placeholder ``HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ`` per removed group in the SASS. Session 36: the vector
consumer with STATE_ROWSUM_FIRST at K = V = 256 (bf16 S0, 2 stages) lost phase 2's P and P S0ᵀ products, so dk
(γ P S0ᵀ enters dk and the erase path only) came out wrong on the H200 while dq passed.

`serialized_products(ptx)` finds a performance loss, not a fault: ptxas runs a kernel's warpgroup products one at a
time (each waited before the next starts) where it cannot keep their accumulators in flight, and says so only in its
verbose log (C7512 for want of registers, C7515 for a non-product instruction writing an accumulator between a
product's start and its wait). Session 42: DeltaNet A's flat consumer reset its accumulators after the dk epilogue,
an ordinary select inside the products' pipeline stage, and every product of the kernel was serialized.

`compiled_hazards(kernel_functions())` applies it to the kernels a process has compiled (their TTGIR kept in Triton's
cache), and `compiled_dropped_products` the other check to their cubins: the tuner's gate runs both after a
schedule's gate cases (`trial_worker`), since a run-twice comparison catches such a race only sometimes, and a gate
case may miss the shape whose binary lost a product. `forget_compiled` empties the in-memory kernel caches first, so
that what is found afterwards is what that schedule compiled or loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SSA = r"%[\w.#]+"
_ALLOC = re.compile(rf"({_SSA}) = ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x")  # empty: N slots
_ALLOC_FROM = re.compile(rf"({_SSA}) = ttg\.local_alloc ({_SSA})\s*:")  # filled from registers where it runs
_VIEW = re.compile(rf"({_SSA}) = ttg\.memdesc_\w+ ({_SSA})")
_DOT = re.compile(rf"({_SSA}) = ttng\.warp_group_dot ({_SSA}), ({_SSA}),.*isAsync = true")
_WAIT = re.compile(r"ttng\.warp_group_dot_wait .*\{pendings = (\d+) : i32\}")
_WRITES = (
    re.compile(rf"ttg\.async_copy_global_to_local {_SSA}, ({_SSA})"),
    re.compile(rf"ttng\.async_tma_copy_global_to_local {_SSA}\[[^\]]*\] ({_SSA})"),
    re.compile(rf"ttg\.local_store {_SSA}, ({_SSA})"),
)
_FOR = re.compile(r"\bscf\.for\b")


@dataclass(frozen=True)
class Hazard:
    """A write into the single-slot buffer `buffer` (line `write_line`, 1-based) while the product of line
    `dot_line` may still read it."""
    buffer: str
    dot_line: int
    write_line: int

    def __str__(self) -> str:
        return (f"{self.buffer}: written at line {self.write_line} while the asynchronous product of line "
                f"{self.dot_line} may still read it")


def _loop_bodies(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line indices of every scf.for body, by brace depth (the IR prints one op per line)."""
    bodies, open_at, depth = [], [], 0
    for i, line in enumerate(lines):
        code = line.split(" loc(")[0] if " loc(" in line else line
        opens, closes = code.count("{"), code.count("}")
        if _FOR.search(code) and code.rstrip().endswith("{"):
            open_at.append((depth, i))
        depth += opens - closes
        while open_at and depth <= open_at[-1][0]:
            d, start = open_at.pop()
            bodies.append((start + 1, i))
    return bodies


def war_hazards(ttgir: str) -> list[Hazard]:
    """Every write into a single-slot shared buffer that an outstanding asynchronous product may still read."""
    lines = ttgir.splitlines()
    slots: dict[str, int] = {}
    base: dict[str, str] = {}
    for line in lines:
        m = _ALLOC.search(line)
        if m:
            slots[m.group(1)] = int(m.group(2))
            base[m.group(1)] = m.group(1)
        m = _ALLOC_FROM.search(line)
        if m:  # one buffer per op: each time the op runs (the next iteration) it is written again
            slots[m.group(1)] = 1
            base[m.group(1)] = m.group(1)
        m = _VIEW.search(line)
        if m and m.group(2) in base:
            base[m.group(1)] = base[m.group(2)]
    found: dict[tuple[str, int, int], Hazard] = {}
    for first, last in _loop_bodies(lines):
        pending: list[tuple[int, set[str]]] = []  # outstanding products: (line, buffers read), oldest first
        for i in list(range(first, last)) * 2:
            line = lines[i]
            m = _DOT.search(line)
            if m:
                pending.append((i, {base[v] for v in m.groups()[1:] if v in base}))
                continue
            m = _WAIT.search(line)
            if m:
                keep = int(m.group(1))
                pending = pending[-keep:] if keep else []
                continue
            for w in (*_WRITES, _ALLOC_FROM):
                m = w.search(line)
                if m and m.group(1) in base and slots.get(base[m.group(1)]) == 1:
                    buf = base[m.group(1)]
                    for dot_line, reads in pending:
                        if buf in reads:
                            found.setdefault((buf, dot_line, i), Hazard(buf, dot_line + 1, i + 1))
    return sorted(found.values(), key=lambda h: (h.write_line, h.dot_line))


# ptxas's stand-in for a deleted warpgroup product: an HGMMA into RZ from the null descriptor
_DROPPED_HGMMA = re.compile(r"\bHGMMA\.\S+\s+RZ\s*,\s*gdesc\[URZ\]")


def dropped_products(sass: str) -> int:
    """How many warpgroup products ptxas replaced by placeholders in a kernel's SASS (`nvdisasm -c` text): each
    ``HGMMA ... RZ, gdesc[URZ], RZ`` stands for a group of ``wgmma.mma_async`` of the PTX that no longer runs. Triton
    emits no product whose result goes unused, so any count above 0 is a product missing from the binary."""
    return len(_DROPPED_HGMMA.findall(sass))


# ptxas -v: "(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to <reason> ..."
_SERIALIZED = re.compile(r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized due to "
                         r"(.*?)(?: (?:for|in) the function '[^']*')?\.?\s*$", re.MULTILINE)


def serialization_notes(ptxas_log: str) -> list[str]:
    """The reasons ptxas gives in a verbose log (-v) for serializing warpgroup products, as "C7512: insufficient
    register resources" (one per note; empty: the products pipeline)."""
    return [f"{code}: {reason}" for code, reason in _SERIALIZED.findall(ptxas_log)]


def serialized_products(ptx: str, arch: str = "sm_90a") -> list[str] | None:
    """`serialization_notes` of Triton's bundled ptxas assembling `ptx` for `arch` (what Triton's compile ran, its log
    kept this time), or None where Triton ships no ptxas or it fails."""
    import os
    import subprocess
    import tempfile

    ptxas = bundled_tool("ptxas")
    if ptxas is None:
        return None
    # (a second ptxas run: Triton's own -v log is deleted unless TRITON_DUMP_PTXAS_LOG prints every kernel's)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-v", f"-arch={arch}", src, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True)
    return serialization_notes(done.stderr + done.stdout) if done.returncode == 0 else None


def kernel_functions(package: str = "rewy_tune.kernels.triton") -> list:
    """Every Triton JIT function defined or imported in the package's modules (helpers included: they are never
    launched, so they hold no compiled kernels). Under the interpreter there are none."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    found: dict[int, JITFunction] = {}
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"{package}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                found.setdefault(id(obj), obj)
    return list(found.values())


def forget_compiled(functions) -> None:
    """Empty the functions' in-memory kernel caches; their next launches load from Triton's on-disk cache (or
    compile), so `compiled_hazards` then sees just the kernels launched since."""
    for fn in functions:
        fn.device_caches.clear()


def bundled_tool(name: str) -> str | None:
    """The path of one of the CUDA tools Triton ships (ptxas, nvdisasm, cuobjdump), or None where it ships none."""
    import os

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return tool if os.path.exists(tool) else None


def cubin_tool(name: str, option: str, cubin: bytes):
    """One of Triton's bundled CUDA binary tools (nvdisasm, cuobjdump) run on `cubin`: the finished process (stdout
    text), or None where Triton ships no such tool."""
    import subprocess
    import tempfile

    tool = bundled_tool(name)
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *option.split(), f.name], capture_output=True, text=True)


def _nvdisasm(cubin: bytes) -> str | None:
    """`nvdisasm -c` of a cubin, or None where the tool is missing or fails."""
    done = cubin_tool("nvdisasm", "-c", cubin)
    return done.stdout if done is not None and done.returncode == 0 else None


def compiled_kernels(functions):
    """The compiled kernels the JIT functions hold in memory (Triton 3.6's device caches)."""
    for fn in functions:
        for caches in list(fn.device_caches.values()):
            yield from list(caches[0].values())


def compiled_dropped_products(functions) -> list[tuple[str, int]]:
    """(kernel name, count) for every compiled kernel of the functions whose SASS has products ptxas dropped
    (`dropped_products`); kernels without a cubin, or where nvdisasm cannot run, are not checked."""
    found = []
    for kernel in compiled_kernels(functions):
        cubin = getattr(kernel, "asm", {}).get("cubin")
        sass = _nvdisasm(cubin) if cubin else None
        n = dropped_products(sass) if sass else 0
        if n:
            found.append((kernel.name, n))
    return found


def compiled_hazards(functions) -> tuple[list[tuple[str, Hazard]], int]:
    """(kernel name, hazard) for every hazard in the TTGIR of the kernels the functions hold compiled, and how many
    compiled kernels had no TTGIR to read (a cache copied without it: not checked)."""
    found, unread = [], 0
    for kernel in compiled_kernels(functions):
        asm = getattr(kernel, "asm", {})
        if "ttgir" not in asm:
            unread += 1
            continue
        found.extend((kernel.name, h) for h in war_hazards(asm["ttgir"]))
    return found, unread
