"""rewy-tune: tuned ReWY Triton backward kernels for delta-rule linear attention.

Public surface: the four chunk ops (FLA-compatible), the runtime dispatcher (`lookup`), and the switch
that routes fla-core's chunk ops through ReWY (`enable`, `disable`, `enabled`, `report`).
`REWY_ENABLE=1` in the environment enables the switch when rewy_tune is imported.
"""

import os as _os

from rewy_tune.dispatch import clear_cache, lookup, print_report, report, reset_report
from rewy_tune.fla_patch import disable, enable, enabled, is_enabled
from rewy_tune.ops import chunk_deltanet, chunk_gdn, chunk_gdn2, chunk_kda

__version__ = "0.1.0"

__all__ = ["chunk_deltanet", "chunk_gdn", "chunk_kda", "chunk_gdn2", "lookup", "clear_cache", "enable",
           "disable", "enabled", "is_enabled", "report", "print_report", "reset_report", "__version__"]

if _os.environ.get("REWY_ENABLE", "").strip() == "1":
    from rewy_tune.fla_patch import enable_from_env as _enable_from_env

    _enable_from_env()
