"""benchmarks/profile_stages.py's flag variants: the kernels/triton module flags they name exist and differ from their
current values (a typo, or a flag since turned on, would time the default and call it a variant), are set only for
the duration, and the variants' schedules pass the vector or the scalar model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rewy_tune.kernels.triton import scan, vector_local
from rewy_tune.kernels.triton.flags import flag_home, parse_flag
from rewy_tune.search_spaces import constraint as ss_constraint
from rewy_tune.search_spaces import default_schedule, vector
from rewy_tune.search_spaces.scalar import constraint as scalar_constraint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_stages.py"
spec = importlib.util.spec_from_file_location("profile_stages", SCRIPT)
profile_stages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_stages)


def _flag(key):
    """The current value of a variant's flag: vector_local's NAME or kernels/triton's "module.NAME"."""
    return getattr(*flag_home(key))


@pytest.mark.parametrize("name", list(profile_stages.FLAG_VARIANTS))
def test_flag_variants_name_real_flags_and_valid_schedules(name):
    flags, changes = profile_stages.FLAG_VARIANTS[name]
    before = {f: _flag(f) for f in flags}  # AttributeError: a flag the module does not have
    assert all(type(v) is type(before[f]) and v != before[f] for f, v in flags.items()), (flags, before)
    with profile_stages.module_flags(flags):
        assert {f: _flag(f) for f in flags} == flags
    assert {f: _flag(f) for f in flags} == before
    # valid for one operator family at least (a scalar-gate field, such as dv_local_source, for DeltaNet/GDN alone;
    # profile_stages leaves a variant out for an operator whose constraint rejects it)
    dims = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": (9, 0)}
    for policy in ("R", "A"):
        rejected = {op: check(default_schedule((9, 0), op=op, policy=policy).replace(**changes), dims)
                    for op, check in (("kda", vector.constraint), ("deltanet", scalar_constraint))}
        assert [] in rejected.values(), rejected


def test_module_flags_restores_after_an_error():
    before = vector_local.LAST_ROW_LOAD
    with pytest.raises(RuntimeError):
        with profile_stages.module_flags({"LAST_ROW_LOAD": not before}):
            raise RuntimeError("a variant that fails")
    assert vector_local.LAST_ROW_LOAD is before


@pytest.mark.parametrize("key", ["NO_SUCH_FLAG", "scan.NO_SUCH_FLAG", "nomodule.X", "scan."])
def test_a_flag_that_names_nothing_is_refused(key):
    # setattr on a typo would add an attribute no kernel reads, and the default would be timed under the flag's name
    with pytest.raises(ValueError, match="names no existing flag"):
        flag_home(key)
    with pytest.raises(ValueError, match="names no existing flag"):
        with profile_stages.module_flags({key: 1}):
            pass


@pytest.mark.parametrize("item", ["scan.NO_SUCH_FLAG=1", "scan.EARLY_GATE_ROW=big", "scan.EARLY_GATE_ROW",
                                  "EARLY_GATE_ROW=0", "scan.STATE_BLOCK_ROWS=128"])  # (a flag no more: a field)
def test_parse_flag_refuses_what_it_cannot_set(item):
    with pytest.raises(ValueError, match="expected MODULE.NAME=INT"):
        parse_flag(item)


