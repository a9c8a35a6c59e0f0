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
import json
import os
import platform
import subprocess
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
    """Runnable processes averaged over the last 1, 5 and 15 minutes (2 decimals, as the kernel keeps them):
    on a shared machine, how busy it was while something was timed (record it before and after)."""
    return tuple(round(x, 2) for x in os.getloadavg())


def status_bytes(field: str) -> int:
    """A memory field of this process's ``/proc/self/status`` (Linux), in bytes: ``VmHWM`` is the resident
    set's high-water mark (its peak), ``VmRSS`` the resident set now.

    >>> status_bytes("VmHWM") >= status_bytes("VmRSS") > 0
    True
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


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


def benchmark_header(packages) -> dict:
    """What a benchmark's results record of the machine: CPU model and count, platform, the versions of
    ``packages``, and the load average before the run (add ``"loadavg_after"`` when it ends)."""
    return {"cpu": cpu_model(), "cores": cpus(), "platform": platform.platform(), **versions(packages),
            "loadavg_before": load_average()}


def write_results(out: Path, stem: str, record: dict, markdown, figure) -> str:
    """``out/stem.json`` (the record), ``.md`` (``markdown(record)``) and ``.png`` (``figure(record, path)``);
    returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(record)
    (out / f"{stem}.md").write_text(text)
    figure(record, out / f"{stem}.png")
    return text


def run_json(command: list[str], limit_s: float, explain=lambda last, status: last, **options) -> dict:
    """Run ``command``, a process that prints its result as JSON on its last line, within ``limit_s`` seconds
    (how the scripts in ``benchmarks/`` run each point in a fresh process); ``options`` go to
    ``subprocess.run`` (``env``, ``preexec_fn``). Its JSON, else ``{"error": why}``: the time limit, or
    ``explain(the last line of its stderr, its exit status)`` cut to 300 characters.

    >>> import sys
    >>> run_json([sys.executable, "-c", "print('warming up'); print('{\\"ms\\": 2.5}')"], 60)
    {'ms': 2.5}
    >>> run_json([sys.executable, "-c", "raise SystemExit('out of memory')"], 60)
    {'error': 'out of memory'}
    >>> run_json([sys.executable, "-c", "import sys; sys.exit(3)"], 60, explain=lambda last, status: f"{last}!")
    {'error': 'exit status 3!'}
    >>> run_json([sys.executable, "-c", "import time; time.sleep(5)"], 1)
    {'error': 'did not finish within the 1 s limit'}
    """
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=limit_s, **options)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within the {limit_s:.0f} s limit"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"error": explain(lines[-1] if lines else f"exit status {proc.returncode}", proc.returncode)[:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])
