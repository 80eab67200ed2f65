"""measure_shape(extras=False), the tuner's measurement: backward graphs only (CPU, the CUDA parts stubbed)."""

from __future__ import annotations

import math

import pytest

from rewy_tune import fla_baseline, measure, trial_worker


class StubSide:
    made: list["StubSide"] = []

    def __init__(self, op, fn, inputs):
        self.calls = []
        StubSide.made.append(self)

    def capture(self, fwd_bwd=True):
        self.calls.append(("capture", fwd_bwd))
        self.bwd_graph = object()
        if fwd_bwd:
            self.fb_graph = object()

    def eager_ms(self):
        self.calls.append("eager")
        return 1.0

    def peak_backward_mib(self):
        self.calls.append("peak")
        return 2.0


def _stubbed(monkeypatch):
    StubSide.made = []
    timed = []
    monkeypatch.setattr(measure, "_Side", StubSide)
    monkeypatch.setattr(measure, "bench_inputs", lambda *a, **kw: {})
    monkeypatch.setattr(measure, "_time_graphs", lambda graphs, rounds: timed.append(len(graphs)) or
                        [[0.5 + i] * rounds for i in range(len(graphs))])
    return timed


def test_extras_off_times_the_backward_graphs_only(monkeypatch):
    timed = _stubbed(monkeypatch)
    r = measure.measure_shape("gdn", "ours", "fla", (1, 64, 1), extras=False)
    ours, fla = StubSide.made
    assert ours.calls == fla.calls == [("capture", False)] and timed == [2]  # one interleaved backward timing
    assert r.ours.backward_ms == [0.5] * 30 and r.fla.backward_ms == [1.5] * 30
    assert r.ours.fwd_bwd_ms == [] and r.ours.eager_ms == [] and math.isnan(r.ours.peak_backward_mib)


def test_extras_on_is_the_full_protocol(monkeypatch):
    timed = _stubbed(monkeypatch)
    r = measure.measure_shape("gdn", "ours", "fla", (1, 64, 1))
    ours, _ = StubSide.made
    assert ours.calls == [("capture", True)] + ["eager"] * 10 + ["peak"] and timed == [2, 2]
    assert r.ours.fwd_bwd_ms == [0.5] * 30 and r.ours.peak_backward_mib == 2.0


def test_the_trial_worker_measures_without_extras(monkeypatch):
    seen = {}

    def fake(op, ours, fla, shape, **kw):
        seen.update(kw)
        side = measure.SideTiming(backward_ms=[1.0] * 30)
        return measure.ShapeResult(shape=shape, K=kw["K"], V=kw["V"], ours=side, fla=side)

    monkeypatch.setattr(measure, "measure_shape", fake)
    monkeypatch.setattr(fla_baseline, "fla_op", lambda op, policy: None)
    from rewy_tune.schedule import Schedule

    msg = dict(kind="measure", op="gdn2", policy="R", K=128, V=128, device="h200", shape=[1, 512, 4],
               schedule=Schedule().to_dict())
    out = trial_worker._measure(msg)
    assert out["status"] == "ok" and seen["extras"] is False and out["data"]["ours_ms"] == [1.0] * 30


def test_fewer_rounds_than_the_protocol_are_refused_before_any_capture(monkeypatch):
    import pytest

    StubSide.made.clear()
    monkeypatch.setattr(measure, "_Side", StubSide)
    with pytest.raises(ValueError, match="rounds: the protocol needs at least 30 observations, got 29"):
        measure.measure_shape("gdn", None, None, (1, 64, 1), rounds=29, device="cpu")
    assert StubSide.made == []  # refused before the inputs were captured
    with pytest.raises(ValueError, match="rounds: the protocol needs at least 30 observations, got 5"):
        measure.time_captured([], rounds=5)


def test_launch_time_us_replays_one_graph_of_the_launches(monkeypatch):
    # CPU, the CUDA parts stubbed: one eager call, `launches` calls captured, the per-launch median of the replays
    calls, graphs = [], []

    class Graph:
        def __init__(self):
            graphs.append(self)

    class Capture:
        def __init__(self, g):
            calls.append("capture")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(measure.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(measure.torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(measure.torch.cuda, "graph", Capture)
    monkeypatch.setattr(measure, "_time_graphs", lambda gs, rounds: [[0.5, 0.2, 0.3][:rounds]])
    us = measure.launch_time_us(lambda: calls.append("launch"), launches=4, graphs=3)
    assert calls == ["launch", "capture"] + ["launch"] * 4 and len(graphs) == 1
    assert math.isclose(us, 0.3 * 1000 / 4)  # the median replay (ms) over 4 launches, in µs


GPU_PROGRAM = """
import warnings
warnings.simplefilter("always")
from rewy_tune import fla_baseline, measure
ours = measure.rewy_op_fn("deltanet", "A", None)
r = measure.measure_shape("deltanet", ours, fla_baseline.fla_op("deltanet", "A"), (1, 256, 2), K=64, V=64)
print("peak", r.ours.peak_backward_mib, r.fla.peak_backward_mib, "eager", len(r.ours.eager_ms))
"""


@pytest.mark.gpu
def test_gpu_eager_and_peak_run_on_the_capture_stream():
    """The eager timings and the peak memory run on the stream the graphs were captured on: torch warned (once per
    process, so a fresh one) that the leaves' AccumulateGrad stream differed from the backward's (sessions 40-43)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-P", "-c", GPU_PROGRAM], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "peak" in proc.stdout and "eager 10" in proc.stdout
    assert "AccumulateGrad" not in proc.stderr, proc.stderr


def test_the_eager_parts_use_no_stream_before_a_capture():
    side = measure._Side.__new__(measure._Side)
    with side._on_capture_stream() as ctx:
        assert ctx is None  # contextlib.nullcontext(): no CUDA stream is touched on a CPU
