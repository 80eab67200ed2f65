"""Schedule: the frozen value that fully determines the ReWY backward pipeline for one operator.

Every field is read by a kernel launcher (`kernels/triton/pipeline.py` says where); two equal schedules
give bitwise-equal results. A schedule is hashable, JSON round-trips exactly, and `replace(...)` makes a
changed copy (nested stage fields may be given as dicts: `s.replace(consumer_cfg={"num_warps": 8})`).

Stage map (rewy-math §§3–6):
- ``recompute``      W = A E, U = A Z (policy R; policy A still recomputes W for the reverse scan)
- ``forward_scan``   S0 per chunk and R (policy R); block_k × block_v is the scan's state tile
- ``dv_local``       A_qkᵀ dO with A_qk recomputed from q, k, G (vector gates with ``dv_local_source ==
                     "forward"``: the forward's saved A_qk, FLA's Aqk, read instead; block_v, warps, stages only)
- ``reverse_scan``   dS1 per chunk, R̄, dh0; block_k × block_v is the scan's state tile
- ``producer``       P = AᵀR̄, D = −L_<(P Rᵀ) written to memory (only when ``consumer == "separate"``)
- ``consumer_cfg``   the consumer kernel (joint: producer fused in, P and D stay on chip; joint_tma: the same
                     with tensor-descriptor loads and stores, DeltaNet/GDN only, `kernels/triton/consumer_tma.py`)
- ``cumsum``         the chunk-local cumsum G of the gate g (block_k: feature tile of vector gates); the backward's
                     reverse cumsum of Ḡ is formed inside the consumers

Which StageConfig members a stage reads: recompute, dv_local, consumer_cfg all four; forward_scan and
reverse_scan all four (block_k must cover K); producer block_v, num_warps, num_stages; cumsum num_warps
(and block_k for vector gates). The search spaces pin the members a stage does not read to one value.
``forward_scan_segments`` / ``reverse_scan_segments`` cap each scan's sequence split; ``scan_split_waves`` (both
scans) keeps a split only where the scan's grid is small enough to leave the GPU idle without it (`scan.py`).
``intra`` and ``intra_precision`` are read only by vector-gate operators (KDA/GDN2); scalar gates form Λ exactly and
accept any value. ``dv_local_source``: "recompute" rebuilds A_qk in dv_local from q, k, G; "forward" (vector gates;
scalar gates read it as "recompute") has the autograd Function save the forward's A_qk ([B,T,H,C] in the input
dtype, FLA's ``Aqk``, which FLA's own backward keeps too) and dv_local multiplies it with dO; "scan" (scalar gates
only) runs no dv_local stage: each chunk step of the reverse scan forms A_qk from its own q, k, G tiles, off the
state's chain, and dv_local with it (`scan.reverse_state_scan(dv_local_from_qk=True)`). ``consumer_order`` is read
only by the joint_tma consumer: "fused" forms Q̄_g, Ē_dir and K̄_t in one V pass, then dq and dk; "dq_first" gives Q̄_g its own V pass
and finishes dq and dk's column side before forming Ē_dir and K̄_t (fewer live registers, S0 and Q, K read twice).
``column_side`` is read only by joint_tma too: "scratch" forms dk's column side Qᵀ Γ_q + (eK)ᵀ Γ_r as columns per K
tile and turns it into rows through an fp32 scratch and a CTA barrier; "gamma_t" stores Γ_q, Γ_r once per chunk,
reads them back transposed and forms the rows Γ_qᵀ Q + Γ_rᵀ (eK) directly. ``p_tiles`` is read only by joint_tma
as well: "recompute" forms P = AᵀR̄ again in every K tile of phase 2 (one more product per V tile); "stored" writes
P's tiles in the operand dtype to a per-chunk scratch in phase 1 and reads them back there (the same values: phase 2
uses P only as a product operand, cast to that dtype). ``w_source`` is read by the autograd Function under policy A
only: "recompute" rebuilds W = A E in the backward's recompute stage (as policy R must); "forward" keeps the
forward's W (FLA's ``w``, which FLA's own save-all backward keeps too) with S0 and R, and the backward runs no
recompute stage. ``side_stream`` runs stages on a second CUDA stream beside others they do not depend on (the scans
leave SMs idle where B·H is small: one program per state tile, one CTA per SM): "none" runs every stage in order;
"dv_local" runs dv_local beside the recompute stage and the forward scan, joined before the reverse scan;
"reverse_scan" also runs the reverse scan there, once the recompute stage has made W, beside the forward scan (the
reverse scan reads W and dv_local, never S0 or R), joined before the consumer. Off CUDA, or where no stage runs
before the reverse scan (policy A with the forward's W, unless dq_stage is "separate"), every stage runs in order.
``consumer_k_split`` is read by joint_tma and the vector consumers (not the scalar pointer ones): up to that many
programs per chunk, each running phase 1 and its share of phase 2's K tiles, the row gradients summed over K from
fp32 parts (more programs where B·H is small, phase 1 repeated); 0 chooses 2 or 1 from the grid at launch (2 where
twice the chunks still fit in one wave of the consumer's CTAs). ``dq_stage`` is read by joint_tma only: "consumer"
forms dq (and Ḡ's query side) in the consumer; "separate" forms them and dk's query part (every product with dO or
Q) in a stage of their own (``kernels/triton/query_side.py``), which reads dO, R, S0, Q, K and G but nothing of the
reverse scan, so it runs on the main stream while the side stream runs the reverse scan (under policy A after
dv_local, in order), and the consumer completes dk in place, reading neither dO nor Q. DeltaNet's Hopper default
under policy A since session 35 (session 34's run-to-run dk beside the scan was a Triton pipeliner hazard, removed:
``rewy_tune/ir_hazards.py``). ``consumer_ranges`` is read by joint_tma and by the vector gates' joint consumer,
where the reverse scan runs last and alone (not beside the forward scan) and does not split: n > 1 cuts the chunks into n ranges; the reverse scan runs one range per
launch from the last, on the side stream, and the consumer of each range is launched on the main stream as soon as
the scan has finished it, beside the scan of the earlier ranges (the scan's B·H·V/BV programs leave most SMs idle
where B·H ≥ 16 under policy A); the consumer's ranges alternate between the main stream and a second one. 0
("auto") takes ranges of 16 chunks or more where that gives at least 4 (at most 8), else 1; with dq_stage "separate"
(policy A) the query-side stage runs beside the ranged scan before the first consumer range, and auto takes 4
ranges where each has 32 chunks or more (and the scan does not split), else none. The same bits as 1 (one scan, then one consumer launch). ``scan_operands`` is read by vector gates only
(scalar gates scale rows of the scans' [C, BV] tiles instead and accept any value): "inline" has each scan program form K_t = K ⊙ exp(G_n − G) and
Q_g = s·Q ⊙ exp(G) in its serial chunk loop; "pregated" forms them once in a parallel stage before the scans
(`kernels/triton/scan_operands.py`, two [B,T,H,K] tensors in the input dtype held until the reverse scan is done),
which then read them and G's last rows only. The same bits. "forward" (policy A; as "pregated" under R) reads the
save-all forward's own gated copies instead, fla-core's qg = Q ⊙ exp(G) (no s: the reverse scan scales dO) and
kg = K_t, which the autograd Function keeps; no scan-operands stage runs and the chunk cumsum writes the consumer's
gate range. ``consumer_v_stages`` is read by the vector consumers only
(joint and separate): the software-pipeline depth of their two loops over V tiles (phase 1, and the inter products
P S0ᵀ, dO S0ᵀ, R dS1ᵀ), whose loads feed tensor-core products; the rest of the kernel keeps
``consumer_cfg.num_stages``. 0 follows ``consumer_cfg.num_stages`` (what the loops did before the field). The same
arithmetic in the same order at any depth. ``reverse_scan_layout`` is read by the scalar gates' reverse scan: "kv"
holds the state as dS [K, BV] register blocks, whose chained products take it and R̄ as shared-memory operands every
chunk step; "vk" holds dSᵀ [BV, K], so both take their A operand from registers (``scan.rewy_bwd_scan_vk_kernel``;
its value tiles want 64 columns for Hopper's wgmma). Vector gates keep "kv".
``scan_state_rows`` is read by both scans ("kv" layout, every gate form; the transposed reverse scan keeps its own
blocks, and the segment combine of a split scan its 64-row ones): the state's K rows are held in register blocks of
up to 64 rows (as FLA's kernels hold them) or 128. It changes code only where K > 64: at K = 128 one 128-row block
makes each reverse chunk step three tensor-core products (K_t dS, Q_gᵀ dO, Wᵀ R̄) instead of six and each forward
step two (W S, K_tᵀ R) instead of four, each waited for and fenced once (sm_90: DeltaNet A's reverse step 6 -> 3
product waits, 104 -> 128 registers; KDA/GDN2 A 7 -> 4, 212 -> 225 registers; the same shared memory at 4 warps).
``reverse_scan_qdo`` is read only by the no-gate (DeltaNet) reverse scan in the "kv" layout: "in_step" forms each
chunk step's Qᵀ dO within the step; "ahead" forms it at the end of the step before, from a zero accumulator and the
q and dO tiles as loaded, so Triton 3.6 waits for it at the next step's first product instead of before −Wᵀ R̄
(with dv_local_source "scan" the next step's dv_local too). The same sums in another order; a third dO tile and the
next chunk's q tile in shared memory (sm_90, K = 128, BV 32, 3 stages: 176 128 -> 200 704 B). "split" is "ahead"
where the scan splits along the sequence (reverse_scan_segments; its segments then run side by side and nothing
beside them) and "in_step" where it runs whole: there, under policy A, the query-side stage and the consumer ranges
run beside it, and a 200 KB scan CTA leaves no room for their CTAs on its SM (session 38, H100: "ahead" 4-6 % faster
at B·H = 4, 4 % slower at B·H ≥ 16). GDN, KDA and GDN2 (a gate scales dO's rows first, and Triton then waits for the
product at once) and the "vk" layout run "in_step" whatever the value; the search spaces offer "ahead" and "split"
to DeltaNet alone and the constraints reject them where they know the operator is gated. DeltaNet's sm_90 default
takes 128 rows under both policies and "split" under A (session 38, H100 sweeps; RESULTS.md).
``reverse_scan_small_grid_block_v`` (0, 16 or 32; 0: off) is the reverse scan's value-tile width where it runs whole
(no sequence split, no consumer ranges, no chase) on a small grid: at most a quarter of the SMs at
``reverse_scan.block_v`` (`kernels/triton/pipeline.py`, ``small_grid_block_v``). There a narrower tile doubles the
scan's programs on SMs that would stay idle, and each chunk step issues less (DeltaNet, 128-row blocks: 1.34 -> 1.04
µs a step at 16 wide, session 38's scan_bench on an H100). Where it splits, a narrower tile halves the segments the
occupancy rule allows and loses (session 38: (1, 8192, 4) 18 % slower); at B·H >= 16 its grid fills the SMs the
query-side stage and the consumer would take. A value not below ``reverse_scan.block_v`` changes nothing; the
constraints reject it. The gradients are the same sums, formed over narrower tiles.
``consumer_loads`` is read by joint_tma only: where its tiles outside the pipelined V loops are loaded. On sm_90 a
descriptor load outside such a loop is a TMA copy waited for where it is issued, a memory round trip on the chunk's
path each (per chunk A and every v tile of phase 1; per K tile K, and Q or dk's query part, after its V loop).
"at_use" loads each where it is used (the form before session 41); "ahead" loads A and v by pointer loads (in flight
beside phase 1's products) and K with Q or dk's query part before the K tile's V loop (in flight beside it);
"flat" loads A and v as "ahead" does and runs phase 2 as one loop over (K tile, V tile) pairs, the dk epilogue at a
K tile's last V tile, so the next K tile's first copies are in flight during it. "flat" is written for the consumer
whose dq comes from the query-side stage (dq_stage "separate") with column_side "gamma_t" and one program per chunk;
where consumer_k_split 0 gives two programs it runs as "ahead", and the constraints reject it where it never applies.
The same products in the same order: the same bits whichever value, but for d_write on a GPU, whose row sums ⟨v, P⟩
are reduced in the pointer-loaded v tile's layout, in another order (within a bf16 rounding step). Session 41, H100:
DeltaNet A's consumer 2-3 % shorter at B·H >= 16 with "ahead" or "flat".
``query_side_block_v`` (0, 16, 32, 64 or 128; 0: ``consumer_cfg.block_v``) is the query-side stage's value-tile width
(dq_stage "separate", joint_tma). The stage runs beside the reverse scan, whose 176 KB CTA (DeltaNet's sm_90 default)
leaves room on its SM for one 32 KB stage CTA at 64 wide and two at 32 wide (24 KB each; sm_90 compile). The same sums
over narrower tiles. The constraints reject it where no query-side stage runs, and a width equal to the consumer's.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

CONSUMER_MODES = ("joint", "separate", "joint_tma")
CONSUMER_ORDERS = ("fused", "dq_first")
COLUMN_SIDES = ("scratch", "gamma_t")
P_TILES = ("recompute", "stored")
CONSUMER_LOADS = ("at_use", "ahead", "flat")
W_SOURCES = ("recompute", "forward")
SIDE_STREAMS = ("none", "dv_local", "reverse_scan")
DQ_STAGES = ("consumer", "separate")
REVERSE_SCAN_LAYOUTS = ("kv", "vk")  # the reverse scan's state: dS [K, BV] or its transpose dSᵀ [BV, K] (scan.py)
CONSUMER_K_SPLITS = (0, 1, 2, 4)  # 0: "auto", chosen from the consumer's grid (local.programs_per_chunk)
CONSUMER_RANGES = (0, 1, 2, 4, 8)  # the consumer's chunk ranges (0: "auto", pipeline.consumer_range_count)
CONSUMER_V_STAGES = (0, 1, 2, 3)  # pipeline depth of the vector consumers' V loops (0: consumer_cfg.num_stages)
SCAN_STATE_ROWS = (64, 128)  # rows per register block of the scans' state (kernels/triton/scan.py)
# when the no-gate reverse scan forms a chunk step's Qᵀ dO (scan.py): in the step, the step before, or the step before
# only where the scan splits along the sequence
REVERSE_SCAN_QDO = ("in_step", "ahead", "split")
SMALL_GRID_BLOCK_VS = (0, 16, 32)  # the reverse scan's value tile on a small grid (0: reverse_scan.block_v)
QUERY_SIDE_BLOCK_VS = (0, 16, 32, 64, 128)  # the query-side stage's value tile (0: consumer_cfg.block_v)
PD_DTYPES = ("fp32", "input")
STATE_DTYPES = ("fp32", "input")
INTRA_MODES = ("auto", "centred", "subchunk")
INTRA_PRECISIONS = ("ieee", "tf32x3")
DV_LOCAL_SOURCES = ("recompute", "forward", "scan")
SCAN_OPERANDS = ("inline", "pregated", "forward")
CHUNK_SIZES = (16, 32, 64)
SPLIT_WAVES = (0, 1, 2, 4)  # scan_split_waves: 0 = no occupancy limit on the sequence split
STAGES = ("recompute", "forward_scan", "dv_local", "reverse_scan", "producer", "consumer_cfg", "cumsum")


def state_blocks(K: int, rows: int = 64) -> tuple[int, int]:
    """(KB, NB): rows per register block of the scans' state and the number of blocks, as the scan kernels compile
    them (`kernels/triton/scan.py`) and the search spaces count them. KB is K rounded up to a power of two (at least
    16), at most 64, or at most `rows` (Schedule.scan_state_rows) where K > 64."""
    kp = max(16, 1 << max(0, (K - 1).bit_length()))
    KB = min(rows if K > 64 else 64, kp)
    return KB, -(-K // KB)


def _pow2(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and (x & (x - 1)) == 0


def _known_fields(cls, d: Any) -> dict[str, Any]:
    """`d` checked to be a dict of `cls`'s fields (error messages name the class and the strays)."""
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__}: expected a dict, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    return d


