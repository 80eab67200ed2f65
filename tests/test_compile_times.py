"""benchmarks/compile_times.py reads registers and stack frame (spills) off an sm_90 cubin compiled on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_times.py"

# A fresh process, as compile_times.py compiles: the interpreter that other tests run in this process patches
# triton.language, and a real compile after it fails.
PROGRAM = textwrap.dedent(f"""
    import importlib.util, os
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.access(tool, os.X_OK):
        print("NO-CUOBJDUMP")
        raise SystemExit(0)

    @triton.jit
    def copy(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y + o, tl.load(x + o) * 2.0)

    c = triton.compile(ASTSource(fn=copy, signature={{"x": "*fp32", "y": "*fp32", "N": "constexpr"}},
                                 constexprs={{"N": 128}}), target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}})
    spec = importlib.util.spec_from_file_location("compile_times", {str(SCRIPT)!r})
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    print(mod._instruction_mix(c.asm["cubin"]))
    print(mod._resource_usage(c.asm["cubin"]))
""")


def _skip_without_cuobjdump() -> None:
    """Skip where the Triton wheel bundles no cuobjdump (compile_times.py reads registers with it), decided up front:
    a missing "regs" in the script's output means it compiled nothing, which is a failure, not a skip."""
    from rewy_tune.ir_hazards import bundled_tool

    if bundled_tool("cuobjdump") is None:
        pytest.skip("this Triton wheel bundles no cuobjdump")


def _opcode_counts(line: str) -> dict[str, int]:
    """Opcode -> count from a "... N instructions; OP n, OP n, ..." line of compile_times' --sass output."""
    return {k: int(v) for k, v in re.findall(r"([A-Z][A-Z0-9_]*) (\d+)", line.split(";", 1)[1])}


def test_resource_usage_of_an_sm90_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    program = tmp_path / "compile_copy.py"  # @triton.jit needs its source in a file
    program.write_text(PROGRAM)
    out = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    usage = out.stdout.strip().splitlines()[-1]
    if usage == "NO-CUOBJDUMP":
        pytest.skip("this Triton wheel bundles no cuobjdump")
    m = re.fullmatch(r"regs +(\d+) stack +(\d+) B", usage)
    assert m, usage
    assert 0 < int(m.group(1)) <= 255 and int(m.group(2)) == 0  # a copy kernel spills nothing
    # --sass: static opcode counts (nvdisasm); the copy loads and stores, and spills nothing
    mix = _opcode_counts(out.stdout.strip().splitlines()[-2])
    assert mix["LDG"] >= 1 and mix["STG"] >= 1 and "LDL" not in mix, mix


def test_compiles_what_a_gpu_launch_compiles(tmp_path):
    # The descriptor consumer (the scalar H200 default) is recorded and compiled, and pointers carry the 16-byte
    # alignment a GPU launch specializes on: without it the forward scan's tile loads are not cp.async-pipelined
    # (no LDGSTS; 10 500 B of shared memory where the H200 showed 67 844 B in ncu, session 12).
    _skip_without_cuobjdump()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--op", "deltanet", "--head-dim", "64", "--sass",
                          "rewy_fwd_scan_kernel"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert " regs " in out.stdout, out.stdout[-3000:]
    assert re.search(r"^rewy_bwd_kernel_consumer_tma +[\d.]+ CPU s", out.stdout, re.M), out.stdout
    sass = next(line for line in out.stdout.splitlines() if line.startswith("rewy_fwd_scan_kernel {"))
    assert re.search(r"\bLDGSTS \d+", sass), sass


def test_forward_scan_stages_no_more_than_flas_kernel(tmp_path):
    # At equal settings (BV 16, 4 warps, 2 stages, K = V = 128, bf16, no gate) our forward scan's SASS has FLA's
    # count of CTA barriers and shared-memory stores. Session 13: a negated state operand cost its own copy and two
    # more barriers per step (9 against 6 barriers in the kernel).
    from rewy_tune.search_spaces import default_schedule

    pytest.importorskip("fla")
    _skip_without_cuobjdump()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), SASS_TOP="500")  # every opcode, not the 24 most frequent
    sched = tmp_path / "schedule.json"
    sched.write_text(default_schedule((9, 0), op="deltanet").replace(
        forward_scan={"block_v": 16, "num_warps": 4, "num_stages": 2}).to_json())
    ours = subprocess.run([sys.executable, str(SCRIPT), "--op", "deltanet", "--schedule", str(sched), "--sass",
                           "rewy_fwd_scan_kernel"], capture_output=True, text=True, env=env, timeout=600)
    fla = subprocess.run([sys.executable, str(SCRIPT.with_name("fla_scan_sass.py")), "--block-v", "16", "--warps",
                          "4", "--stages", "2"], capture_output=True, text=True, env=env, timeout=600)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert fla.returncode == 0, fla.stderr[-3000:]
    assert " regs " in ours.stdout, ours.stdout[-3000:]

    def mix(stdout, prefix):
        return _opcode_counts(next(s for s in stdout.splitlines() if s.startswith(prefix) and "instructions;" in s))

    a, b = mix(ours.stdout, "rewy_fwd_scan_kernel {"), mix(fla.stdout, "fla_fwd_h")
    for op in ("BAR", "STSM", "HGMMA"):
        assert 0 < a.get(op, 0) <= b.get(op, 0), (op, a, b)


