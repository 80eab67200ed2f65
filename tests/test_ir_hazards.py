"""rewy_tune/ir_hazards.py on Triton GPU IR shaped as Triton 3.6 prints it for sm_90 (loop bodies trimmed to the
operations the check reads; the first case is the loop of session 34's query-side stage that raced on the H200)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rewy_tune.ir_hazards import war_hazards


def _ir(body: str, slots: int = 1, wait: int = 1) -> str:
    """A kernel whose loop feeds buffer %a (of `slots` slots) to an asynchronous product, waits until `wait` products
    are left outstanding, and copies the next tile into %a's slot 0."""
    return textwrap.dedent(f"""\
        module {{
          tt.func public @k(%p: !tt.ptr<bf16>) {{
            %a = ttg.local_alloc : () -> !ttg.memdesc<{slots}x64x64xbf16, #shared, #smem, mutable> loc(#loc1)
            %b = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared1, #smem, mutable> loc(#loc2)
            %a0 = ttg.memdesc_index %a[%c0_i32] : !ttg.memdesc<{slots}x64x64xbf16> -> !ttg.memdesc<64x64xbf16> loc(#loc1)
            %r:2 = scf.for %i = %c0_i32 to %c2_i32 step %c1_i32 iter_args(%acc = %cst, %j = %c0_i32) -> (tensor<64x64xf32, #mma>, i32)  : i32 {{
              %x = ttg.async_wait %t {{num = 0 : i32}} loc(#loc1)
              %av = ttg.memdesc_index %a[%j] : !ttg.memdesc<{slots}x64x64xbf16> -> !ttg.memdesc<64x64xbf16> loc(#loc1)
              %bv = ttg.memdesc_index %b[%j] : !ttg.memdesc<2x64x64xbf16> -> !ttg.memdesc<64x64xbf16> loc(#loc2)
              %d = ttng.warp_group_dot %av, %bv, %acc {{inputPrecision = 0 : i32, isAsync = true}} : !ttg.memdesc<64x64xbf16> * !ttg.memdesc<64x64xbf16> -> tensor<64x64xf32, #mma> loc(#loc3)
              %w:3 = ttng.warp_group_dot_wait %d, %av, %bv {{pendings = {wait} : i32}} : tensor<64x64xf32, #mma> loc(#loc3)
        {body}
              scf.yield %w#0, %j : tensor<64x64xf32, #mma>, i32 loc(#loc4)
            }} loc(#loc4)
            tt.return loc(#loc5)
          }} loc(#loc6)
        }} loc(#loc7)
        """)


COPY_A = ("      %c = ttg.async_copy_global_to_local %ptrs, %a0 mask %m {contiguity = 8 : i32} : "
          "tensor<64x64x!tt.ptr<bf16>, #blocked> -> <64x64xbf16, #shared, #smem, mutable> loc(#loc1)")
COPY_B = ("      %c = ttg.async_copy_global_to_local %ptrs, %bv mask %m {contiguity = 8 : i32} : "
          "tensor<64x64x!tt.ptr<bf16>, #blocked> -> <64x64xbf16, #shared1, #smem, mutable> loc(#loc2)")


def test_a_copy_into_a_one_slot_buffer_under_an_outstanding_product_is_found():
    hazards = war_hazards(_ir(COPY_A))
    assert len(hazards) == 1
    h = hazards[0]
    assert h.buffer == "%a"
    lines = _ir(COPY_A).splitlines()
    assert "warp_group_dot %av" in lines[h.dot_line - 1] and "async_copy_global_to_local" in lines[h.write_line - 1]
    assert "written at line" in str(h)


def test_no_hazard_once_the_product_is_retired_or_the_buffer_has_slots():
    assert war_hazards(_ir(COPY_A, wait=0)) == []  # the wait retires the product before the copy
    assert war_hazards(_ir(COPY_A, slots=2)) == []  # the pipeliner's usual two slots: the copy fills the other
    assert war_hazards(_ir(COPY_B)) == []  # the product's other operand has two slots


