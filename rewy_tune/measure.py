"""The measurement protocol (architecture.md), one implementation for `rewy-tune bench`, the tuner and tests.

- Boundary B: the complete backward of the public op (recompute included), `torch.autograd.grad` of the
  op's output, captured in a CUDA graph and replayed. FLA is measured with the same boundary in the same
  process. FB (forward + backward in one graph) and eager (host launch included, synchronous) are
  reported beside it.
- Warm-up until compilation and autotuning are done; then interleaved rounds (ours, FLA, ours, ...),
  at least 30 observations each; per-shape medians; speedup = geometric mean over shapes of
  FLA median / ours median. Every sample is kept.
- Peak backward memory: the allocator's peak during an eager backward, above what was allocated
  when the backward started (saved activations excluded, gradients included), for both sides.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from rewy_tune import gates

# The ReWY paper's six (B, T, H) shapes; K = V = 128, chunk 64, bf16 inputs.
DEFAULT_SHAPES: tuple[tuple[int, int, int], ...] = (
    (1, 512, 4), (1, 2048, 4), (1, 8192, 4), (1, 2048, 16), (2, 2048, 16), (1, 8192, 16),
)
MIN_ROUNDS = 30

# `(q, k, v, g, erase, write, scale, initial_state, output_final_state) -> (o, ht)`
OpFn = Callable[..., tuple]


@dataclass
class SideTiming:
    """Every observation of one side at one shape, in milliseconds."""

    backward_ms: list[float] = field(default_factory=list)
    fwd_bwd_ms: list[float] = field(default_factory=list)
    eager_ms: list[float] = field(default_factory=list)
    peak_backward_mib: float = math.nan

    @property
    def median(self) -> float:
        return statistics.median(self.backward_ms)

    @property
    def spread(self) -> float:
        """Inter-quartile range over the median: the run-to-run noise of this side."""
        if len(self.backward_ms) < 4:
            return math.nan
        q1, _, q3 = statistics.quantiles(self.backward_ms, n=4)
        return (q3 - q1) / self.median


@dataclass
class ShapeResult:
    shape: tuple[int, int, int]
    K: int
    V: int
    ours: SideTiming
    fla: SideTiming

    @property
    def speedup(self) -> float:
        return self.fla.median / self.ours.median

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(speedup=self.speedup, ours_median_ms=self.ours.median, fla_median_ms=self.fla.median,
                 ours_spread=self.ours.spread, fla_spread=self.fla.spread)
        return d


def geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bench_inputs(op: str, shape: tuple[int, int, int], K: int, V: int, device, seed: int = 0):
    """Benchmark inputs: bf16 q, k (L2-normalised), v, do; fp32 gates logsigmoid(N(0,1)) (vector /16)."""
    B, T, H = shape
    case = gates.GateCase(op=op, B=B, T=T, H=H, K=K, V=V, dtype="bf16", initial_state=False,
                          final_grad=False)
    return gates.make_inputs(case, seed, device)


class _Side:
    """One implementation bound to one input set: eager and graph-captured backward (and fwd+bwd)."""

    def __init__(self, op: str, fn: OpFn, inputs: dict[str, torch.Tensor]):
        self.names = gates.arg_names(op)
        self.fn = fn
        self.op = op
        self.leaves = [inputs[n].detach().clone().requires_grad_(True) for n in self.names]
        self.do = inputs["do"]
        self.scale = inputs["q"].shape[-1] ** -0.5

    def _call(self, leaves):
        args = dict(zip(self.names, leaves))
        g = args.get("g")
        erase = args["b"] if self.op == "gdn2" else args["beta"]
        write = args["w"] if self.op == "gdn2" else args["beta"]
        o, _ = self.fn(args["q"], args["k"], args["v"], g, erase, write, self.scale, None, False)
        return o

    def forward(self):
        self.o = self._call(self.leaves)

    def backward(self):
        return torch.autograd.grad(self.o, self.leaves, self.do, retain_graph=True)

    def capture(self, fwd_bwd: bool = True):
        """Warm up (compiles, autotunes), then capture the backward graph and (fwd_bwd) the fwd+bwd graph.

        Everything runs on one side stream: autograd replays each backward op on the stream of its
        forward op, so a forward on the legacy default stream would make the capture depend on it.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self.stream = stream  # the eager backward and the peak memory run here too (`_on_capture_stream`)
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.forward()
                self.backward()
            self.forward()
        stream.synchronize()
        self.bwd_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd_graph, stream=stream):
            self.backward()
        if fwd_bwd:
            self.fb_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.fb_graph, stream=stream):
                o = self._call(self.leaves)
                torch.autograd.grad(o, self.leaves, self.do)
        torch.cuda.synchronize()

    def _on_capture_stream(self):
        """The stream `capture` ran on, as a context (a null one before any capture). The leaves' AccumulateGrad
        nodes belong to it once captured: a backward on another stream made torch warn that their streams differ
        (once per bench process, sessions 40-43)."""
        stream = getattr(self, "stream", None)
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def peak_backward_mib(self) -> float:
        with self._on_capture_stream():
            self.forward()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            grads = self.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            del grads
        return peak / 2**20

    def eager_ms(self) -> float:
        with self._on_capture_stream():
            self.forward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.backward()
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3