def test_scan_state_rows_reach_the_sm90_loop(tmp_path):
    # Schedule.scan_state_rows 128 (--schedule FILE): the DeltaNet A reverse scan at K = 128 holds its state in one
    # block, so each chunk step waits for three tensor-core products instead of six (--sass's "longest loop" line: one
    # WARPGROUP.DEPBAR per waited product)
    from rewy_tune.search_spaces import default_schedule

    _skip_without_cuobjdump()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    loops = {}
    for rows in (64, 128):
        sched = tmp_path / f"rows{rows}.json"
        sched.write_text(default_schedule((9, 0), op="deltanet", policy="A").replace(scan_state_rows=rows).to_json())
        out = subprocess.run([sys.executable, str(SCRIPT), "--op", "deltanet", "--policy", "A", "--kernels",
                              "rewy_bwd_scan", "--sass", "rewy_bwd_scan_kernel", "--schedule", str(sched)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        assert " regs " in out.stdout, out.stdout[-3000:]
        line = next(x for x in out.stdout.splitlines() if x.strip().startswith("longest loop:"))
        loops[rows] = _opcode_counts(line.replace("product waits", "WAITS"))
    assert loops[64]["HGMMA"] == loops[128]["HGMMA"] == 24, loops  # the same products (m64n32k16 each)
    assert (loops[64]["WAITS"], loops[128]["WAITS"]) == (6, 3), loops


def test_a_module_flag_reaches_the_recorded_launches(tmp_path):
    # --flag sets a kernels/triton module flag while the launches are recorded: with scan.EARLY_GATE_ROW=0 KDA's
    # pregated scans are recorded (and so compiled) loading the chunk's last gate row late (EARLY_GN off)
    import pickle

    early = {}
    for flag in ([], ["--flag", "scan.EARLY_GATE_ROW=0"]):
        launches = tmp_path / "launches.pkl"
        out = subprocess.run([sys.executable, str(SCRIPT), "--op", "kda", "--policy", "R", "--head-dim", "32", "--H",
                              "1", *flag, "--_stage", "record", "--_file", str(launches)],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        recorded = pickle.loads(launches.read_bytes())
        early[bool(flag)] = {rec["kwargs"]["EARLY_GN"] for rec in recorded if "scan_kernel" in rec["name"]}
    assert early == {False: {("const", True)}, True: {("int", 0)}}, early  # (--flag's values are integers)


def test_longest_loop_mix_reads_one_pass_of_the_longest_loop():
    # a label, a short loop inside it (backward branch to .L_x_1) and the long one (backward branch to .L_x_0)
    import importlib.util

    spec = importlib.util.spec_from_file_location("compile_times", SCRIPT)
    ct = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct)
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR8].tnspB, R24 ;",
        "        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;",
        ".L_x_1:",
        "        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0040*/              @P0  BRA `(.L_x_1) ;",
        "        /*0050*/                   MEMBAR.ALL.CTA ;",
        "        /*0060*/                   STSM.16.M88.4 [R2], R20 ;",
        "        /*0070*/                   STG.E.128 desc[UR4][R2.64], R4 ;",
        "        /*0080*/              @!P1 BRA `(.L_x_0) ;",
        "        /*0090*/                   EXIT ;",
    ])
    assert ct._longest_loop_mix(sass) == ("8 instructions; HGMMA 1, product waits 1, BAR 1, MEMBAR 1, STS 1, STG 1")
    assert ct._longest_loop_mix("        /*0000*/                   EXIT ;") == ""


@pytest.mark.parametrize("flag", ["scan.NO_SUCH_FLAG=1", "nomodule.X=1", "scan.EARLY_GATE_ROW=big", "EARLY_GATE_ROW",
                                  "scan.STATE_BLOCK_ROWS=128"])  # (a Schedule field now: --schedule)
def test_a_flag_that_names_nothing_is_refused(flag, tmp_path):
    # a typo must not compile the default and call it the flag's code
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--op", "deltanet", "--kernels", "rewy_bwd_scan", "--flag",
                          flag], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode != 0
    assert f"--flag {flag!r}: expected MODULE.NAME=INT naming an existing flag" in out.stderr, out.stderr[-2000:]
