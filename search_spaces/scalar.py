"""Search space of the ReWY backward for the scalar-gate operators: DeltaNet (no gate) and GDN (scalar gate).

Declarative: `space(K, V)` maps every flat parameter name ("consumer", "consumer_cfg.block_k", ...) to its
choices; `CONDITIONS` says which parameters only matter under another choice (the tuner samples them only
then); `schedule_from_params` builds the Schedule. `constraint(schedule, problem_dims)` lists the reasons a
combination cannot compile or run well enough to be worth a trial (shared memory, registers, tiles), and
`default_schedule(compute_capability)` is the built-in schedule per device family.

Members a stage does not read (see `rewy_tune/schedule.py`) are pinned to one value here, so no trial is
spent on a decorative change: producer.block_k, cumsum.block_k/block_v/num_stages, `intra` (read only by
vector-gate operators), `scan_state_rows` where K ≤ 64 (one state block either way) and, for GDN, `reverse_scan_qdo`
(read by DeltaNet's reverse scan alone: `space(op="gdn")`).
"""

from __future__ import annotations

from typing import Any, Mapping

from rewy_tune.schedule import (CONSUMER_RANGES, QUERY_SIDE_BLOCK_VS, REVERSE_SCAN_QDO, SCAN_STATE_ROWS,
                                SMALL_GRID_BLOCK_VS, SPLIT_WAVES, STAGES, Schedule, StageConfig)

