"""benchmarks/journal_check.py refuses a wrong argument count with its usage line."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "journal_check.py"


def test_usage_names_the_journal_and_the_database():
    out = subprocess.run([sys.executable, str(SCRIPT), "only-one-argument"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1
    assert "usage: python benchmarks/journal_check.py JOURNAL DB" in out.stderr and "SQLite database" in out.stderr