def test_parse_flag_reads_a_module_flag():
    assert parse_flag("scan.EARLY_GATE_ROW=0") == ("scan.EARLY_GATE_ROW", 0)
    assert scan.EARLY_GATE_ROW is True  # parsing sets nothing


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn", "kda", "gdn2"])
def test_every_operator_has_its_variants(op, policy):
    # the sweep forms every operator's variants before it times any (session 33's bf16 vector default left its
    # "state=input" variant out, and dropping that name raised for KDA and GDN2 until session 35); each differs from
    # the default and is a valid Schedule
    from rewy_tune.schedule import Schedule

    base = default_schedule((9, 0), K=128, V=128, op=op, policy=policy)
    variants = profile_stages.variants_for(op, base)
    assert variants["default"] == base and len(variants) > 10
    assert all(isinstance(s, Schedule) and (n == "default" or s != base) for n, s in variants.items())
    if op in ("deltanet", "gdn"):  # session 35's transposed reverse scan and the query-side stage's ranges
        assert {"rscan-vk64", "dq-sep-ranges4"} <= set(variants)
    if base.consumer == "joint_tma" and base.dq_stage == "separate":
        # the defaults with the query-side stage against the full consumer, whose phase 2 cannot run "flat" (DeltaNet
        # R's default before session 46 and GDN R's: the same schedule)
        full = variants["full-consumer"]
        assert (full.dq_stage, full.consumer_loads) == ("consumer", "at_use")
        assert full == base.replace(dq_stage="consumer", consumer_loads="at_use")
        if (op, policy) == ("deltanet", "R"):
            gdn_r = default_schedule((9, 0), K=128, V=128, op="gdn", policy="R")
            assert full.replace(scan_state_rows=64, reverse_scan_small_grid_block_v=0) == gdn_r
    if base.consumer == "joint_tma" and base.dq_stage == "consumer":
        # the full consumer's other ways out of C7512 (session 42): one stage, and the fused order where it is not
        # (each differs from the default: checked for every variant above)
        assert variants["cons-1stage"] == base.replace(consumer_cfg={"num_stages": 1})
        if (op, policy) == ("gdn", "R"):
            assert variants["order-fused"] == base.replace(consumer_order="fused")


# the next GPU call's sweep (benchmarks/RESULTS.md, session 37): SWEEP_VARIANTS of DeltaNet under policy A
SWEEP_37 = ["rows128", "rows128-w8", "qdo-ahead", "rows128-qdo-ahead", "rows128-qdo-ahead-s2",
            "dvl-scan-rows128-qdo-ahead-s2"]


@pytest.mark.parametrize("policy", ["R", "A"])
@pytest.mark.parametrize("op", ["deltanet", "gdn", "kda", "gdn2"])
def test_the_scan_step_forms_are_schedule_variants(op, policy):
    # session 37's forms, once module flags, are Schedule fields: each variant changes the default by the fields it
    # names (128-row state blocks for every operator, Qᵀ dO ahead for DeltaNet alone, whose scan reads it) and passes
    # the operator's constraint, so the sweep keeps it (a shared-memory rejection would drop it)
    # The names are absolute forms, from the 64-row in-step scan; one equal to the default is left out (DeltaNet's
    # default takes 128 rows since session 38, and "split" under A)
    base = default_schedule((9, 0), K=128, V=128, op=op, policy=policy)
    plain = base.replace(scan_state_rows=64, reverse_scan_qdo="in_step")
    variants = profile_stages.variants_for(op, base)
    assert not {n for n in variants if "rows" in n or "qdo" in n} & set(profile_stages.FLAG_VARIANTS)
    dims = {"K": 128, "V": 128, "dtype": "bf16", "compute_capability": (9, 0)}
    want = {"rows64-in-step": plain, "rows128": plain.replace(scan_state_rows=128),
            "rows128-w8": plain.replace(scan_state_rows=128, reverse_scan={"num_warps": 8})}
    if op == "deltanet":
        want.update({"qdo-ahead": plain.replace(reverse_scan_qdo="ahead"),
                     "rows128-qdo-split": plain.replace(scan_state_rows=128, reverse_scan_qdo="split"),
                     "dvl-scan-rows128-qdo-ahead-s2": plain.replace(
                         scan_state_rows=128, reverse_scan_qdo="ahead", dv_local_source="scan",
                         reverse_scan={"num_stages": 2})})
    for name, sched in want.items():
        assert variants.get(name) == (None if sched == base else sched), name
    for name in ("rows128", "rows128-bv16", "rows128-s2", "rows128-w8"):
        if name in variants:
            assert variants[name].scan_state_rows == 128 and variants[name].reverse_scan_qdo == "in_step", name
    ahead = {n: s for n, s in variants.items() if s.reverse_scan_qdo != "in_step" and n != "default"}
    if op != "deltanet":
        assert not ahead and "rows64-in-step" not in variants  # (GDN, KDA, GDN2: their default is that form)
        return
    assert "rows64-in-step" in variants  # session 37's default, against which session 38 timed the forms
    assert all(variants[n].reverse_scan_qdo == "ahead" for n in variants if "qdo-ahead" in n)
    for name in SWEEP_37:
        if name in variants:
            assert ss_constraint(variants[name], dims, op=op) == [], name