# Per-block shared-memory limit (bytes) by compute capability (CUDA occupancy tables; H100/H200 = 227 KiB).
SMEM_LIMIT = {(8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
              (10, 0): 232448, (12, 0): 101376}
DEFAULT_SMEM_LIMIT = 101376
# Rough register bound: live fp32 accumulator values per thread above this spill (255 registers/thread, the
# rest holds addresses, masks and operands).
MAX_ACC_PER_THREAD = 192
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

TILES = [16, 32, 64, 128]
WARPS = [2, 4, 8]
STAGES_CHOICES = [1, 2, 3]
# The scans' serial chunk loop is latency-bound: deeper prefetch of the next chunks' tiles is the lever FLA's own
# autotuner pulls on the H200 (its picks at (2, 2048, 16): forward BV 32 with 4 stages, reverse BV 32 with 3).
SCAN_STAGES_CHOICES = [1, 2, 3, 4]
SEGMENTS = [1, 2, 4, 8]

# Fields read by the joint_tma consumer only (scalar gates); the vector space drops them.
TMA_ONLY_FIELDS = ("consumer_order", "column_side", "p_tiles", "dq_stage", "consumer_loads", "query_side_block_v")
# A parameter listed here is sampled only when its condition holds (otherwise it keeps its default).
CONDITIONS: dict[str, tuple[str, str]] = {
    **{name: ("consumer", "joint_tma") for name in TMA_ONLY_FIELDS},
    # the scalar pointer consumers do not read it (the vector consumers do: vector.py drops this condition)
    "consumer_k_split": ("consumer", "joint_tma"),
    "consumer_ranges": ("consumer", "joint_tma"),  # the vector joint consumer reads it too (vector.py)
    **{f"dv_local.{m}": ("dv_local_source", "recompute") for m in ("block_k", "block_v", "num_warps", "num_stages")},
    "pd_dtype": ("consumer", "separate"),
    "producer.block_v": ("consumer", "separate"),
    "producer.num_warps": ("consumer", "separate"),
    "producer.num_stages": ("consumer", "separate"),
    "reverse_scan_qdo": ("reverse_scan_layout", "kv"),  # the transposed scan forms Qᵀ dO in its step
    "query_side_block_v": ("dq_stage", "separate"),  # (dq_stage is sampled only for joint_tma: both hold)
}
# Operators whose reverse scan reads Schedule.reverse_scan_qdo (no gate): a gate scales dO's rows first (scan.py)
QDO_AHEAD_OPS = ("deltanet",)


def tma_rows_fit(K: int, V: int) -> bool:
    """Whether joint_tma's TMA rows (K and V elements of 16-bit or fp32 data) are 16-byte multiples: the rule the
    constraint enforces and the cc-9.0 default follows."""
    return K % 8 == 0 and V % 8 == 0


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiles_for(dim: int) -> list[int]:
    """Tiles that divide dim (or cover it once) and are not larger than dim rounded up to a power of two."""
    cap = max(16, _pow2_ceil(dim))
    return [t for t in TILES + [256] if t <= cap and (dim % t == 0 or t == cap)]


def space(K: int = 128, V: int = 128, policy: str | None = None, op: str | None = None) -> dict[str, list[Any]]:
    """Flat parameter name -> choices, for head dims K, V. No choice here depends on the policy (checked only); op
    ("deltanet", "gdn"; None: either) pins reverse_scan_qdo for GDN, whose gated scan does not read it."""
    check_default_policy(policy)
    check_scalar_op(op)
    tk, tv = _tiles_for(K), _tiles_for(V)
    scan_k = [max(16, _pow2_ceil(K))]  # the scans hold all K rows of the state tile
    out: dict[str, list[Any]] = {
        # first: the dv_local stage's fields are sampled only where it runs (CONDITIONS). "scan": the reverse scan
        # forms dv_local (session 36, DeltaNet A: slower alone, 1.238 -> 1.269x FLA with 4 consumer ranges at
        # (1, 8192, 16))
        "dv_local_source": ["recompute", "scan"],
        "chunk_size": [64],  # FLA's forward saves A at chunk 64
        "consumer": ["joint", "separate", "joint_tma"],
        "consumer_order": ["fused", "dq_first"],
        "column_side": ["scratch", "gamma_t"],
        "p_tiles": ["recompute", "stored"],
        "side_stream": ["none", "dv_local", "reverse_scan"],
        "dq_stage": ["consumer", "separate"],
        "consumer_loads": ["at_use", "ahead", "flat"],
        "consumer_ranges": list(CONSUMER_RANGES),
        # no more programs per chunk than K tiles of the narrowest consumer tile (16): the consumers lower a wider one;
        # 0 ("auto") picks 1 or 2 from the grid at launch (the H200 defaults)
        "consumer_k_split": [0] + [s for s in (1, 2, 4) if s <= -(-K // 16)],
        "pd_dtype": ["fp32", "input"],
        "state_dtype": ["fp32", "input"],
        "intra": ["auto"],
        "forward_scan_segments": SEGMENTS,
        "reverse_scan_segments": SEGMENTS,
        "scan_split_waves": list(SPLIT_WAVES),
        # the reverse scan's state as dS or dSᵀ (session 35: the transposed kernel's products read it from registers;
        # not yet timed on a GPU, so the tuner decides)
        "reverse_scan_layout": ["kv", "vk"],
        # after the layout, which it is conditional on (CONDITIONS). DeltaNet's Qᵀ dO formed a step ahead, and both
        # scans' state in 128-row blocks, which change code only where K > 64 (session 37, untimed on a GPU)
        "reverse_scan_qdo": list(REVERSE_SCAN_QDO) if op in (None, *QDO_AHEAD_OPS) else ["in_step"],
        "scan_state_rows": list(SCAN_STATE_ROWS) if K > 64 else [64],
        # a narrower reverse-scan value tile where it runs whole on a small grid (0: off; session 39). The constraint
        # rejects a width not below reverse_scan.block_v
        "reverse_scan_small_grid_block_v": [w for w in SMALL_GRID_BLOCK_VS if not w or (w < V and V % w == 0)],
        # the query-side stage's value tile (0: the consumer's; session 44). After dq_stage, its condition; the
        # constraint rejects the consumer's own width
        "query_side_block_v": [0] + [w for w in tv if w in QUERY_SIDE_BLOCK_VS],
    }
    stage_tiles = {
        "recompute": (tk, tv), "forward_scan": (scan_k, [t for t in tv if t <= 128]), "dv_local": (tk, tv),
        "reverse_scan": (scan_k, [t for t in tv if t <= 128]), "producer": ([64], tv), "consumer_cfg": (tk, tv),
    }
    for stage, (bk, bv) in stage_tiles.items():
        out[f"{stage}.block_k"] = bk
        out[f"{stage}.block_v"] = bv
        out[f"{stage}.num_warps"] = WARPS
        out[f"{stage}.num_stages"] = SCAN_STAGES_CHOICES if stage.endswith("_scan") else STAGES_CHOICES
    out["cumsum.block_k"] = [64]
    out["cumsum.block_v"] = [64]
    out["cumsum.num_warps"] = [1, 2, 4]
    out["cumsum.num_stages"] = [1]
    return out


def schedule_from_params(params: Mapping[str, Any], base: Schedule | None = None) -> Schedule:
    """Build a Schedule from flat parameters (missing ones keep `base`'s values, default Schedule())."""
    base = base or Schedule()
    top: dict[str, Any] = {}
    stages: dict[str, dict[str, Any]] = {}
    for name, val in params.items():
        if "." in name:
            stage, member = name.split(".", 1)
            if stage not in STAGES:
                raise ValueError(f"unknown stage {stage!r} in parameter {name!r}")
            stages.setdefault(stage, {})[member] = val
        else:
            top[name] = val
    return base.replace(**top, **stages)


def _dims(problem_dims: Any) -> tuple[int, int, int, int]:
    """(K, V, dtype bytes, shared-memory limit) from a mapping or an object with K, V (dtype, compute_capability
    or smem_limit optional)."""
    get = (lambda n, d=None: problem_dims.get(n, d)) if isinstance(problem_dims, Mapping) else \
        (lambda n, d=None: getattr(problem_dims, n, d))
    K, V = int(get("K")), int(get("V"))
    dtype = get("dtype", "bf16")
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(str(dtype).replace("torch.", ""),
                                                                           str(dtype).replace("torch.", ""))
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"problem dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    smem = get("smem_limit")
    if smem is None:
        cc = get("compute_capability", (9, 0))
        smem = SMEM_LIMIT.get(tuple(cc), DEFAULT_SMEM_LIMIT)
    return K, V, DTYPE_BYTES[dtype], int(smem)


def shared_memory_estimate(schedule: Schedule, K: int, V: int, e: int) -> dict[str, int]:
    """Rough shared-memory bytes per stage: the tl.dot operands of the largest phase, times the pipeline depth
    for tiles loaded inside a loop (Triton stages those), plus tiles that stay resident across the loop."""
    C = schedule.chunk_size
    s4 = 4 if schedule.state_dtype == "fp32" else e
    pd = 4 if schedule.pd_dtype == "fp32" else e
    est: dict[str, int] = {}
    rc = schedule.recompute
    est["recompute"] = C * C * e + (C * rc.block_k + C * rc.block_v) * e * rc.num_stages
    for name, n_k in (("forward_scan", 2), ("reverse_scan", 3)):
        cfg = getattr(schedule, name)
        bk = max(cfg.block_k, K)
        # per chunk: the [C, BK] dot operands (forward W, K_t; reverse q, k, W), the [C, BV] ones, and the
        # state tile as a dot operand (input dtype)
        est[name] = (n_k * C * bk + 2 * C * cfg.block_v) * e * cfg.num_stages + bk * cfg.block_v * e
    rs = schedule.reverse_scan
    if schedule.dv_local_source == "scan":  # its q, k tiles again and A_qkᵀ: sm_90, K = 128, BV 32, 3 stages
        est["reverse_scan"] += 2 * C * max(rs.block_k, K) * e + C * C * e  # 176 128 -> 217 088 B
    if schedule.reverse_scan_qdo != "in_step" and schedule.reverse_scan_layout == "kv":  # ("split": where it splits)
        # the next chunk's q tile and a third dO tile, at any depth (DeltaNet A's sm_90 compiles, K = 128, session 37:
        # BV 32 at 3 stages 176 128 -> 200 704 B, BV 16 161 792 -> 182 272; both forms at 2 stages 143 360 B; with
        # dv_local_source "scan" 241 664 B at 3 stages, over the H200's limit, and 172 032 at 2, which the two terms
        # bound). Where the operator has a gate its scan forms Qᵀ dO in its step: an upper bound there.
        est["reverse_scan"] += C * max(rs.block_k, K) * e + 2 * C * rs.block_v * e
    dl = schedule.dv_local
    est["dv_local"] = max(2 * C * dl.block_k * e * dl.num_stages, C * C * e + C * dl.block_v * e * dl.num_stages)
    pr = schedule.producer
    if schedule.consumer == "separate":
        est["producer"] = C * C * e + (2 * C * pr.block_v * e) * pr.num_stages + C * pr.block_v * e
    cc = schedule.consumer_cfg
    joint = schedule.consumer in ("joint", "joint_tma")
    v_loop = (4 * C * cc.block_v * e + 2 * cc.block_v * cc.block_k * s4) * cc.num_stages
    if not joint:
        v_loop += C * cc.block_v * pd * cc.num_stages
    resident = (C * C * e if joint else 0)
    k_phase = 2 * C * C * e + 4 * C * cc.block_k * e + C * cc.block_k * 4
    est["consumer_cfg"] = resident + max(v_loop + C * cc.block_v * e, k_phase)
    if schedule.consumer == "joint_tma" and schedule.column_side == "gamma_t" and schedule.consumer_order == "fused":
        # Γ_qᵀ, Γ_rᵀ as loaded operands next to the fused phase 2 (sm_90, hints, fp32 inputs: 245 816 B against
        # 213 048 B with the scratch; "dq_first" stays at 213 032 B)
        est["consumer_cfg"] += 2 * C * C * e
    return est


# Value tile of the scans' segment-combine kernel (kernels/triton/scan.py COMBINE_BV; fixed, not a schedule knob).
COMBINE_BV = 16


def combine_shared_memory(K: int) -> int:
    """Shared-memory bytes of the segment-combine kernel that every num_segments > 1 launches, at the fewest stages
    its launcher takes (more only where they fit the device): the carry kernel at one stage, fp32 [KB, KB] block
    of the transfer matrix plus NB + 1 [KB, 16] tiles (the state blocks and the bias), KB = min(64, K rounded up to a
    power of two), NB = ceil(K / KB) (kernels/triton/scan.py combine_carry_shared_memory; sm_90 K = 128: 28 672 B).
    Before the combine kernel was tiled it held the whole K×K matrix, 245 760 B at K = 128 on the H200."""
    KB = min(64, max(16, _pow2_ceil(K)))
    NB = -(-K // KB)
    return (KB * KB + (NB + 1) * KB * COMBINE_BV) * 4


def register_estimate(schedule: Schedule, K: int, V: int) -> dict[str, float]:
    """Live fp32 accumulator values per thread (rough)."""
    C = schedule.chunk_size
    out: dict[str, float] = {}
    cc = schedule.consumer_cfg
    # "dq_first" (joint_tma only) keeps two of the three [C, BK] accumulators live at once
    live = 2 * C * C + (2 if schedule.consumer == "joint_tma" and schedule.consumer_order == "dq_first" else 3) * \
        C * cc.block_k
    if schedule.consumer != "joint_tma":
        # pointer loads pass their [C, BV] tiles through registers; descriptor (TMA) loads land in shared memory,
        # which the MMA reads in place. This is a pruning rule, not a compile limit: joint_tma at 4 warps (~160 by
        # this count; sm_90 stack 472 B for DeltaNet, 744 B for GDN, with alignment hints) ran DeltaNet
        # (2, 2048, 16) 4 % faster than the 8-warp default on the H200 and GDN 10 % slower (session 12), so the
        # tuner must be able to try it.
        live += 2 * C * cc.block_v
    out["consumer_cfg"] = live / (32 * cc.num_warps)
    for name in ("forward_scan", "reverse_scan"):
        # the fp32 state and the [C, BV] correction, in blocks of any rows (scan_state_rows 128 holds the same values:
        # sm_90, DeltaNet A's reverse scan at BV 32, 4 warps, 104 -> 128 registers, no spills)
        cfg = getattr(schedule, name)
        out[name] = (max(cfg.block_k, K) * cfg.block_v + C * cfg.block_v) / (32 * cfg.num_warps)
    dl = schedule.dv_local
    out["dv_local"] = (C * C + C * dl.block_v) / (32 * dl.num_warps)
    pr = schedule.producer
    out["producer"] = (C * C + C * pr.block_v) / (32 * pr.num_warps)
    rc = schedule.recompute
    out["recompute"] = (C * max(rc.block_k, rc.block_v)) / (32 * rc.num_warps)
    return out


def constraint(schedule: Schedule, problem_dims: Any, op: str | None = None) -> list[str]:
    """Reasons this schedule cannot compile or run for the problem (empty list: worth a trial).

    problem_dims: a mapping or object with K, V and optionally dtype ("bf16" | "fp16" | "fp32"),
    compute_capability (tuple) or smem_limit (bytes; default 232448 = H100/H200) and op. op ("deltanet", "gdn"; default
    problem_dims' op; None: either): the fields one operator does not read are rejected for it (GDN:
    reverse_scan_qdo "ahead")."""
    K, V, e, smem_limit = _dims(problem_dims)
    reasons = tile_reasons(schedule, K, V)
    reasons += resource_reasons(shared_memory_estimate(schedule, K, V, e), register_estimate(schedule, K, V),
                                smem_limit)
    reasons += segment_reasons(schedule, K, smem_limit)
    reasons += recompute_fault_reasons(schedule, e, compute_capability_of(problem_dims))
    if schedule.dv_local_source == "scan" and schedule.reverse_scan_layout != "kv":
        reasons.append("dv_local_source 'scan': only the 'kv' reverse scan forms dv_local (reverse_scan_layout "
                       f"{schedule.reverse_scan_layout!r})")
    reasons += qdo_ahead_reasons(schedule, op if op is not None else op_of(problem_dims))
    reasons += flat_loads_reasons(schedule)
    if schedule.consumer == "joint_tma" and not tma_rows_fit(K, V):
        reasons.append(f"consumer 'joint_tma': TMA rows must be 16-byte multiples, so K={K} and V={V} must be "
                       "multiples of 8 (the pipeline would run the pointer kernel instead)")
    return reasons


# A Triton 3.6 miscompile on the H200 (sm_90, 16-bit inputs): the recompute stage with 4 warps and a feature tile
# wider than its value tile returns a right W and a wrong U. Session 5's stage test found block_k = 128 with block_v
# 16 / 32 (relative error 1.1-1.2: tests/kernels/test_triton_shared_stages.py test_gpu_wrong_h200_schedule_stage;
# right on the interpreter); session 6's campaign gated three more wrong schedules with the same signature (dq, dk,
# dg, db wrong; o, ht, dv, dw, dh0 right, which a wrong U gives through R and S0) and recompute tiles 32 x 16,
# 64 x 16 and 64 x 32, all at 4 warps. Over the four H200 campaigns every 4-warp recompute with block_k > block_v
# was wrong and every 4-warp one with block_k <= block_v passed (nine configurations), as did every 2- and 8-warp
# one (block_k up to 8 x block_v). Rejected before compiling for 16-bit inputs on compute capability 9.x, for every
# operator (the stage is shared), together with block_k = 128 at 4 warps whatever block_v (the first finding);
# other GPUs and fp32 inputs compile other paths.
H200_RECOMPUTE_FAULT = ("Triton 3.6 on sm_90 computes a wrong U there (H200 stage tests, sessions 5-6; every wrong "
                        "H200 campaign schedule of sessions 3-6)")


def op_of(problem_dims: Any) -> str | None:
    """The operator problem_dims names ("op"; None where it names none: the tuner's `search.constraint_violation`
    always does)."""
    return problem_dims.get("op") if isinstance(problem_dims, Mapping) else getattr(problem_dims, "op", None)


def qdo_ahead_reasons(schedule: Schedule, op: str | None) -> list[str]:
    """reverse_scan_qdo "ahead" or "split" where no reverse scan reads it: the transposed layout, or (op known) a gated
    operator, whose scan forms Qᵀ dO in its step whatever the field says (a trial would time "in_step" again)."""
    qdo = schedule.reverse_scan_qdo
    if qdo == "in_step":
        return []
    if schedule.reverse_scan_layout != "kv":
        return [f"reverse_scan_qdo {qdo!r}: only the 'kv' reverse scan forms Qᵀ dO a step ahead (reverse_scan_layout "
                f"{schedule.reverse_scan_layout!r})"]
    if op is not None and op not in QDO_AHEAD_OPS:
        return [f"reverse_scan_qdo {qdo!r} is read by DeltaNet's reverse scan alone (no gate): {op}'s gated scan "
                "forms Qᵀ dO in its step"]
    return []


def flat_loads_reasons(schedule: Schedule) -> list[str]:
    """consumer_loads "flat" where it never runs its flat phase 2 (and so would time "ahead" again): the joint_tma
    consumer forming dq itself, dk's column side through the fp32 scratch, or more than one program per chunk."""
    if schedule.consumer_loads != "flat" or schedule.consumer != "joint_tma":
        return []
    need = [f"{name} {want!r} (got {got!r})" for name, want, got in (
        ("dq_stage", "separate", schedule.dq_stage), ("column_side", "gamma_t", schedule.column_side)) if got != want]
    if schedule.consumer_k_split > 1:
        need.append(f"consumer_k_split 0 or 1 (got {schedule.consumer_k_split})")
    if not need:
        return []
    return ["consumer_loads 'flat' runs its one-loop phase 2 only with " + ", ".join(need)
            + "; elsewhere it is 'ahead'"]


def compute_capability_of(problem_dims: Any) -> tuple[int, int] | None:
    cc = problem_dims.get("compute_capability") if isinstance(problem_dims, Mapping) else \
        getattr(problem_dims, "compute_capability", None)
    return tuple(cc) if cc is not None else None


def recompute_fault_reasons(schedule: Schedule, e: int, compute_capability: tuple[int, int] | None) -> list[str]:
    """The recompute stage configuration that miscompiles on compute capability 9.x with 16-bit inputs (e = 2)."""
    r = schedule.recompute
    if e != 2 or compute_capability is None or compute_capability[0] != 9 or r.num_warps != 4:
        return []
    if r.block_k == 128:
        return [f"recompute.block_k=128 with 4 warps and 16-bit inputs: {H200_RECOMPUTE_FAULT}"]
    if r.block_k > r.block_v:
        return [f"recompute.block_k={r.block_k} > block_v={r.block_v} with 4 warps and 16-bit inputs: "
                f"{H200_RECOMPUTE_FAULT}"]
    return []


def resource_reasons(shared: dict[str, int], registers: dict[str, float], smem_limit: int) -> list[str]:
    """Reasons from a resource model's per-stage estimates: shared memory over the device limit, or more live
    fp32 values per thread than fit in registers (shared by the scalar and vector models)."""
    reasons = [f"{stage}: shared memory estimate {need} B > device limit {smem_limit} B"
               for stage, need in shared.items() if need > smem_limit]
    reasons += [f"{stage}: ~{regs:.0f} live fp32 values per thread > {MAX_ACC_PER_THREAD} (would spill)"
                for stage, regs in registers.items() if regs > MAX_ACC_PER_THREAD]
    return reasons


def tile_reasons(schedule: Schedule, K: int, V: int) -> list[str]:
    """Reasons from the head dims, tiles and chunk size alone (no resource model): shared by every operator."""
    reasons: list[str] = []
    if K > 256 or V > 256:
        reasons.append(f"head dims K={K}, V={V} exceed 256 (Triton kernels' limit)")
    for name in ("forward_scan", "reverse_scan"):
        cfg: StageConfig = getattr(schedule, name)
        if cfg.block_k < K:
            reasons.append(f"{name}.block_k={cfg.block_k} < K={K}: the scans keep all K rows of the state")
    for name in ("recompute", "dv_local", "consumer_cfg"):
        cfg = getattr(schedule, name)
        if K % cfg.block_k and cfg.block_k < K:
            reasons.append(f"{name}.block_k={cfg.block_k} does not divide K={K}")
    for name in ("recompute", "forward_scan", "dv_local", "reverse_scan", "producer", "consumer_cfg"):
        cfg = getattr(schedule, name)
        if V % cfg.block_v and cfg.block_v < V:
            reasons.append(f"{name}.block_v={cfg.block_v} does not divide V={V}")
        if cfg.block_v > max(16, _pow2_ceil(V)):
            reasons.append(f"{name}.block_v={cfg.block_v} exceeds V={V} rounded up to a power of two")
    for name in ("recompute", "dv_local", "consumer_cfg"):
        cfg = getattr(schedule, name)
        if cfg.block_k > max(16, _pow2_ceil(K)):
            reasons.append(f"{name}.block_k={cfg.block_k} exceeds K={K} rounded up to a power of two")
    narrow, wide = schedule.reverse_scan_small_grid_block_v, schedule.reverse_scan.block_v
    if narrow and narrow >= wide:
        reasons.append(f"reverse_scan_small_grid_block_v={narrow} is not narrower than reverse_scan.block_v={wide}: "
                       "it changes nothing (0 turns it off)")
    elif narrow and V % narrow:
        reasons.append(f"reverse_scan_small_grid_block_v={narrow} does not divide V={V}")
    qs_bv = schedule.query_side_block_v
    if qs_bv and (schedule.dq_stage != "separate" or schedule.consumer != "joint_tma"):
        reasons.append(f"query_side_block_v={qs_bv}: no query-side stage runs (it needs dq_stage 'separate' and "
                       f"consumer 'joint_tma'; got {schedule.dq_stage!r}, {schedule.consumer!r}): 0 leaves it unset")
    elif qs_bv and qs_bv == schedule.consumer_cfg.block_v:
        reasons.append(f"query_side_block_v={qs_bv} is the consumer's block_v: it changes nothing (0 takes that)")
    elif qs_bv and (qs_bv > max(16, _pow2_ceil(V)) or (V % qs_bv and qs_bv < V)):
        reasons.append(f"query_side_block_v={qs_bv} must divide V={V} or cover it once")
    if schedule.chunk_size != 64:
        reasons.append(f"chunk_size={schedule.chunk_size}: FLA's forward saves A at chunk 64 (the only size the "
                       "CUDA forward provides)")
    return reasons


def segment_reasons(schedule: Schedule, K: int, smem_limit: int) -> list[str]:
    """The segment-combine kernel that num_segments > 1 launches must fit (same kernel for every gate type)."""
    reasons: list[str] = []
    for name in ("forward_scan_segments", "reverse_scan_segments"):
        nseg = getattr(schedule, name)
        if nseg > 1 and combine_shared_memory(K) > smem_limit:
            reasons.append(f"{name}={nseg}: segment-combine kernel shared memory {combine_shared_memory(K)} B > "
                           f"device limit {smem_limit} B")
    return reasons


def check_default_dtype(dtype: str | None) -> None:
    """A default is chosen per input dtype: an unknown one would silently get the 16-bit schedule."""
    if dtype is not None and dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} or None (16-bit), got {dtype!r}")


def check_scalar_op(op: str | None) -> None:
    """The scalar space and default serve DeltaNet and GDN (None: either)."""
    if op not in (None, "deltanet", "gdn"):
        raise ValueError(f"op must be 'deltanet', 'gdn' or None for the scalar space and default, got {op!r}")


def check_default_policy(policy: str | None) -> None:
    """A default may differ per policy (the vector H200 one does): an unknown one would silently get R's."""
    if policy not in (None, "R", "A"):
        raise ValueError(f"policy must be 'R', 'A' or None, got {policy!r}")


def default_schedule(compute_capability: tuple[int, int] | None = None, *, K: int = 128, V: int = 128,
                     dtype: str | None = None, vector_gates: bool = False, policy: str | None = None,
                     op: str | None = None) -> Schedule:
    """Built-in schedule: tuned-by-hand starting point for Hopper (9, 0), a conservative generic one otherwise.

    dtype: the inputs' ("bf16", "fp16", "fp32"; None: 16-bit). vector_gates: the base the vector space builds on
    (the pointer consumer and the session-11 scans, which its default was measured with). op ("deltanet", "gdn";
    None: GDN's) and policy ("R", "A"; None: R's): the Hopper defaults differ by operator and policy in a few fields,
    each with the sweep that chose it below (the query-side stage under A, DeltaNet's 128-row scan blocks, the
    small-grid reverse scan, DeltaNet's consumer loads, DeltaNet R's query-side stage).
    The scans' block_k always covers K (rounded up to a power of two). The generic schedule passes
    `constraint` at K, V <= 128 on devices with >= 99 KiB of shared memory per block; K = 256 there needs a
    tuned schedule."""
    check_default_dtype(dtype)
    check_default_policy(policy)
    check_scalar_op(op)
    kk = max(16, _pow2_ceil(K))
    bk = min(64, kk)
    bv = min(64, max(16, _pow2_ceil(V)))
    if compute_capability is not None and tuple(compute_capability) == (9, 0):
        tma = tma_rows_fit(K, V) and not vector_gates
        policy_a = tma and policy == "A" and dtype != "fp32"
        deltanet_tma = tma and dtype != "fp32" and op == "deltanet"  # under either policy
        deltanet_a = deltanet_tma and policy == "A"
        # FLA's picks for both scans (32-wide value tiles; 4 stages forward, 3 reverse). Session 13 sweep,
        # (2, 2048, 16): reverse 77 -> 55 µs (GDN). Session 14, once the forward loop matched FLA's (U added after
        # the W·S products, S as stored): forward 55.8 -> 37.5 µs (DeltaNet), 59.7 -> 43.5 µs (GDN). With fp32
        # inputs the stages would need more shared memory than the H200 has.
        wide_scans = not vector_gates and kk <= 128 and V >= 32 and dtype != "fp32"
        return Schedule(
            recompute=StageConfig(bk, bv, 4, 2),
            # Scans otherwise: 16-wide value tiles (4x the programs of BV=64) measured fastest on the H200 at
            # K=V=128: GDN (1,8192,4) backward 0.976 -> 0.728 ms (benchmarks/RESULTS.md, stage sweep).
            forward_scan=StageConfig(kk, 32, 4, 4) if wide_scans else StageConfig(kk, 16, 4, 2 if kk <= 128 else 1),
            dv_local=StageConfig(min(128, kk), min(128, max(16, _pow2_ceil(V))), 4, 2),
            reverse_scan=StageConfig(kk, 32, 4, 3) if wide_scans else StageConfig(kk, 16, 4, 2 if kk <= 128 else 1),
            producer=StageConfig(64, bv, 4, 2),
            # joint_tma at 4 warps (two CTAs per SM) with dq first and the column side from stored Γ tiles: nothing
            # spills (sm_90 compile with alignment hints). Session 13 sweep, (2, 2048, 16): GDN 0.427 -> 0.340 ms,
            # DeltaNet 0.374 -> 0.310 ms (RESULTS.md).
            consumer_cfg=StageConfig(bk, bv, 4 if tma else 8, 2),
            consumer_order="dq_first" if tma else "fused", column_side="gamma_t" if tma else "scratch",
            cumsum=StageConfig(64, 64, 4, 1),
            # Per-chunk states in the input dtype (bf16 in training), as FLA stores them: the states are the
            # largest saved tensor (fp32 put peak backward memory 15 % above FLA's) and the scans move them
            # twice; GDN (1,8192,4) 0.976 -> 0.827 ms on the H200 (RESULTS.md, stage sweep). fp32 inputs keep
            # fp32 states.
            state_dtype="input", pd_dtype="fp32", intra="auto",
            # The joint consumer through tensor descriptors (TMA): GDN's benchmark geomean 1.053 -> 1.076x FLA
            # under R and 1.034 -> 1.074x under A, DeltaNet 0.878 -> 0.883x / 0.829 -> 0.837x (RESULTS.md,
            # session 12). TMA rows must be 16-byte multiples: other head dims keep the pointer kernel.
            consumer="joint_tma" if tma else "joint",
            # Sequence-split scans where B·H is small: the 16-wide scans' grid at B·H = 4 is 32 programs on 132
            # SMs; split 4 / 8 ways, GDN (1, 8192, 4) 0.603 -> 0.403 ms (FLA 0.580). At B·H = 32 the same split
            # cost 1.5x (0.469 -> 0.722 ms; RESULTS.md, session 7 sweep): two waves of the SMs kept it to B·H <= 8.
            # The 32-wide scans have half the programs, so two waves let B·H = 16 split as well, and GDN's
            # (1, 2048, 16) fell below FLA (session 14). One CTA of them fits per SM: counted in rounds, the split
            # loses at B·H = 16, and one wave keeps it to B·H <= 8 again: bench, session 15, GDN (1, 2048, 16)
            # 0.256 -> 0.204 ms, (1, 8192, 16) 0.838 -> 0.753 ms under R (RESULTS.md).
            forward_scan_segments=4, reverse_scan_segments=8, scan_split_waves=1 if wide_scans else 2,
            # Policy A keeps the forward's W (FLA's w): no recompute stage. Bench, session 15: GDN A 1.384 ->
            # 1.457x FLA, DeltaNet A 1.052 -> 1.115x (RESULTS.md). Policy R does not read the field.
            w_source="forward",
            # Policy R: the reverse scan on a second stream beside the forward scan (it reads W and dv_local only).
            # Sweep, session 16 (DeltaNet R): (1, 512, 4) 0.0554 -> 0.0420 ms, (1, 2048, 16) 0.1768 -> 0.1431,
            # (1, 8192, 16) 0.6580 -> 0.5168 (RESULTS.md). Policy A with the forward's W has no stage to overlap.
            side_stream="reverse_scan",
            # Two consumer programs per chunk where the grid is small (auto, local.programs_per_chunk): session 16
            # sweep, DeltaNet R, k_split 2 alone: (1, 512, 4) 0.0554 -> 0.0485 ms, (1, 2048, 4) 0.1115 -> 0.1076, and
            # 9 % slower at B·H = 16, where "auto" keeps one (RESULTS.md). The pointer consumers do not read it.
            consumer_k_split=0,
            # Policy A (the reverse scan runs last and alone): the consumer of each 16-chunk-or-longer range starts
            # once the scan has finished it, beside the scan of the earlier chunks (auto: 4 to 8 ranges where T ≥
            # 4096 at chunk 64). Session 18 sweep, DeltaNet A (1, 8192, 16): 0.4775 -> 0.4207 ms in 8 ranges; at
            # (1, 2048, 16) (32 chunks) auto keeps one launch (RESULTS.md). Under R the reverse scan runs beside the
            # forward scan and the field is not read.
            consumer_ranges=0,
            # DeltaNet under policy A: dq, dk's query part (and Ḡ's query side) in their own stage beside the reverse
            # scan, where the consumer's ranges would run (session 35 bench, (1, 8192, 16) 1.158x against the
            # ranges' 1.147x). Its race beside the scan (session 34) was a one-slot shared buffer under an
            # asynchronous product (rewy_tune/ir_hazards.py), removed in session 35: the H200's race tests pass, and
            # `rewy-tune bench --op deltanet --policy A` went 1.203 -> 1.283x FLA, every shape faster (RESULTS.md).
            # GDN under A as well: session 42 sweep on an H100, every bench shape 3-13 % faster ((1, 2048, 16) 0.1644
            # -> 0.1430 ms, (1, 8192, 16) 0.5355 -> 0.5023); its full consumer had its warpgroup products serialized
            # by ptxas for want of registers (C7512), the phase-2 consumer's are not. DeltaNet R takes it with the
            # "flat" consumer loads below: session 46 sweep on an H100, 2.6 % faster in geomean ((1, 8192, 4) 0.2174
            # -> 0.2025 ms, (1, 8192, 16) 0.5789 -> 0.5491), 7 % slower at (1, 512, 4) (0.0319 -> 0.0344). GDN R
            # lost 5-8 % at B·H = 4 with it and gained about 2 % at most elsewhere: it keeps its full consumer.
            dq_stage="separate" if policy_a or deltanet_tma else "consumer",
            # DeltaNet at K = 128: both scans hold the state in one 128-row register block (three waited products a
            # reverse step instead of six, two a forward step instead of four). Session 38 sweeps on an H100 (no H200
            # came; RESULTS.md): A every shape but one faster or level, 3-5 % at B·H = 4; R 5-6 % at (1, 2048, 4) and
            # (1, 8192, 4). GDN is not timed with it in a whole backward yet.
            scan_state_rows=128 if op == "deltanet" and wide_scans and kk == 128 else 64,
            # DeltaNet A: Qᵀ dO formed a step ahead where the reverse scan splits (B·H = 4: 4-6 % with the 128-row
            # blocks), in its step where the scan runs whole beside the query-side stage and the consumer ranges,
            # whose CTAs a 200 KB scan CTA keeps off its SM ("ahead" lost 4 % there). Session 38, H100.
            reverse_scan_qdo="split" if deltanet_a and kk == 128 else "in_step",
            # 16-wide reverse-scan tiles where the scan runs whole on at most a quarter of the SMs ((1, 512, 4): 16
            # programs at 32 wide). H100 sweeps against the same default without it (RESULTS.md): DeltaNet (session
            # 39) 28.1 -> 26.1 µs under A, 33.4 -> 32.1 under R; GDN (session 40) 40.7 -> 37.8 µs under A, but 40.8 ->
            # 43.9 under R, where its reverse scan runs beside the forward scan: GDN takes it under A alone. The
            # other five bench shapes do not take it; split at B·H = 4 the narrower tile lost (session 38).
            reverse_scan_small_grid_block_v=16 if wide_scans and tma and (op == "deltanet" or policy == "A") else 0,
            # DeltaNet A: A and v by pointer loads and phase 2 as one flat loop over (K tile, V tile) pairs, so the
            # consumer's copies are in flight through its epilogues. Session 41 sweep on an H100 (RESULTS.md): its
            # consumer 92.7 -> ~90 µs at (2, 2048, 16); the backward (1, 2048, 16) 0.1218 -> 0.1205 ms, (2, 2048, 16)
            # 0.2211 -> 0.2173, (1, 8192, 16) 0.4470 -> 0.4350, level at B·H = 4. DeltaNet R with the query-side
            # stage (above): "flat" level with "at_use" at B·H = 4, 1-2 % faster at B·H >= 16 (session 46, H100);
            # GDN R's query-side form lost up to 4 % with it.
            consumer_loads="flat" if deltanet_tma else "at_use",
        )
    return Schedule(
        recompute=StageConfig(bk, min(32, bv), 4, 1),
        forward_scan=StageConfig(kk, min(32, bv), 4, 1),
        dv_local=StageConfig(bk, min(32, bv), 4, 1),
        reverse_scan=StageConfig(kk, min(32, bv), 4, 1),
        producer=StageConfig(64, min(32, bv), 4, 1),
        consumer_cfg=StageConfig(min(32, bk), min(32, bv), 8, 1),
        cumsum=StageConfig(64, 64, 4, 1),
        state_dtype="fp32", consumer="joint", pd_dtype="fp32", intra="auto", w_source="forward",
    )
