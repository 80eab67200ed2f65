"""Session 22 probe (temporary): which written-out tf32 product breaks the bf16 consumer on sm_90."""
import json, os, sys
import torch
from rewy_tune import measure
from rewy_tune.search_spaces import default_schedule
case = json.loads(sys.argv[1])
shape = tuple(case.get("shape", (1, 512, 4)))
sched = default_schedule((9, 0), K=128, V=128, op="kda", policy="A")
sched = sched.replace(**case.get("set", {}))
sys.path.insert(0, "tests/kernels"); sys.path.insert(0, "tests")
os.environ["REWY_TEST_NO_INTERPRET"] = "1"
import test_triton_vector as tv
x = tv.make_inputs("kda", *shape, 128, 128, dtype=torch.bfloat16, device="cuda", seed=7, gate_div=16.0)
out = tv.run_triton(x, sched, "A")
ref = tv.oracle(x, device="cuda")
errs = {n: float(tv.rel_rms(out[n], ref[n])) for n in ref if out.get(n) is not None and ref[n] is not None}
print("PROBE", json.dumps(case), {k: f"{v:.2e}" for k, v in errs.items()})
