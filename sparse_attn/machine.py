"""Where something ran: package versions, CPUs, CPU model, load average, the GPU and its driver, and this
process's memory; for ``sparse-attn info``, ``sparse-attn bench`` and the scripts in ``benchmarks/``. (How a
benchmark runs, measures and writes is ``sparse_attn.bench``'s job.)

>>> from sparse_attn import machine
>>> machine.versions(["numpy", "no-such-package"])
{'numpy': '...', 'no-such-package': None}
>>> machine.cpus() >= 1 and len(machine.load_average()) == 3
True

Only ``describe`` and ``gpu`` import torch, when called.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import resource
import subprocess
from pathlib import Path


def versions(packages) -> dict[str, str | None]:
    """Installed version of each package (by its distribution name), None where it is not installed."""
    found: dict[str, str | None] = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def cpus() -> int:
    """CPUs this process may run on (its affinity, which a container may limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows, else ``"unknown"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


_KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the CPU kernels' paths


def cpu_kind() -> str:
    """What tells CPUs of one model name apart (an "AMD EPYC" may be a Zen 3 without AVX-512 or a Zen 5 with
    it): ``/proc/cpuinfo``'s family and model and which of avx2, avx512f, avx512_bf16 and amx_bf16 it has,
    e.g. ``"family 26 model 2: avx2 avx512f avx512_bf16"``; ``""`` where there is no /proc/cpuinfo."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
    except OSError:
        return ""
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return (f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}: "
            + " ".join(flag for flag in _KIND_FLAGS if flag in flags))


def load_average() -> tuple[float, float, float]:
    """Runnable processes averaged over the last 1, 5 and 15 minutes (2 decimals, as the kernel keeps them):
    on a shared machine, how busy it was while something was timed (record it before and after)."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def status_bytes(field: str) -> int:
    """A memory field of this process's ``/proc/self/status`` (Linux), in bytes: ``VmHWM`` is the resident
    set's high-water mark (its peak), ``VmRSS`` the resident set now.

    >>> status_bytes("VmHWM") >= status_bytes("VmRSS") > 0
    True
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> None:
    """Reset this process's resident high-water mark (``VmHWM``) to the resident set now (Linux,
    ``/proc/self/clear_refs``), so that a later ``status_bytes("VmHWM")`` is the peak since this call.

    >>> reset_peak_rss(); status_bytes("VmHWM") >= status_bytes("VmRSS")
    True
    """
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def process_peak_bytes() -> int:
    """The largest resident set this process has had (``ru_maxrss``: interpreter and imports included), in
    bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def describe() -> dict:
    """Platform, CPUs, Python, versions of the packages that decide the speed, torch's threads, the GPU."""
    import torch

    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": cpus(), "python": platform.python_version(),
            "versions": versions(("torch", "numba", "triton", "transformers", "sparse-attn")),
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version, e.g. ``"550.54.15"``, from ``nvidia-smi`` (the first GPU's); None where it
    cannot be run (no NVIDIA GPU, no driver)."""
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return next(iter(smi.stdout.split()), None)


def gpu() -> dict:
    """``{"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "driver": "550.54.15", "cuda": "12.8"}``: the
    CUDA GPU this process runs on (torch's current device), its memory, the driver (None where ``nvidia-smi``
    cannot be run) and the CUDA version torch was built with. Needs a CUDA GPU."""
    import torch

    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": properties.name, "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
            "driver": nvidia_driver(), "cuda": torch.version.cuda}
