"""Split the compilation of autotuned kernels (fla-core's) over several processes.

On first use Triton's autotuner compiles every configuration of a kernel, one after another, then times them.
For fla-core's KDA/GDN2 forward and backward that is minutes of single-core compiling in one process: on a
fresh H200 host a campaign's warm-up took about 7 minutes, most of it there (benchmarks/RESULTS.md, session 6).
Inside `config_part(i, n)` every autotuner of this process keeps only its configurations i, i + n, i + 2n, ...:
n processes running the same calls compile disjoint shares into Triton's on-disk cache at the same time. The
process that measures then autotunes over the full lists as usual, finds every binary compiled, and only times
them; its choice is FLA's own, made on an otherwise idle GPU (`fla_baseline.autotune_here` keeps it from reading
picks that other processes timed on a shared GPU). The shares' own picks are kept apart: Triton keys its on-disk
autotuning results by the configuration list, and the in-memory picks are restored on exit.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

# fla-core's package per operator: importing it defines (and so registers) its autotuned kernels
FLA_PACKAGES = {"deltanet": "fla.ops.delta_rule", "gdn": "fla.ops.gated_delta_rule", "kda": "fla.ops.kda",
                "gdn2": "fla.ops.gdn2"}


def autotuners() -> list:
    """Every Triton autotuner alive in this process (one per autotuned kernel of the imported modules)."""
    from triton.runtime.autotuner import Autotuner

    # type(o), not isinstance: isinstance falls back to o.__class__, and some live objects warn when that is read
    # (torch's deprecated `torch.distributed.reduce_op`: one FutureWarning per call, a dozen in every bench log)
    return [o for o in gc.get_objects() if issubclass(type(o), Autotuner)]


def picks(module_prefix: str = "fla.") -> dict[str, dict[str, str]]:
    """The configuration each autotuner of the modules under `module_prefix` (fla-core's) has picked so far, per
    autotuning key: {"module.kernel": {str(key): str(config)}}. fla-core picks per process, so the same shape can run
    other configurations in another process: session 18 saw FLA's DeltaNet backward 10-22 % slower in one bench
    process than in another at B·H = 4 (benchmarks/RESULTS.md). A bench records them to tell such runs apart."""
    out: dict[str, dict[str, str]] = {}
    for tuner in autotuners():
        fn = getattr(tuner.fn, "fn", tuner.fn)  # the Python function under the JIT wrapper
        module = getattr(fn, "__module__", "") or ""
        if not module.startswith(module_prefix) or not tuner.cache:
            continue
        name = f"{module}.{getattr(fn, '__name__', '?')}"
        out.setdefault(name, {}).update({str(key): str(config) for key, config in tuner.cache.items()})
    return dict(sorted(out.items()))


@contextlib.contextmanager
def config_part(part: int, parts: int) -> Iterator[int]:
    """Within the block each autotuner keeps its configurations part, part + parts, ... (a kernel with fewer than
    `parts` configurations keeps one, `part` modulo its count), and its first configuration. Yields the number of
    autotuners restricted."""
    if not isinstance(parts, int) or parts < 1 or not isinstance(part, int) or not 0 <= part < parts:
        raise ValueError(f"config_part: part must be in [0, parts) with parts >= 1, got part={part!r}, "
                         f"parts={parts!r}")
    saved = []
    for tuner in autotuners():
        configs = list(tuner.configs)
        if not configs:
            continue
        saved.append((tuner, tuner.configs, dict(tuner.cache)))
        # Every share also keeps the list's first configuration (fla-core lists grow from the smallest tiles): a share
        # whose own configurations all exceed shared memory (fp32 on the H200, session 9) would otherwise fail the
        # launch and stop that process before the kernels after it.
        share = configs[part::parts] or [configs[part % len(configs)]]
        tuner.configs = share if configs[0] in share else [configs[0], *share]
    try:
        yield len(saved)
    finally:
        for tuner, configs, cache in saved:
            tuner.configs = configs
            tuner.cache.clear()
            tuner.cache.update(cache)
