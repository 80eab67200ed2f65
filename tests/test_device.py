"""Device identity, software fingerprint and the CLI's --device check."""

import dataclasses

import pytest

from rewy_tune import device as device_mod
from rewy_tune.device import CPU_DEVICE, Device, Environment, resolve_device_name, short_name_for

H200 = Device("NVIDIA H200", (9, 0), 132, 150_013_493_248)
ENV = Environment("570.86.15", "12.8", "2.8.0", "3.6.0", "0.6.0", "0.1.0", "0123456789abcdef")


@pytest.mark.parametrize("gpu_name, short", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"),
    ("NVIDIA H20", "h20"), ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA A10G", "a10g"), ("NVIDIA L40S", "l40s"), ("NVIDIA L4", "l4"), ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"), ("NVIDIA RTX A6000", "rtxa6000"), ("AMD Instinct MI300X", "mi300x"),
    ("Quadro Mystery 9", "quadro-mystery-9"), ("cpu-interpreter", "cpu-interpreter"),
])
def test_short_names(gpu_name, short):
    assert short_name_for(gpu_name) == short


def test_cpu_is_the_interpreter_device(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device_mod.current_device.cache_clear()
    try:
        assert device_mod.current_device() == CPU_DEVICE
        assert CPU_DEVICE.short_name == "cpu-interpreter" and CPU_DEVICE.is_cpu
    finally:
        device_mod.current_device.cache_clear()


def test_current_environment_reads_versions_and_kernel_hash():
    env = device_mod.current_environment()
    assert env.torch != "none" and env.rewy_tune != "none"
    assert len(env.kernel_source_hash) == 16 and int(env.kernel_source_hash, 16) >= 0
    assert device_mod.current_environment() is env  # cached


def test_fingerprint_is_stable_and_sensitive():
    assert ENV.fingerprint(H200) == ENV.fingerprint(Device("NVIDIA H200", [9, 0], 132, 150_013_493_248))
    assert len(ENV.fingerprint(H200)) == 16
    assert ENV.fingerprint(H200) != dataclasses.replace(ENV, triton="3.7.0").fingerprint(H200)
    assert ENV.fingerprint(H200) != ENV.fingerprint(dataclasses.replace(H200, sm_count=66))
    assert Device.from_dict(H200.to_dict()) == H200 and Environment.from_dict(ENV.to_dict()) == ENV


def test_resolve_device_name_accepts_the_gpu_present():
    assert resolve_device_name("h200", present=H200) is H200
    assert resolve_device_name(" H200 ", present=H200) is H200
    assert resolve_device_name("auto", present=H200) is H200
    assert resolve_device_name("cpu", present=H200) == CPU_DEVICE
    assert resolve_device_name("cpu", present=CPU_DEVICE) == CPU_DEVICE
    odd = Device("Quadro Mystery 9", (7, 5), 40, 1)
    assert resolve_device_name("quadro-mystery-9", present=odd) is odd


def test_resolve_device_name_mismatch_messages():
    with pytest.raises(ValueError, match=r"^--device h100 does not match the GPU present: NVIDIA H200 \(h200\)$"):
        resolve_device_name("h100", present=H200)
    with pytest.raises(ValueError, match=r"^--device 'tpu' is not a known device; accepted: auto, a10, .*h100.*"):
        resolve_device_name("tpu", present=H200)
    with pytest.raises(ValueError, match="--device a100 needs a GPU but none is present; use --device cpu"):
        resolve_device_name("a100", present=CPU_DEVICE)