def test_a_tma_copy_a_local_store_and_a_refilled_alloc_are_writes_too():
    tma = ("      ttng.async_tma_copy_global_to_local %desc[%c0_i32, %t0] %a0, %bar, %true : "
           "!tt.tensordesc<tensor<64x64xbf16>>, !ttg.memdesc<1xi64> -> !ttg.memdesc<64x64xbf16> loc(#loc1)")
    store = "      ttg.local_store %val, %a0 : tensor<64x64xbf16, #blocked> -> !ttg.memdesc<64x64xbf16> loc(#loc1)"
    assert [h.buffer for h in war_hazards(_ir(tma))] == ["%a"]
    assert [h.buffer for h in war_hazards(_ir(store))] == ["%a"]
    # an operand staged from registers in the loop: its next iteration's staging writes the buffer the product of
    # this one may still read
    staged = _ir("").replace(
        "%d = ttng.warp_group_dot %av,",
        "%s = ttg.local_alloc %regs : (tensor<64x64xbf16, #blocked>) -> !ttg.memdesc<64x64xbf16, #shared, #smem> "
        "loc(#loc8)\n      %d = ttng.warp_group_dot %s,")
    assert [h.buffer for h in war_hazards(staged)] == ["%s"]
    assert war_hazards(staged.replace("{pendings = 1 : i32}", "{pendings = 0 : i32}")) == []


def test_a_write_outside_any_loop_is_not_a_hazard():
    # the prologue's first copy into %a runs before any product
    ir = _ir("").replace("    %r:2 = scf.for", COPY_A.strip().join(["    ", "\n    %r:2 = scf.for"]), 1)
    assert war_hazards(ir) == []


SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_times.py"


