"""Pins a Triton 3.6 interpreter behaviour that the bf16 kernel tests depend on (see BF16_ON_INTERPRETER).

The interpreter converts fp32 → bf16 by truncation; GPUs round to nearest. If a Triton upgrade makes this test
fail, the interpreter rounds correctly and the bf16 xfail markers of the kernel tests should be removed.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


def test_interpreter_bf16_conversion_truncates():
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x, y, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(y + o, tl.load(x + o).to(tl.bfloat16))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    y = torch.empty(1024, dtype=torch.bfloat16)
    cast[(1,)](x, y, N=1024)
    nearest = x.to(torch.bfloat16)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(y, nearest)
    assert torch.equal(y, truncated)