class CallSide(_Side):
    """Any differentiable call `fn(leaves) -> output` timed with the same graphs as an op's side: e.g. an FLA
    layer's op call replayed with the keyword arguments the layer passed (benchmarks/model_check.py)."""

    def __init__(self, fn: Callable[[list[torch.Tensor]], torch.Tensor], leaves: list[torch.Tensor],
                 do: torch.Tensor):
        self.fn = fn
        self.leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
        self.do = do

    def _call(self, leaves):
        return self.fn(leaves)


def _check_rounds(rounds: int) -> None:
    if rounds < MIN_ROUNDS:
        raise ValueError(f"rounds: the protocol needs at least {MIN_ROUNDS} observations, got {rounds}")


def time_captured(sides: list[_Side], rounds: int = MIN_ROUNDS, fwd_bwd: bool = True) -> list[SideTiming]:
    """Backward (and with fwd_bwd, forward + backward) samples of sides already captured (`capture()`),
    interleaved."""
    _check_rounds(rounds)
    backward = _time_graphs([s.bwd_graph for s in sides], rounds)
    both = _time_graphs([s.fb_graph for s in sides], rounds) if fwd_bwd else [[] for _ in sides]
    return [SideTiming(backward_ms=b, fwd_bwd_ms=fb) for b, fb in zip(backward, both)]


def run_once(op: str, fn: OpFn, shape: tuple[int, int, int], *, K: int = 128, V: int = 128,
             device="cuda") -> None:
    """One untimed forward and backward on benchmark inputs (compiles and autotunes what the shape needs)."""
    side = _Side(op, fn, bench_inputs(op, shape, K, V, device))
    side.forward()
    side.backward()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _time_graphs(graphs: list[torch.cuda.CUDAGraph], rounds: int) -> list[list[float]]:
    """Interleaved replays: round r times graphs[0], graphs[1], ... each once; one sync at the end."""
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(rounds)] for _ in graphs]
    for r in range(rounds):
        for i, graph in enumerate(graphs):
            start, end = events[i][r]
            start.record()
            graph.replay()
            end.record()
    torch.cuda.synchronize()
    return [[s.elapsed_time(e) for s, e in side] for side in events]


def launch_time_us(fn: Callable[[], object], launches: int = 10, graphs: int = 15) -> float:
    """Median µs per launch of `fn` (a kernel launch or a few): one eager call, then one CUDA graph of `launches` calls
    replayed `graphs` times (the single-kernel benchmarks: benchmarks/scan_bench.py, combine_bench.py)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(launches):
            fn()
    return statistics.median(_time_graphs([g], graphs)[0]) * 1000 / launches


def measure_shape(op: str, ours: OpFn, fla: OpFn | None, shape: tuple[int, int, int], *, K: int = 128,
                  V: int = 128, rounds: int = MIN_ROUNDS, seed: int = 0, device="cuda",
                  extras: bool = True) -> ShapeResult:
    """Measure one shape: ours and FLA on the same inputs, interleaved, every sample kept.

    extras=False measures boundary B only (the backward graphs): no FB graphs, eager timings or peak memory,
    which the tuner does not keep (its trials store the backward samples). They were most of a trial's
    measuring time: each costs host-side passes of the autograd graph on both sides."""
    _check_rounds(rounds)  # before the captures, which are the slow part
    inputs = bench_inputs(op, shape, K, V, device, seed)
    sides = [_Side(op, ours, inputs)] + ([_Side(op, fla, inputs)] if fla is not None else [])
    for side in sides:
        side.capture(fwd_bwd=extras)
    timings = time_captured(sides, rounds, fwd_bwd=extras)
    if extras:
        for side, t in zip(sides, timings):
            t.eager_ms = [side.eager_ms() for _ in range(10)]
            t.peak_backward_mib = side.peak_backward_mib()
    fla_timing = timings[1] if fla is not None else SideTiming(backward_ms=[math.nan])
    return ShapeResult(shape=shape, K=K, V=V, ours=timings[0], fla=fla_timing)


def rewy_op_fn(op: str, policy: str, schedule) -> OpFn:
    """Our public op on the Triton backend with a fixed schedule, in the measurement's calling form."""
    import rewy_tune

    fn = getattr(rewy_tune, f"chunk_{op}")

    def run(q, k, v, g, erase, write, scale, initial_state, output_final_state):
        coeffs = (erase, write) if op == "gdn2" else (erase,)
        gate = () if op == "deltanet" else (g,)
        return fn(q, k, v, *gate, *coeffs, scale=scale, initial_state=initial_state,
                  output_final_state=output_final_state, policy=policy, backend="triton", schedule=schedule)

    return run


def software_versions() -> dict[str, str]:
    import platform

    import triton

    versions = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__}
    try:
        from importlib.metadata import version

        versions["fla-core"] = version("fla-core")
    except Exception:  # noqa: BLE001 - fla-core missing is reported, not fatal
        versions["fla-core"] = "missing"
    if torch.cuda.is_available():
        versions["gpu"] = torch.cuda.get_device_name()
        versions["cuda"] = torch.version.cuda or "?"
        try:
            import subprocess

            versions["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001
            versions["driver"] = "?"
    return versions