@pytest.mark.parametrize("op, policy, changes", [
    ("deltanet", "R", {}), ("deltanet", "A", {}), ("gdn", "A", {}), ("kda", "R", {}), ("gdn2", "A", {}),
    ("gdn", "R", {"dq_stage": "separate"}),  # the query-side stage with a gate (DeltaNet's defaults run it ungated)
], ids=["deltanet-R", "deltanet-A", "gdn-A", "kda-R", "gdn2-A", "gdn-R-query-side"])
def test_no_kernel_of_the_sm90_defaults_has_a_hazard(op, policy, changes, tmp_path):
    # every kernel one backward launches with the operator's H200 default, compiled ahead for sm_90 as the H200
    # compiles it (benchmarks/compile_times.py, which exits 1 on a hazard): session 34's race came from such a buffer
    args = [sys.executable, str(SCRIPT), "--op", op, "--policy", policy, "--H", "2", "--hazards"]
    if changes:
        from rewy_tune.search import default_schedule

        sched = tmp_path / "schedule.json"
        sched.write_text(default_schedule(op, (9, 0), 128, 128, policy=policy).replace(**changes).to_json())
        args += ["--schedule", str(sched)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert re.search(r"^0 hazards: shared-memory write-after-read", out.stdout, re.M), \
        out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, out.stderr[-3000:]
    _assert_compiled(out.stdout)


def _assert_compiled(stdout: str) -> None:
    # the "0 ..." verdicts hold for an empty launch list too: a backward compiles several kernels, each checked
    compiled = re.search(r"^(\d+) distinct compiles", stdout, re.M)
    assert compiled and int(compiled.group(1)) >= 3, stdout[-3000:]
    assert re.search(r"^0 kernels not checked for serialized products", stdout, re.M), stdout[-3000:]


@pytest.mark.parametrize("op, policy", [("deltanet", "A"), ("gdn", "A"), ("deltanet", "R")])
@pytest.mark.parametrize("H", [16, 4])
def test_the_query_side_defaults_keep_their_warpgroup_products_pipelined(op, policy, H):
    # ptxas serializes a kernel's warpgroup products (each waited before the next) for want of registers or where a
    # non-product instruction writes an accumulator inside their pipeline stage: DeltaNet A's flat consumer did so
    # until session 42 (its accumulators reset after the dk epilogue, C7515). H 4 and 16: two and one consumer
    # programs per chunk (consumer_k_split auto). The defaults with the query-side stage (both under A, DeltaNet's
    # under R since session 46); GDN R's full consumer is serialized for want of registers (C7512).
    args = [sys.executable, str(SCRIPT), "--op", op, "--policy", policy, "--H", str(H)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^0 kernels with serialized warpgroup products", out.stdout, re.M), out.stdout[-3000:]
    _assert_compiled(out.stdout)


def test_serialization_notes_read_the_ptxas_log():
    from rewy_tune.ir_hazards import serialization_notes

    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
           "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non "
           "wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage "
           "in the function 'k'\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "insufficient register resources for the function 'k'\n"
           "ptxas info    : Used 238 registers, used 1 barriers\n")
    assert serialization_notes(log) == [
        "C7515: non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
        "pipeline stage", "C7512: insufficient register resources"]
    assert serialization_notes(log.split("\n", 1)[0] + "\nptxas info    : Used 238 registers\n") == []


class _Compiled:
    """A compiled kernel as Triton's in-memory cache holds it: a name and its IR by stage."""

    def __init__(self, name: str, ttgir: str | None):
        self.name = name
        self.asm = {} if ttgir is None else {"ttgir": ttgir}


class _Jit:
    """A JIT function's device caches as Triton 3.6 keeps them: (kernel cache, key cache, target, backend, binder)."""

    def __init__(self, *kernels):
        self.device_caches = {0: ({f"key{i}": k for i, k in enumerate(kernels)}, {}, None, None, None)}


def test_compiled_kernels_are_checked_by_their_ttgir_and_forgotten():
    from rewy_tune import ir_hazards

    racy, clean, unread = _Compiled("racy", _ir(COPY_A)), _Compiled("clean", _ir(COPY_A, slots=2)), _Compiled("x", None)
    fns = [_Jit(racy, clean), _Jit(unread)]
    found, not_read = ir_hazards.compiled_hazards(fns)
    assert [(name, h.buffer) for name, h in found] == [("racy", "%a")] and not_read == 1
    ir_hazards.forget_compiled(fns)  # the next launches load again: only they are checked
    assert ir_hazards.compiled_hazards(fns) == ([], 0)


def test_the_tuner_gate_names_the_kernel_and_the_buffer():
    # trial_worker._gate returns this message with status "nondeterministic" after a GPU schedule's gate cases
    from rewy_tune import trial_worker

    msg = trial_worker._hazard_message([_Jit(_Compiled("rewy_bwd_kernel_query_side", _ir(COPY_A)))])
    assert msg.startswith("shared-memory write-after-read hazard in rewy_bwd_kernel_query_side: %a: written at line")
    assert trial_worker._hazard_message([_Jit(_Compiled("k", _ir(COPY_A, wait=0)))]) is None


def test_kernel_functions_lists_the_package_kernels_when_compiled():
    # (under the interpreter the kernels are interpreted functions and none are listed: the gate checks GPUs only)
    code = ("from rewy_tune.ir_hazards import kernel_functions; "
            "print(sorted(f.__name__ for f in kernel_functions()))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    names = eval(out.stdout.strip().splitlines()[-1])
    for kernel in ("rewy_bwd_kernel_query_side", "rewy_bwd_kernel_consumer_tma", "rewy_bwd_kernel_consumer_vector",
                   "rewy_bwd_scan_kernel"):
        assert kernel in names


# SASS lines as `nvdisasm -c` prints them for sm_90: a product, and the placeholder ptxas leaves for a deleted group
# (session 36: the vector consumer with STATE_ROWSUM_FIRST at K = V = 256, policy R)
_SASS_KEPT = "        /*1a70*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;"
_SASS_DROPPED = "        /*1b30*/                   HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0 ;"


def test_dropped_products_count_the_placeholder_hgmmas():
    from rewy_tune.ir_hazards import dropped_products

    assert dropped_products("\n".join([_SASS_KEPT, _SASS_KEPT])) == 0
    assert dropped_products("\n".join([_SASS_KEPT, _SASS_DROPPED, _SASS_DROPPED])) == 2


def test_compiled_dropped_products_read_each_cubin(monkeypatch):
    # the cubins of the compiled kernels go through nvdisasm (stubbed here: the CPU host may lack Triton's binary)
    from rewy_tune import ir_hazards

    lost, kept, bare = _Compiled("lost", None), _Compiled("kept", None), _Compiled("bare", None)
    lost.asm, kept.asm = {"cubin": b"lost"}, {"cubin": b"kept"}
    monkeypatch.setattr(ir_hazards, "_nvdisasm", lambda cubin: _SASS_DROPPED if cubin == b"lost" else _SASS_KEPT)
    assert ir_hazards.compiled_dropped_products([_Jit(lost, kept), _Jit(bare)]) == [("lost", 1)]
    monkeypatch.setattr(ir_hazards, "_nvdisasm", lambda cubin: None)  # nvdisasm missing: not checked
    assert ir_hazards.compiled_dropped_products([_Jit(lost)]) == []
