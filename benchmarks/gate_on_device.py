"""The tuner's gate (`trial_worker._gate`) on this GPU for one schedule: the validation cases, run-twice bits, then the
checks of the compiled binaries (`rewy_tune/ir_hazards.py`: shared-memory hazards in the TTGIR, products ptxas dropped
from the SASS), printing the status and how many compiled kernels those checks read.

    python benchmarks/gate_on_device.py --op deltanet --policy A [--schedule FILE] [--set dv_local_source=scan]

Session 36 added the dropped-products check; this shows it reads the device's binaries (nvdisasm found) rather than
passing by default. --rowsum-first gates the vector consumer with vector_local.STATE_ROWSUM_FIRST on (K = V = 256
under policy R: a schedule whose binary lost products, which the gate must reject).
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", default="deltanet")
    ap.add_argument("--policy", default="A")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--schedule", help="Schedule JSON file (default: the operator's built-in default)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--rowsum-first", action="store_true")
    args = ap.parse_args()

    import torch

    from rewy_tune import ir_hazards, trial_worker
    from rewy_tune.kernels.triton import vector_local
    from rewy_tune.schedule import Schedule
    from rewy_tune.search_spaces import default_schedule

    K = V = args.head_dim
    if args.schedule:
        with open(args.schedule) as f:
            s = Schedule.from_json(f.read())
    else:
        s = default_schedule(torch.cuda.get_device_capability(), K=K, V=V, op=args.op, policy=args.policy)
    for item in args.set:
        name, value = item.split("=", 1)
        s = s.replace(**{name: json.loads(value) if value[:1] in "0123456789[{" else value})
    vector_local.STATE_ROWSUM_FIRST = args.rowsum_first
    msg = {"op": args.op, "policy": args.policy, "K": K, "V": V, "device": "h200", "backend": "triton",
           "schedule": s.to_dict(), "seed": 0}
    out = trial_worker._gate(msg)
    compiled = list(ir_hazards.compiled_kernels(ir_hazards.kernel_functions()))
    readable = sum(1 for k in compiled if ir_hazards._nvdisasm(getattr(k, "asm", {}).get("cubin", b"")) is not None)
    print(f"{args.op} {args.policy} K=V={K} rowsum_first={args.rowsum_first}: status {out['status']} "
          f"{out.get('message', '')!r}; {len(compiled)} kernels compiled, {readable} disassembled")


if __name__ == "__main__":
    main()