@dataclass(frozen=True)
class StageConfig:
    """Launch shape of one stage: feature tiles (block_k over K, block_v over V), warps, pipeline depth."""

    block_k: int = 64
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_k", "block_v"):
            val = getattr(self, name)
            if not _pow2(val) or not 16 <= val <= 256:
                raise ValueError(f"StageConfig.{name} must be a power of two in [16, 256], got {val!r}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"StageConfig.num_warps must be one of 1, 2, 4, 8, 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or isinstance(self.num_stages, bool) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"StageConfig.num_stages must be an int in [1, 8], got {self.num_stages!r}")

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | "StageConfig") -> "StageConfig":
        if isinstance(d, StageConfig):
            return d
        return cls(**_known_fields(cls, d))


@dataclass(frozen=True)
class Schedule:
    """All tunable choices of the ReWY backward for one operator (see the module docstring)."""

    chunk_size: int = 64
    recompute: StageConfig = field(default_factory=lambda: StageConfig(64, 64, 4, 2))
    forward_scan: StageConfig = field(default_factory=lambda: StageConfig(128, 64, 4, 2))
    dv_local: StageConfig = field(default_factory=lambda: StageConfig(64, 64, 4, 2))
    reverse_scan: StageConfig = field(default_factory=lambda: StageConfig(128, 64, 4, 2))
    producer: StageConfig = field(default_factory=lambda: StageConfig(64, 64, 4, 2))
    consumer_cfg: StageConfig = field(default_factory=lambda: StageConfig(64, 64, 4, 2))
    cumsum: StageConfig = field(default_factory=lambda: StageConfig(64, 64, 4, 1))
    state_dtype: str = "fp32"  # storage of per-chunk states S0 / dS1 written by the scans
    consumer: str = "joint"  # "joint": producer fused into the consumer; "separate": P, D via memory;
    # "joint_tma": joint through tensor descriptors (TMA on sm_90; scalar gates only)
    pd_dtype: str = "fp32"  # storage dtype of P and D when consumer == "separate"
    intra: str = "auto"  # vector-gate intra (KDA/GDN2): centred whole-chunk or 16-row sub-chunk
    intra_precision: str = "ieee"  # vector-gate intra products: fp32 FMA ("ieee") or 3×tf32 ("tf32x3")
    forward_scan_segments: int = 1  # sequence split of the forward scan: at most this many segments of >= 2 chunks
    reverse_scan_segments: int = 1  # sequence split of the reverse scan (the same rule; see scan.py)
    scan_split_waves: int = 0  # split only while a scan's grid fits in this many waves of one program per SM; 0: always
    dv_local_source: str = "recompute"  # vector gates: A_qk of dv_local recomputed, or the forward's saved Aqk
    consumer_order: str = "fused"  # joint_tma's phase 2: one V pass for its three products, or dq (and dk's
    # column side) first, then Ē_dir and K̄_t: two [C, BK] accumulators live instead of three
    column_side: str = "scratch"  # joint_tma's dk column side: fp32 scratch per K tile, or rows from Γᵀ ("gamma_t")
    p_tiles: str = "recompute"  # joint_tma's P in phase 2: recomputed per K tile, or "stored" in phase 1 and read back
    w_source: str = "recompute"  # policy A: W recomputed in the backward, or kept from the "forward"
    side_stream: str = "none"  # stages on a second CUDA stream: "dv_local", or it and the "reverse_scan" too
    consumer_k_split: int = 1  # joint_tma / vector consumers: programs per chunk, each over a share of the K tiles
    dq_stage: str = "consumer"  # joint_tma: dq formed in the consumer, or in its own stage beside the reverse scan
    consumer_ranges: int = 1  # joint_tma, vector joint: consumer launches, each on chunks the scan has finished
    scan_operands: str = "inline"  # vector gates: the scans gate K and Q in their loop, or read them "pregated"
    # (formed once), or (policy A) the "forward"'s saved qg, kg
    consumer_v_stages: int = 0  # vector consumers: pipeline depth of their V loops (0: consumer_cfg.num_stages)
    reverse_scan_layout: str = "kv"  # scalar gates: the reverse scan's state as dS [K, BV] or transposed, dSᵀ [BV, K]
    scan_state_rows: int = 64  # both scans: rows per register block of the state (changes code only where K > 64)
    reverse_scan_qdo: str = "in_step"  # DeltaNet's reverse scan: Qᵀ dO formed in its chunk step, or the step before
    # ("ahead"; "split": where the scan splits)
    reverse_scan_small_grid_block_v: int = 0  # the reverse scan's value tile where it runs whole on a small grid
    consumer_loads: str = "at_use"  # joint_tma: its tiles outside the pipelined V loops loaded where used, "ahead"
    # of use, or ahead with phase 2 as one "flat" loop over (K tile, V tile) pairs
    query_side_block_v: int = 0  # the query-side stage's value tile (dq_stage "separate"; 0: consumer_cfg.block_v)

    def __post_init__(self) -> None:
        # integer choices: an int of the listed values (1.0 or True compare equal to 1, and would reach the kernels)
        for name, allowed in (("chunk_size", CHUNK_SIZES), ("consumer_k_split", CONSUMER_K_SPLITS),
                              ("consumer_ranges", CONSUMER_RANGES), ("consumer_v_stages", CONSUMER_V_STAGES),
                              ("scan_split_waves", SPLIT_WAVES), ("scan_state_rows", SCAN_STATE_ROWS),
                              ("reverse_scan_small_grid_block_v", SMALL_GRID_BLOCK_VS),
                              ("query_side_block_v", QUERY_SIDE_BLOCK_VS)):
            val = getattr(self, name)
            if type(val) is not int or val not in allowed:
                raise ValueError(f"Schedule.{name} must be one of {allowed}, got {val!r}")
        for name in STAGES:
            val = getattr(self, name)
            if isinstance(val, dict):  # accept dicts (JSON, replace) and normalise to StageConfig
                object.__setattr__(self, name, StageConfig.from_dict(val))
            elif not isinstance(val, StageConfig):
                raise ValueError(f"Schedule.{name} must be a StageConfig or dict, got {type(val).__name__}")
        for name in ("forward_scan_segments", "reverse_scan_segments"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or not 1 <= val <= 64:
                raise ValueError(f"Schedule.{name} must be an int in [1, 64], got {val!r}")
        for name, allowed in (("state_dtype", STATE_DTYPES), ("consumer", CONSUMER_MODES),
                              ("pd_dtype", PD_DTYPES), ("intra", INTRA_MODES),
                              ("intra_precision", INTRA_PRECISIONS),
                              ("dv_local_source", DV_LOCAL_SOURCES), ("consumer_order", CONSUMER_ORDERS),
                              ("column_side", COLUMN_SIDES), ("p_tiles", P_TILES), ("consumer_loads", CONSUMER_LOADS),
                              ("w_source", W_SOURCES), ("side_stream", SIDE_STREAMS), ("dq_stage", DQ_STAGES),
                              ("scan_operands", SCAN_OPERANDS), ("reverse_scan_layout", REVERSE_SCAN_LAYOUTS),
                              ("reverse_scan_qdo", REVERSE_SCAN_QDO)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Schedule.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    # -- derived views ----------------------------------------------------------------------------
    @property
    def forward_state_tile(self) -> tuple[int, int]:
        return (self.forward_scan.block_k, self.forward_scan.block_v)

    @property
    def consumer_v_loop_stages(self) -> int:
        """Pipeline depth of the vector consumers' V loops as launched (0 resolved to consumer_cfg.num_stages)."""
        return self.consumer_v_stages or self.consumer_cfg.num_stages

    @property
    def reverse_state_tile(self) -> tuple[int, int]:
        return (self.reverse_scan.block_k, self.reverse_scan.block_v)

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            out[f.name] = val.to_dict() if isinstance(val, StageConfig) else val
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Schedule":
        return cls(**_known_fields(cls, d))

    @classmethod
    def from_json(cls, s: str) -> "Schedule":
        return cls.from_dict(json.loads(s))

    def replace(self, **changes: Any) -> "Schedule":
        """Copy with fields changed; a stage field given as a dict updates only the named keys."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"Schedule.replace: unknown field(s) {sorted(unknown)}")
        for name in STAGES:
            if isinstance(changes.get(name), dict):
                changes[name] = dataclasses.replace(getattr(self, name), **changes[name])
        return dataclasses.replace(self, **changes)

    def validate_for(self, K: int, V: int) -> None:
        """Raise ValueError if the schedule cannot run for head dims K, V (the scans hold all K rows)."""
        for name in ("forward_scan", "reverse_scan"):
            cfg = getattr(self, name)
            if cfg.block_k < K:
                raise ValueError(f"Schedule.{name}.block_k={cfg.block_k} must cover K={K}: the scans keep all K "
                                 "rows of the state tile in one program")
