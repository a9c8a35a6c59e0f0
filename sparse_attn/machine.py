"""Where something ran: package versions, CPUs, CPU model, load average, the GPU; for ``sparse-attn info``,
``sparse-attn bench`` and the scripts in ``benchmarks/``, and how those scripts write and resume their results.

>>> from sparse_attn import machine
>>> machine.versions(["numpy", "no-such-package"])
{'numpy': '...', 'no-such-package': None}
>>> machine.cpus() >= 1 and len(machine.load_average()) == 3
True

Only ``describe``, ``gpu`` and ``cuda_usable`` import torch, when called.
"""
from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
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


def cuda_usable() -> bool:
    """True after a measurement that left CUDA working: frees its memory (garbage, the allocator's cache)
    first; False if an error (an illegal memory access, say) left the CUDA context unusable."""
    import torch

    gc.collect()                                                             # autograd graphs, tracebacks
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.ones(1, device="cuda").item() == 1.0
    except RuntimeError:
        return False


def error_text(error: Exception) -> str:
    """How a benchmark's row records a failure: the error's type and the first line of its message.

    >>> error_text(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\\nCUDA kernel errors ..."))
    'RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB'
    >>> error_text(KeyError())
    'KeyError: '
    """
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


def benchmark_header(packages) -> dict:
    """What a benchmark's results record of the machine: CPU model and count, platform, the versions of
    ``packages``, and the load average before the run (add ``"loadavg_after"`` when it ends)."""
    return {"cpu": cpu_model(), "cores": cpus(), "platform": platform.platform(), **versions(packages),
            "loadavg_before": load_average()}


def write_results(out: Path, stem: str, record: dict, markdown, figure=None) -> str:
    """``out/stem.json`` (the record), ``.md`` (``markdown(record)``) and, unless ``figure`` is None, ``.png``
    (``figure(record, path)``); returns the markdown. Each file is replaced whole: a run killed while writing
    keeps the previous one (and may leave a hidden ``.stem.partial.*`` beside it)."""
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / f"{stem}.json", lambda path: path.write_text(json.dumps(record, indent=1) + "\n"))
    text = markdown(record)
    _replace(out / f"{stem}.md", lambda path: path.write_text(text))
    if figure is not None:
        _replace(out / f"{stem}.png", lambda path: figure(record, path))
    return text


def _replace(path: Path, write) -> None:
    """``write(a path beside path)``, then move that file onto ``path`` (one rename: whole or not at all). The
    path beside keeps the suffix, which matplotlib's ``savefig`` reads the format from."""
    partial = path.with_name(f".{path.stem}.partial{path.suffix}")
    write(partial)
    os.replace(partial, path)


def resumed_rows(path: Path, setup: dict) -> list[dict]:
    """The rows of the results json at ``path`` that ``--resume`` keeps ([] if there is none); exits with a
    message naming each difference if its ``meta`` disagrees with ``setup`` on any of ``setup``'s keys.

    >>> resumed_rows(Path("no-such-results.json"), {"gpu": "NVIDIA H100 80GB HBM3"})
    []
    """
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    differ = [f"{key}: {record['meta'].get(key)!r} there, {value!r} here" for key, value in setup.items()
              if record["meta"].get(key) != value]
    if differ:
        sys.exit(f"--resume: {path} was measured on another set-up ({'; '.join(differ)}). Ratios from two set-ups "
                 f"do not mix: drop --resume to start afresh, or give another --out.")
    return record["rows"]


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
