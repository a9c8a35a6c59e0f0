"""Where something ran: package versions, CPUs, CPU model, load average; for ``sparse-attn info``,
``sparse-attn bench`` and the scripts in ``benchmarks/``.

>>> from sparse_attn import machine
>>> machine.versions(["numpy", "no-such-package"])
{'numpy': '...', 'no-such-package': None}
>>> machine.cpus() >= 1 and len(machine.load_average()) == 3
True

Only ``describe`` imports torch (for its thread count and GPU), when called.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path


def versions(packages) -> dict[str, str | None]:
    """Installed version of each package (by its distribution name), None where it is not installed."""
    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def cpus() -> int:
    """CPUs this process may run on (its affinity, which a container may limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows, else ``"unknown"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> tuple[float, float, float]:
    """Runnable processes averaged over the last 1, 5 and 15 minutes: on a shared machine, how busy
    it was while something was timed (record it before and after)."""
    return os.getloadavg()


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
