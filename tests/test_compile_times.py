"""benchmarks/compile_times.py reads registers and stack frame (spills) off an sm_90 cubin compiled on the CPU."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_times.py"


def _load():
    spec = importlib.util.spec_from_file_location("compile_times", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resource_usage_of_an_sm90_cubin(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not os.access(tool, os.X_OK):
        pytest.skip("this Triton wheel bundles no cuobjdump")

    @triton.jit
    def copy(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y + o, tl.load(x + o) * 2.0)

    c = triton.compile(ASTSource(fn=copy, signature={"x": "*fp32", "y": "*fp32", "N": "constexpr"},
                                 constexprs={"N": 128}), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    usage = _load()._resource_usage(c.asm["cubin"])
    m = re.fullmatch(r"regs +(\d+) stack +(\d+) B", usage)
    assert m, usage
    assert 0 < int(m.group(1)) <= 255 and int(m.group(2)) == 0  # a copy kernel spills nothing
