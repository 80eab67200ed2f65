"""A spy on a Triton kernel's launches, for tests that check what a launcher passed (constexprs, grids)."""

from __future__ import annotations


def spy_kernel_launches(monkeypatch, module, name, record):
    """The kernel `module.name` behind a spy: record(args, kw, grid) at each launch, then the real launch (which may
    itself be a spy). Returns the kernel's argument names (to find a positional argument by name; None behind
    another spy)."""
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                record(args, kw, grid)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(module, name, Spy())
    return getattr(real, "arg_names", None)
