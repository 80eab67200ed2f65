"""benchmarks/model_check.py's argument handling for --precompile (the model check itself needs FLA's models and
a GPU; `--dry-run` covers its plumbing on a CPU where flash-linear-attention is installed)."""

import pytest


@pytest.fixture(scope="module")
def mc(load_benchmark):
    return load_benchmark("model_check")


def test_precompile_children_get_the_model_options_without_json_or_precompile(mc):
    argv = ["--models", "kda", "--json", "out.json", "--precompile", "8", "--policy", "A", "--precompile=4",
            "--seq-len", "2048"]
    child = mc.child_argv(argv, 3, 8)
    assert child == ["--models", "kda", "--policy", "A", "--seq-len", "2048", "--precompile-part", "3/8"]
    args = mc.parse_args(child)
    assert args.precompile_part == (3, 8) and args.precompile == 0 and args.json is None
    assert args.models == ["kda"] and args.policy == "A" and args.seq_len == 2048


@pytest.mark.parametrize("argv, message", [
    (["--precompile", "1"], "--precompile must be 0 (off) or >= 2 processes, got 1"),
    (["--precompile", "-2"], "--precompile must be 0 (off) or >= 2 processes, got -2"),
    (["--precompile-part", "8/8"], "--precompile-part must be i/N with 0 <= i < N, got '8/8'"),
    (["--precompile-part", "x"], "--precompile-part must be i/N with 0 <= i < N, got 'x'"),
])
def test_bad_precompile_arguments_exit_2(mc, argv, message, capsys):
    # the message itself: argparse's usage line, printed with any error, names every option
    with pytest.raises(SystemExit) as exc:
        mc.parse_args(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {message}")


def test_graph_timing_falls_back_to_eager_and_says_why(mc, monkeypatch):
    # A model whose step cannot be captured is timed eagerly; the result names the method and the reason.
    class Harness:
        cuda = True
        modes_seen = []

        def set_mode(self, mode):
            self.modes_seen.append(mode)

        def step(self, model, ids):
            return (2.0, 5.0, None) if self.modes_seen[-1] == "fla-stock" else (1.0, 4.0, None)

    class Model:
        def zero_grad(self, set_to_none=True):
            pass

    def no_capture(*a, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(mc, "GraphedStep", no_capture)
    args = mc.parse_args(["--rounds", "20", "--warmup", "1"])
    out = mc.time_modes(Model(), None, Harness(), ["fla-stock", "rewy-stock"], args)
    assert out["method"] == "eager" and "not permitted when stream is capturing" in out["graph_fallback"]
    assert len(out["modes"]["rewy-stock"]["backward_ms"]) == 20
    assert out["modes"]["rewy-stock"]["speedup_backward"] == 2.0 and out["modes"]["rewy-stock"]["speedup_step"] == 1.25


@pytest.mark.parametrize("dtype,name,passed", [("fp32", "gradients", False),
                                               ("bf16", "gradients (reported; thresholds apply at --dtype fp32)", True)])
def test_gradient_thresholds_are_checked_at_fp32_and_reported_at_bf16(mc, dtype, name, passed):
    comp = dict(failed=["w"], worst_rel_rms=0.04, worst_param="w", loss_abs_diff=1e-6, loss_rel_diff=1e-7)
    report = dict(routed_calls=4, fallback_calls=0, fallbacks=[], routed=[])
    res = dict(errors={}, mode_layers={"fla-stock": "stock", "rewy-stock": "stock", "oracle": "substituted"},
               modes={"rewy-stock": {"report": report}, "fla-stock": {}, "oracle": {}},
               comparisons={"rewy-stock vs fla-stock": comp, "rewy-stock vs oracle": comp, "fla-stock vs oracle": comp})
    checks = {c["name"]: c for c in mc.verdict_checks(res, mc.parse_args(["--dtype", dtype]))}
    assert checks[name]["passed"] is passed and "worst vs oracle 4%" in checks[name]["detail"]
    assert checks["loss"]["passed"] and "oracle computes the stock layer's call" in checks


@pytest.mark.parametrize("rewy_step,passed", [(15.10, True), (15.60, False)])
def test_step_must_save_at_least_what_the_operator_saves(mc, rewy_step, passed):
    # Issue #6's bar: the operator at the model's shape saves 4 x (0.60 - 0.53) = 0.28 ms a step; the step must too.
    res = dict(errors={}, mode_layers={}, modes={}, comparisons={},
               timing=dict(method="cuda-graph", modes={"fla-stock": dict(median_step_ms=15.82),
                                                       "rewy-stock": dict(median_step_ms=rewy_step)}),
               op_share=dict(layers=4, fla_fwd_bwd_ms=0.60, ours_fwd_bwd_ms=0.53, expected_step_saving_ms=0.28))
    check = {c["name"]: c for c in mc.verdict_checks(res, mc.parse_args([]))}["step faster by the operator's gain"]
    assert check["passed"] is passed
    assert "default arguments) saves +0.280 ms" in check["detail"] and "cuda-graph" in check["detail"]


def test_operator_share_times_fla_stock_against_ours_at_the_model_shape(mc, monkeypatch):
    # The share is measured like `rewy-tune bench` (stubbed here): FLA's stock op (policy R, its default) against
    # ours under --policy with the dispatcher's schedule, forward + backward, times the layer count.
    from rewy_tune import measure, warmup

    seen = {}

    def fake_measure(op, ours, fla, shape, *, K, V, rounds):
        seen.update(op=op, shape=shape, K=K, V=V, rounds=rounds)
        side = lambda fb, b: measure.SideTiming(backward_ms=[b] * 30, fwd_bwd_ms=[fb] * 30)
        return measure.ShapeResult(shape=shape, K=K, V=V, ours=side(0.50, 0.40), fla=side(0.60, 0.55))

    monkeypatch.setattr(measure, "measure_shape", fake_measure)
    monkeypatch.setattr(warmup, "warm", lambda tasks, jobs: seen.update(warm=[(t.policy, t.with_fla) for t in tasks]))
    args = mc.parse_args(["--models", "kda", "--policy", "A", "--seq-len", "256", "--layers", "3", "--precompile", "2"])
    out = mc.operator_share("kda", args)
    assert seen["shape"] == (1, 256, 8) and seen["rounds"] >= 30 and seen["warm"] == [("R", True), ("A", False)]
    assert out["expected_step_saving_ms"] == pytest.approx(3 * (0.60 - 0.50))
    assert out["fla_backward_ms"] == 0.55 and out["ours_backward_ms"] == 0.40


@pytest.mark.parametrize("argv,message", [
    (["--set", "side_stream=sideways"],
     "--set: Schedule.side_stream must be one of ('none', 'dv_local', 'reverse_scan')"),
    (["--set", "nonsense"], "--set: 'nonsense' is not FIELD=VALUE"),
    (["--set", "consumer_cfg.colour=3"], "--set: 'consumer_cfg.colour' is not a stage member"),
])
def test_bad_schedule_overrides_exit_2(mc, argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        mc.parse_args(argv)
    assert exc.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err.strip().splitlines()[-1]


def test_schedule_overrides_reach_the_routed_lookup_and_are_undone(mc):
    # --set side_stream=none: while the check runs, dispatch.lookup (enable()'s routing, the operator-alone timing)
    # returns the schedule with the change and says so; afterwards the original lookup is back.
    from rewy_tune import dispatch
    from rewy_tune.problem import Problem

    args = mc.parse_args(["--models", "kda", "--set", "side_stream=none", "--set", "reverse_scan.num_warps=8"])
    assert args.overrides == {"side_stream": "none", "reverse_scan.num_warps": 8}
    problem = Problem("kda", "R", "bf16", 1, 4096, 8, 128, 128)
    original = dispatch.lookup
    base, _ = dispatch.lookup(problem)
    assert base.side_stream != "none" or base.reverse_scan.num_warps != 8  # the change is visible
    with mc.overridden_lookup(args.overrides):
        changed, reason = dispatch.lookup(problem)
        assert changed.side_stream == "none" and changed.reverse_scan.num_warps == 8
        assert reason.endswith("--set side_stream=none reverse_scan.num_warps=8")
    assert dispatch.lookup is original and dispatch.lookup(problem)[0] == base
    assert mc.parse_args(["--models", "kda"]).overrides == {}


def test_layout_options_switch_the_state_layout_for_the_check_only(mc):
    from rewy_tune.kernels import triton_function

    assert triton_function.V_FIRST_VECTOR  # the default since session 20
    with mc.layout_switch(mc.parse_args(["--k-first-vector"])):
        assert not triton_function.V_FIRST_VECTOR
    assert triton_function.V_FIRST_VECTOR
    with mc.layout_switch(mc.parse_args([])):
        assert triton_function.V_FIRST_VECTOR
    assert triton_function.V_FIRST_SAVED_STATES  # the default since session 21
    with mc.layout_switch(mc.parse_args(["--k-first-saved"])):
        assert not triton_function.V_FIRST_SAVED_STATES and triton_function.V_FIRST_VECTOR
    assert triton_function.V_FIRST_SAVED_STATES
    with mc.layout_switch(mc.parse_args([])):
        assert triton_function.V_FIRST_SAVED_STATES


@pytest.fixture()
def layer_module(mc, monkeypatch):
    # A stand-in for FLA's layer module: its op name is what the layer calls and what enable() rebinds.
    import sys
    import types

    import torch

    module = types.ModuleType("fake_fla_layer")

    def chunk_op(q, k, v, g=None, beta=None, scale=None, use_gate_in_kernel=False, A_log=None, **kwargs):
        o = q * k.sum() + v * beta.sum() + (A_log.sum() if A_log is not None else 0)
        return o, None

    module.chunk_op = chunk_op
    monkeypatch.setitem(sys.modules, "fake_fla_layer", module)
    monkeypatch.setitem(mc.LAYER_BINDINGS, "kda", ("fake_fla_layer", "chunk_op", "fake_fla_op"))
    return module


def test_first_call_records_the_layer_call_and_replays_it_through_the_bound_name(mc, layer_module):
    import torch

    q, k, v, beta = (torch.randn(2, 3, requires_grad=True) for _ in range(4))
    A_log = torch.randn(2, requires_grad=True)
    with mc.FirstCall("kda") as rec:
        layer_module.chunk_op(q * 1, k, v, beta=beta, scale=0.5, use_gate_in_kernel=True, A_log=A_log,
                              state_v_first=True)
        layer_module.chunk_op(q * 2, k, v, beta=beta)  # only the first call is kept
    assert layer_module.chunk_op is rec.original  # restored
    assert rec.grad_names == ["q", "k", "v", "beta", "A_log"]
    assert rec.arguments["use_gate_in_kernel"] is True and rec.arguments["kwargs"] == {"state_v_first": True}
    assert torch.equal(rec.arguments["q"], q.detach()) and not rec.arguments["q"].requires_grad
    seen = {}

    def rebound(*args, **kwargs):  # what enable() would have bound: it must get the layer's own arguments
        seen.update(kwargs, n_args=len(args))
        return rec.original(*args, **kwargs)

    layer_module.chunk_op = rebound
    leaves = [torch.ones(2, 3), torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)]
    o = rec.call(leaves)
    assert torch.equal(o, torch.full((2, 3), 6.0))  # q * k.sum() with the leaves, not the recorded tensors
    assert seen["use_gate_in_kernel"] is True and seen["state_v_first"] is True and seen["scale"] == 0.5


def test_operator_as_called_times_fla_against_the_routed_call_and_scales_by_layers(mc, layer_module, monkeypatch):
    # FLA's side is captured with ReWY off and ours with enable() on (the harness's modes), on the same recorded
    # call; the expected step saving is the layer count times the forward + backward difference.
    import torch

    from rewy_tune import measure

    class Harness:
        mode = None
        modes_seen = []

        def set_mode(self, mode):
            self.mode = mode
            self.modes_seen.append(mode)

    harness = Harness()

    class Model:
        def __call__(self, **kw):
            x = torch.randn(2, 3, requires_grad=True)
            layer_module.chunk_op(x, x, x, beta=x, use_gate_in_kernel=True)

    captured = []
    monkeypatch.setattr(measure.CallSide, "capture", lambda side: captured.append(
        (harness.mode, tuple(side._call(side.leaves).shape))))
    timings = {0: (0.90, 0.68), 1: (0.80, 0.55)}  # (fwd+bwd, backward) of FLA, ours
    monkeypatch.setattr(measure, "time_captured", lambda sides, rounds: [
        measure.SideTiming(backward_ms=[timings[i][1]] * rounds, fwd_bwd_ms=[timings[i][0]] * rounds)
        for i, _ in enumerate(sides)])
    args = mc.parse_args(["--models", "kda", "--policy", "A", "--layers", "4"])
    out = mc.operator_as_called("kda", Model(), None, harness, args)
    assert captured == [("fla-stock", (2, 3)), ("rewy-stock", (2, 3))]
    assert harness.mode is None and harness.modes_seen[0] == "fla-stock"
    assert out["expected_step_saving_ms"] == pytest.approx(4 * (0.90 - 0.80))
    assert out["fla_backward_ms"] == 0.68 and out["ours_backward_ms"] == 0.55
    assert out["flags"]["use_gate_in_kernel"] is True and out["grad_inputs"] == ["q", "k", "v", "beta"]


def test_the_step_bar_uses_the_operator_as_called_and_prints_the_bare_op_too(mc):
    res = dict(errors={}, mode_layers={}, modes={}, comparisons={},
               timing=dict(method="cuda-graph", modes={"fla-stock": dict(median_step_ms=15.80),
                                                       "rewy-stock": dict(median_step_ms=15.35)}),
               op_share=dict(layers=4, fla_fwd_bwd_ms=0.89, ours_fwd_bwd_ms=0.77, expected_step_saving_ms=0.48),
               op_as_called=dict(layers=4, fla_fwd_bwd_ms=0.88, ours_fwd_bwd_ms=0.77, expected_step_saving_ms=0.44))
    check = {c["name"]: c for c in mc.verdict_checks(res, mc.parse_args([]))}["step faster by the operator's gain"]
    assert check["passed"] is True  # 0.45 >= 0.44 (as called), though < 0.48 (bare op)
    assert "as the layers call it" in check["detail"] and "default arguments: +0.480 ms" in check["detail"]
    res["op_as_called"]["expected_step_saving_ms"] = 0.46
    check = {c["name"]: c for c in mc.verdict_checks(res, mc.parse_args([]))}["step faster by the operator's gain"]
    assert check["passed"] is False
