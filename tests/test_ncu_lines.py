"""benchmarks/ncu_lines.py joins ncu's per-instruction stall samples with the source lines of a CPU compile's SASS."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_lines.py"
spec = importlib.util.spec_from_file_location("ncu_lines", SCRIPT)
ncu_lines = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_lines)

SASS = """\
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/src/kernels/k.py", line 10
        /*0010*/                   LDG.E R2, desc[UR4][R2.64] ;
	//## File "/src/kernels/k.py", line 12
        /*0020*/               @P0 FFMA R4, R2, R3, R4 ;
        /*0030*/                   FFMA R5, R2, R3, R5 ;
"""
HEADER = ('"Kernel Name","k",\n"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_selected","stall_long_sb (Not Issued)"\n')


def _csv(tmp_path, rows):
    path = tmp_path / "src.csv"
    path.write_text(HEADER + "".join(f'"{a}","{s}","{n}","{i}","{lsb}","{sel}","0"\n' for a, s, n, i, lsb, sel in rows))
    return str(path)


def test_samples_and_instructions_per_line_and_part(tmp_path, capsys):
    sass = tmp_path / "k.sass"
    sass.write_text(SASS)
    rows = [("0x7f0000", "LDC R1, c[0x0][0x28]", 10, 1, 5, 5),
            ("0x7f0010", "LDG.E R2, desc[UR4][R2.64]", 50, 1, 45, 5),
            ("0x7f0020", "@P0 FFMA R4, R2, R3, R4", 20, 4, 0, 20),
            ("0x7f0030", "FFMA R5, R2, R3, R5", 20, 4, 0, 20)]
    items = ncu_lines.joined(ncu_lines.read_ncu(_csv(tmp_path, rows)), ncu_lines.read_sass(str(sass)))
    got = {k: (round(s, 1), round(i, 1)) for k, s, i, _ in ncu_lines.table(items, lambda w: w and f"{w[0]}:{w[1]}")}
    assert got == {"k.py:10": (50.0, 10.0), "k.py:12": (40.0, 80.0), None: (10.0, 10.0)}
    top = ncu_lines.table(items, lambda w: w and f"{w[0]}:{w[1]}")[0]
    assert top[0] == "k.py:10" and top[3].startswith("long_sb 90%")
    part = ncu_lines.parse_part("k.py:11-12=products")
    assert part == ("k.py", 11, 12, "products")


def test_a_different_binary_is_refused(tmp_path):
    sass = tmp_path / "k.sass"
    sass.write_text(SASS)
    rows = [("0x7f0000", "LDC R1, c[0x0][0x28]", 1, 1, 0, 1), ("0x7f0010", "FADD R2, R2, R3", 1, 1, 0, 1)]
    with pytest.raises(ValueError, match="not the same binary"):
        ncu_lines.joined(ncu_lines.read_ncu(_csv(tmp_path, rows)), ncu_lines.read_sass(str(sass)))
    with pytest.raises(Exception, match="FILE:FIRST-LAST=NAME"):
        ncu_lines.parse_part("k.py:12")
