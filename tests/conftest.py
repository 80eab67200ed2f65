"""Test-wide set-up: the Triton interpreter on machines without CUDA, GPU tests skipped there; a loader for the
scripts under benchmarks/ (not a package)."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is first imported: every Triton kernel then runs on the CPU interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With REWY_TEST_REPORT=FILE each test's outcome (and a failure's traceback) is appended as soon as it
    is known: a GPU run cut short by its time limit still says what failed and how long each test took."""
    path = os.environ.get("REWY_TEST_REPORT")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller receives every report too
        return
    if not path or not (report.when == "call" or report.failed):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.nodeid} [{report.when}] {report.duration:.1f}s\n")
        if report.failed:
            f.write(str(report.longrepr)[-2500:] + "\n\n")


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark(name) imports benchmarks/<name>.py as a module."""
    def load(name: str):
        script = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
