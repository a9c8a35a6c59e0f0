"""The memory benchmark: time and peak memory of attention versus sequence length.

>>> from pathlib import Path
>>> from sparse_attn import bench
>>> from sparse_attn.cli import parse_pattern
>>> patterns = {"longformer": parse_pattern(bench.PATTERNS["longformer"])[0]}
>>> results = bench.sweep(patterns, [1024, 2048], ["sparse_attn-numba", "sdpa-dense"])  # doctest: +SKIP
>>> bench.write(results, Path("bench-out"))  # results.json, results.md, time.png, memory.png  # doctest: +SKIP

Every (pattern, implementation, N) point runs in a fresh ``python -m sparse_attn.bench`` process, so
its memory is its own. In the child, after the imports and after q, k, v exist:

0. a short run of the implementation (N <= 1024) loads its libraries and JIT code;
1. ``setup``: build what the implementation needs from the pattern (a BlockLayout, a dense mask,
   a FlexAttention BlockMask and the compiled kernel, HF's layer), then one warm-up call (JIT and
   compilation happen here, outside the measurement);
2. reset the process high-water mark (``/proc/self/clear_refs``; on CUDA
   ``torch.cuda.reset_peak_memory_stats``), then time ``repeats`` calls. When the warm-up call
   alone took more than a third of ``timeout``, it is the measurement (``"measured"`` says so) and
   the memory is the peak over setup and that call.

``memory_mb`` = peak resident memory during the timed calls minus the resident memory before
``setup``: what the implementation holds (its mask or layout) plus what one call allocates (its
output and working memory), beyond q, k, v. On CUDA it is ``max_memory_allocated`` minus the
allocated memory before ``setup``. ``process_peak_mb`` is the whole child's ``ru_maxrss``
(interpreter, imports and compilation included). A point that raises out-of-memory, is killed, or
runs past ``timeout`` is recorded with that status; larger N of the same line are then skipped.
An implementation that cannot run here (``availability``) is recorded as unavailable with its
reason, checked once before any point runs.

torch is imported inside the functions that use it, so ``sparse-attn --help`` can read the
constants below without paying for it.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from .pattern import Global, Local, Pattern, Union

PATTERNS = {  # label -> PATTERN (expression or preset); the CLI parses these like any PATTERN argument
    "longformer": "Local(256) | Global(first=16)",
    "bigbird-itc": "bigbird-itc",
}
IMPLEMENTATIONS = {
    "sparse_attn-numba": "this library, backend='numba' (CPU kernels), layout built once",
    "sparse_attn-triton": "this library, backend='triton' (CUDA kernels), layout built once",
    "sparse_attn-reference": "this library's oracle: dense scores per chunk of query blocks (slow)",
    "sdpa-dense": "torch scaled_dot_product_attention over all pairs, no mask (the dense compute)",
    "sdpa-masked": "torch scaled_dot_product_attention with the pattern as an N x N bool mask",
    "flex": "torch.compile(flex_attention) with layout.to_block_mask() (same pattern, same blocks)",
    "hf-longformer": "transformers LongformerSelfAttention (with its q/k/v projections), Local|Global only",
}
DEFAULT_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
DEFAULT_IMPLEMENTATIONS = ["sparse_attn-numba", "sdpa-dense", "sdpa-masked", "flex", "hf-longformer"]
QUICK = {"patterns": ["longformer"], "lengths": [1024, 2048, 4096, 8192],
         "backends": ["sparse_attn-numba", "sdpa-dense", "sdpa-masked"], "repeats": 2, "timeout": 60}


# ------------------------------------------------------------------------------------------------
# Implementations (run in the child)
# ------------------------------------------------------------------------------------------------
def availability(name: str, pattern: Pattern, device: str, backward: bool = False) -> tuple[bool, str]:
    """(runs, reason) for implementation ``name`` on ``pattern`` and ``device``, forward or also backward."""
    from . import backends

    if name.startswith("sparse_attn-"):
        backend = name.split("-", 1)[1]
        ok, reason = backends.availability(backend)
        if ok and backend == "triton" and device != "cuda":
            return False, "triton needs a CUDA device"
        if ok and backend == "numba" and device != "cpu":
            return False, "numba runs CPU tensors only"
        return ok, reason
    if name == "flex":
        return _flex_availability(device, backward)
    if name == "hf-longformer":
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            return False, "transformers is not installed: pip install 'sparse-attn[hf]'"
        if _longformer_window(pattern) is None:
            return False, f"HF Longformer has only a symmetric window plus global tokens; {pattern!r} is not"
        return True, ""
    return True, ""


def _flex_availability(device: str, backward: bool) -> tuple[bool, str]:
    import torch

    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return False, f"torch {torch.__version__} has no FlexAttention (needs torch >= 2.5)"
    if backward and device == "cpu":  # torch 2.13 refuses at the call, eager or compiled: ask it with a tiny one
        q = torch.zeros(1, 1, 16, 16, requires_grad=True)                      # (B, H, N, D)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")                                 # "eager flex_attention is slow"
                flex_attention(q, q, q)
        except NotImplementedError as error:
            return False, f"torch {torch.__version__}: {str(error).splitlines()[0]}"
    return True, ""


def unavailable_reasons(patterns: dict[str, Pattern], implementations: list[str], device: str,
                        backward: bool = False) -> dict[tuple[str, str], str]:
    """(pattern label, implementation) -> why it cannot run here, for each pair that cannot."""
    reasons = {}
    for label, pattern in patterns.items():
        for name in implementations:
            ok, reason = availability(name, pattern, device, backward)
            if not ok:
                reasons[(label, name)] = reason
    return reasons


def _longformer_window(pattern: Pattern):
    """(one-sided window, Global or None) when ``pattern`` is ``Local(w)`` or ``Local(w) | Global(...)``."""
    parts = pattern.patterns if isinstance(pattern, Union) else (pattern,)
    local = [p for p in parts if isinstance(p, Local)]
    glob = [p for p in parts if isinstance(p, Global)]
    if len(local) != 1 or len(glob) > 1 or len(local) + len(glob) != len(parts):
        return None
    if local[0].before != local[0].after or local[0].block_size != 1 or local[0].before == 0:
        return None
    return local[0].before, (glob[0] if glob else None)


def _setup(name: str, pattern: Pattern, q, k, v, block_size: int):
    """A function that runs one attention call and returns a tensor (the output)."""
    import torch

    from .api import sparse_attention

    batch, heads, n, head_dim = q.shape
    if name.startswith("sparse_attn-"):
        layout = pattern.layout(n, heads=heads, block_size=block_size)
        backend = name.split("-", 1)[1]
        return lambda: sparse_attention(q, k, v, layout, backend=backend)
    if name == "sdpa-dense":
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if name == "sdpa-masked":
        layout = pattern.layout(n, heads=heads, block_size=block_size)
        mask = layout.to_dense().to(q.device)                                    # (1, H, N, N) bool
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if name == "flex":
        from torch.nn.attention.flex_attention import flex_attention

        block_mask = pattern.layout(n, heads=heads, block_size=block_size).to(q.device).to_block_mask()
        compiled = torch.compile(flex_attention, dynamic=False)  # dynamic-shape C++ fails on CPU
        return lambda: compiled(q, k, v, block_mask=block_mask)
    if name == "hf-longformer":
        return _setup_longformer(pattern, q)
    raise ValueError(f"unknown implementation {name!r}; expected one of {list(IMPLEMENTATIONS)}")


def _setup_longformer(pattern: Pattern, q):
    import torch
    from transformers import LongformerConfig
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    batch, heads, n, head_dim = q.shape
    window, glob = _longformer_window(pattern)
    config = LongformerConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                              attention_window=[2 * window], attention_probs_dropout_prob=0.0)
    layer = LongformerSelfAttention(config, layer_id=0).to(q.device).eval()
    hidden = torch.randn(batch, n, heads * head_dim, device=q.device, requires_grad=q.requires_grad)  # (B, N, H*D)
    is_global = torch.zeros(batch, n, dtype=torch.bool, device=q.device)
    if glob is not None:
        is_global[:, torch.from_numpy(glob.positions(n))] = True  # the pattern's own positions
    mask = is_global.to(q.dtype) * 10000.0                                       # HF: +10000 global, 0 local
    is_masked = torch.zeros_like(is_global)
    return lambda: layer(hidden, attention_mask=mask, is_index_masked=is_masked, is_index_global_attn=is_global,
                         is_global_attn=bool(is_global.any()))[0]


# ------------------------------------------------------------------------------------------------
# One point (the child process)
# ------------------------------------------------------------------------------------------------
def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status ("VmRSS": resident now, "VmHWM": its high-water mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _is_oom(message: str) -> bool:
    return "memory" in message.lower() or "alloc" in message.lower()


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(point: dict) -> dict:
    """Time and memory of one (pattern, implementation, N) point, in this process."""
    import torch

    name, n, device = point["implementation"], point["n"], point["device"]
    backward = point["backward"]
    pattern = Pattern.from_dict(point["pattern"])
    torch.manual_seed(0)
    cuda = device == "cuda"

    def call(fn):
        out = fn()
        if backward:
            out.backward(torch.ones_like(out))
        if cuda:
            torch.cuda.synchronize()

    def inputs(length):  # q, k, v: (B, H, N, D)
        shape = (point["batch"], point["heads"], length, point["head_dim"])
        return [torch.randn(shape, device=device, requires_grad=backward) for _ in range(3)]

    # load libraries and JIT code with a short run first, so they stay out of the measurement
    call(_setup(name, pattern, *inputs(min(n, 1024)), point["block_size"]))
    q, k, v = inputs(n)
    before = torch.cuda.memory_allocated() / 2**20 if cuda else _status_mb("VmRSS")
    reset_peak = torch.cuda.reset_peak_memory_stats if cuda else _reset_high_water
    reset_peak()
    fn = _setup(name, pattern, q, k, v, point["block_size"])
    start = time.perf_counter()
    call(fn)
    first_s = time.perf_counter() - start
    if first_s > point["timeout"] / 3:  # too slow to repeat: the warm-up call is the measurement
        times, timed = [first_s], "warm-up call (setup included in memory)"
    else:
        reset_peak()
        times, timed = [], "calls after the warm-up"
        for _ in range(point["repeats"]):
            start = time.perf_counter()
            call(fn)
            times.append(time.perf_counter() - start)
            if sum(times) + first_s > point["timeout"] / 3:  # enough to know; leave time for the rest
                break
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else _status_mb("VmHWM")
    return {"status": "ok", "time_s": statistics.median(times), "times_s": times, "first_call_s": first_s,
            "measured": timed, "memory_mb": peak - before,
            "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _child() -> None:
    import torch

    point = json.loads(sys.argv[1])
    if point["device"] == "cpu" and point.get("threads"):
        torch.set_num_threads(point["threads"])
    try:
        result = measure(point)
    except (torch.OutOfMemoryError, MemoryError) as error:
        result = {"status": "oom", "error": str(error).splitlines()[0][:300]}
    except RuntimeError as error:
        message = str(error)
        result = {"status": "oom" if _is_oom(message) else "error", "error": message.splitlines()[0][:300]}
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------
# The sweep (the parent)
# ------------------------------------------------------------------------------------------------
def run_point(point: dict) -> dict:
    """Run one point in a fresh process; out-of-memory, crashes and time-outs become a status."""
    limit = int(point["memory_limit_gb"] * 2**30) if point.get("memory_limit_gb") else None

    def preexec():  # address-space cap: allocations past it fail in the child, not in the neighbours
        if limit:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}  # numba's BLAS calls run inside its own worker threads
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "sparse_attn.bench", json.dumps(point)], capture_output=True,
                              text=True, timeout=point["timeout"], env=env, preexec_fn=preexec)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"ran past {point['timeout']} s"}
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return {**json.loads(lines[-1][len("RESULT "):]), "wall_s": wall}
    if proc.returncode in (-9, 137):
        return {"status": "oom", "error": "killed (SIGKILL, most likely the out-of-memory killer)"}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return {"status": "oom" if _is_oom(tail[0]) else "error", "error": tail[0][:300]}


def versions(packages) -> dict[str, str | None]:
    """Installed version of each package, None where it is not installed."""
    import importlib.metadata as metadata

    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def cpus() -> int:
    """CPUs this process may run on (its affinity, which a container may limit)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def machine() -> dict:
    """Where and with what the sweep ran."""
    import torch

    info = {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpus": cpus(), "python": platform.python_version(),
            "versions": versions(("torch", "numba", "triton", "transformers", "sparse-attn")),
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def sweep(patterns: dict[str, Pattern], lengths: list[int], implementations: list[str], *, batch: int = 1,
          heads: int = 8, head_dim: int = 64, block_size: int = 64, backward: bool = False, repeats: int = 3,
          timeout: float = 120, memory_limit_gb: float | None = None, device: str = "cpu",
          command: str = "", progress: bool = True, out: Path | None = None,
          unavailable: dict[tuple[str, str], str] | None = None) -> dict:
    """Run every (pattern, implementation, N) point; returns (and, with ``out``, keeps saving) the results.

    ``unavailable`` is what ``unavailable_reasons`` returned, when the caller already asked.
    """
    if unavailable is None:
        unavailable = unavailable_reasons(patterns, implementations, device, backward)
    results = {"command": command, "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
               "load_average_start": os.getloadavg(),
               "config": {"batch": batch, "heads": heads, "head_dim": head_dim, "block_size": block_size,
                          "dtype": "float32", "device": device, "backward": backward, "repeats": repeats,
                          "timeout_s": timeout, "memory_limit_gb": memory_limit_gb},
               "patterns": {label: repr(p) for label, p in patterns.items()},
               "implementations": {name: IMPLEMENTATIONS[name] for name in implementations}, "points": []}
    planned = [(label, name, n) for label in patterns for name in implementations for n in sorted(lengths)]
    stopped: dict[tuple[str, str], str] = {}
    for label, name, n in _progress(planned, progress):
        point = {"pattern_label": label, "implementation": name, "n": n}
        if (label, name) in unavailable:
            result = {"status": "unavailable", "error": unavailable[(label, name)]}
        elif (label, name) in stopped:
            result = {"status": "skipped", "error": stopped[(label, name)]}
        else:
            result = run_point({**point, "pattern": patterns[label].to_dict(), "batch": batch, "heads": heads,
                                "head_dim": head_dim, "block_size": block_size, "backward": backward,
                                "repeats": repeats, "timeout": timeout, "device": device,
                                "memory_limit_gb": memory_limit_gb})
            if result["status"] in ("oom", "timeout"):
                stopped[(label, name)] = f"{result['status']} at N={n}"
        results["points"].append({**point, **result})
        if out is not None:
            _write_json(results, out)
    results["load_average_end"] = os.getloadavg()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if out is not None:
        _write_json(results, out)
    return results


def _progress(planned: list[tuple[str, str, int]], show: bool):
    """The planned points, with a tqdm bar on stderr when ``show`` (tqdm is only needed then)."""
    if not show:
        yield from planned
        return
    from tqdm import tqdm

    bar = tqdm(planned, desc="bench", unit="point", file=sys.stderr)
    for label, name, n in bar:
        bar.set_postfix_str(f"{label} {name} N={n}")
        yield label, name, n


# ------------------------------------------------------------------------------------------------
# Outputs
# ------------------------------------------------------------------------------------------------
def _write_json(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def markdown(results: dict) -> str:
    """The results as a markdown page: config, machine, then one table per pattern."""
    config, info = results["config"], results["machine"]
    load = results.get("load_average_end", results["load_average_start"])
    lines = ["# Attention time and memory versus sequence length", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {info['machine']}, {info['cpus']} CPUs, {info['platform']}, Python {info['python']}, "
             + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
             + (f", GPU {info['gpu']}" if "gpu" in info else "") + f" (load average {load[0]:.1f} at the end).", "",
             f"B={config['batch']}, H={config['heads']}, D={config['head_dim']}, {config['dtype']} on "
             f"{config['device']}, block {config['block_size']}, {'forward + backward' if config['backward'] else 'forward'}; "
             f"time = median of up to {config['repeats']} calls after a warm-up call; memory = peak resident memory "
             f"during the calls minus the resident memory before setting the implementation up (beyond q, k, v; "
             f"its mask or layout, output and working memory included). Each point ran in a fresh process.", ""]
    lines += [tables(results), "## Implementations", ""]
    lines += [f"- `{k}`: {v}" for k, v in results["implementations"].items()]
    return "\n".join(lines) + "\n"


LEGEND = ("Cells: time (s) / memory (MB); `*` = too slow to repeat, the warm-up call was measured (its memory "
          "includes the set-up); `oom` = out of memory, `timeout` = ran past the time limit, `error` = failed, "
          "`-` = skipped after `oom` or `timeout` at a smaller N, `n/a` = cannot run here; `[k]` = the reason, "
          "under the table.")


def tables(results: dict) -> str:
    """One markdown table per pattern (implementations x sequence lengths), the reasons for its
    n/a, oom, timeout and error cells under it, then the legend of the cells.
    """
    lines = []
    for label, expression in results["patterns"].items():
        points = [p for p in results["points"] if p["pattern_label"] == label]
        lengths = sorted({p["n"] for p in points})
        lines += [f"## {label}: `{expression.replace('|', chr(92) + '|')}`", "",
                  "| implementation | " + " | ".join(f"{n:,}" for n in lengths) + " |",
                  "|---|" + "---:|" * len(lengths)]
        notes: dict[str, int] = {}  # reason -> its number under this table
        for name in results["implementations"]:
            cells = {p["n"]: _cell(p, notes) for p in points if p["implementation"] == name}
            lines.append(f"| {name} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
        lines += [""] + [f"- [{number}] {reason}" for reason, number in notes.items()] + ([""] if notes else [])
    return "\n".join(lines + [LEGEND, ""])


def _cell(point: dict, notes: dict[str, int]) -> str:
    """The table cell of one point; a failure's reason goes into ``notes`` and the cell points at it."""
    status = point["status"]
    if status == "ok":
        single = point.get("measured", "").startswith("warm-up")
        return f"{point['time_s']:.3g} / {point['memory_mb']:,.0f}" + ("*" if single else "")
    if status == "skipped":
        return "-"
    shown = "n/a" if status == "unavailable" else status
    reason = f"`{point['implementation']}` {shown}: {point.get('error') or 'no reason recorded'}"
    return f"{shown} [{notes.setdefault(reason, len(notes) + 1)}]"


def write(results: dict, out: Path) -> list[Path]:
    """results.json, results.md, time.png and memory.png under ``out``; returns their paths."""
    from . import viz

    _write_json(results, out)
    (out / "results.md").write_text(markdown(results))
    paths = [out / "results.json", out / "results.md"]
    for metric in ("time", "memory"):
        figure = viz.plot_bench(results, metric)
        figure.savefig(out / f"{metric}.png", dpi=110, bbox_inches="tight")
        paths.append(out / f"{metric}.png")
    return paths


if __name__ == "__main__":
    _child()
