"""benchmarks/scan_bench.py's argument checks (the timing itself needs a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scan_bench.py"


def test_only_that_matches_nothing_is_refused_before_any_gpu_work():
    out = subprocess.run([sys.executable, str(SCRIPT), "--only", "no_such_scan"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "--only 'no_such_scan' matches no configuration's name" in out.stderr, out.stderr[-2000:]
