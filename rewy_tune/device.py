"""The machine a schedule is tuned on: GPU identity (`Device`) and software fingerprint (`Environment`).

Winners are keyed on `Environment.fingerprint(device)`: a schedule measured with one driver,
Triton or kernel source is not silently reused under another.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

CPU_INTERPRETER = "cpu-interpreter"

# Order matters: longer names first, so "h200" is not read as "h20" nor "l40s" as "l4".
_GPU_MODELS = (
    "gh200", "gb200", "h200", "h100", "h800", "h20", "b200", "b100",
    "a100", "a800", "a10g", "a40", "a30", "a10", "l40s", "l40", "l4", "v100", "t4",
)
KNOWN_DEVICE_NAMES = _GPU_MODELS + ("cpu",)
_MODEL_RE = re.compile(r"\b(" + "|".join(_GPU_MODELS) + r")\b")
_RTX_RE = re.compile(r"\brtx\s*(a?\d{4})\b")
_AMD_RE = re.compile(r"\b(mi\d{3}[a-z]?)\b")


def short_name_for(gpu_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; unknown names become a lowercase slug."""
    name = gpu_name.lower()
    if name == CPU_INTERPRETER or name.startswith("cpu"):
        return CPU_INTERPRETER
    for pattern in (_MODEL_RE, _AMD_RE):
        if m := pattern.search(name):
            return m.group(1)
    if m := _RTX_RE.search(name):
        return "rtx" + m.group(1)
    slug = re.sub(r"\b(nvidia|geforce|tesla|amd|instinct)\b", " ", name)
    return re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "unknown-gpu"


@dataclasses.dataclass(frozen=True)
class Device:
    """Hardware identity; `short_name` is derived from `gpu_name`."""

    gpu_name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    short_name: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute_capability", tuple(int(x) for x in self.compute_capability))
        object.__setattr__(self, "short_name", short_name_for(self.gpu_name))

    @property
    def is_cpu(self) -> bool:
        return self.short_name == CPU_INTERPRETER

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"compute_capability": list(self.compute_capability)}

    @classmethod
    def from_dict(cls, data: dict) -> Device:
        return cls(data["gpu_name"], tuple(data["compute_capability"]), data["sm_count"], data["memory_bytes"])


# Interpreter timings are never comparable to a GPU's; SM count and memory stay 0 so the
# fingerprint does not change from one CI machine to the next.
CPU_DEVICE = Device(gpu_name=CPU_INTERPRETER, compute_capability=(0, 0), sm_count=0, memory_bytes=0)


@dataclasses.dataclass(frozen=True)
class Environment:
    """Software that changes what a schedule measures. Missing pieces are 'none'."""

    driver: str
    cuda: str
    torch: str
    triton: str
    fla_core: str
    rewy_tune: str
    kernel_source_hash: str

    def fingerprint(self, device: Device) -> str:
        """Stable 16-hex-digit hash of this environment on `device`."""
        hw = {k: v for k, v in device.to_dict().items() if k != "short_name"}
        payload = json.dumps({"device": hw, "environment": dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Environment:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls)})


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _driver_version() -> str:
    try:
        import pynvml  # optional (nvidia-ml-py)

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        pass
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return "none"
    m = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+(?:\.\d+)+)", text)
    return m.group(1) if m else "unknown"


def kernel_source_hash(packages: tuple[str, ...] = ("rewy_tune.kernels", "rewy_tune.search_spaces")) -> str:
    """sha256 over the sorted source files of the installed packages, first 16 hex digits."""
    digest = hashlib.sha256()
    for package in packages:
        spec = importlib.util.find_spec(package)
        roots = list(spec.submodule_search_locations or []) if spec else []
        for root in map(Path, roots):
            for path in sorted(root.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(path.read_bytes())
                digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.cache
def current_device(index: int | None = None) -> Device:
    """The GPU torch sees (the current CUDA device by default), or the CPU interpreter device."""
    import torch

    if not torch.cuda.is_available():
        return CPU_DEVICE
    idx = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(idx)
    return Device(
        gpu_name=props.name,
        compute_capability=(props.major, props.minor),
        sm_count=props.multi_processor_count,
        memory_bytes=props.total_memory,
    )


@functools.cache
def current_environment() -> Environment:
    import torch

    on_gpu = torch.cuda.is_available()
    return Environment(
        driver=_driver_version() if on_gpu else "none",
        cuda=(torch.version.cuda or "none") if on_gpu else "none",
        torch=torch.__version__,
        triton=_version("triton"),
        fla_core=_version("fla-core"),
        rewy_tune=_version("rewy-tune"),
        kernel_source_hash=kernel_source_hash(),
    )


def current_fingerprint() -> str:
    return current_environment().fingerprint(current_device())


def resolve_device_name(requested: str, present: Device | None = None) -> Device:
    """Check a CLI `--device` name against the device present; return that device.

    'auto' takes whatever is present; 'cpu' always selects the Triton interpreter.
    """
    present = current_device() if present is None else present
    name = requested.strip().lower()
    if name == "auto":
        return present
    if name in ("cpu", CPU_INTERPRETER):
        return CPU_DEVICE
    if not present.is_cpu and name == present.short_name:
        return present
    accepted = sorted(set(KNOWN_DEVICE_NAMES) | ({present.short_name} - {CPU_INTERPRETER}))
    if name not in accepted:
        raise ValueError(f"--device {requested!r} is not a known device; accepted: auto, {', '.join(accepted)}")
    if present.is_cpu:
        raise ValueError(f"--device {name} needs a GPU but none is present; use --device cpu for the Triton interpreter")
    raise ValueError(f"--device {name} does not match the GPU present: {present.gpu_name} ({present.short_name})")
