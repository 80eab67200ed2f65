"""benchmarks/device_check.sh on the CPU: a misspelt step is refused before the install (device time) starts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.sh"


def _run(tmp_path, **env):
    # an empty folder: no .whl/ to install, so a script that got past the check would exit 3 at the install
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path / "out"), **env})


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("env, bad", [
    ({"STEPS": "bench bogus"}, "bogus"),
    ({"STEPS": "none", "BG_STEPS": "sweeps"}, "sweeps"),
    ({"STEPS": "step_tests"}, "step_tests"),
])
def test_an_unknown_step_is_refused_before_the_install(tmp_path, env, bad):
    proc = _run(tmp_path, **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip().startswith(f"STEPS/BG_STEPS: unknown step '{bad}'; accepted: none tests bench")
    assert "models" in proc.stdout and not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_known_steps_and_none_pass_the_check(tmp_path):
    # past the check the install of the (absent) carried wheels fails: exit 3, the script's own code for it
    for steps in ("none", "tests bench", "sweep script"):
        proc = _run(tmp_path, STEPS=steps)
        assert proc.returncode == 3, (steps, proc.stdout + proc.stderr)
        assert "unknown step" not in proc.stdout
