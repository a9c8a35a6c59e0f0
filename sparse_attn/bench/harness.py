"""One (pattern, implementation, N) point, measured in a fresh process so that its memory is its own.

The parent calls ``run_point(point)``, which starts ``python -m sparse_attn.bench POINT_JSON`` (the
package's ``__main__``, which calls ``child``) and reads the result back. In the child, after the
imports and after q, k, v exist:

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
runs past ``timeout`` comes back with that status instead of a measurement.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from ..pattern import Pattern
from .implementations import setup


# ------------------------------------------------------------------------------------------------
# The parent
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


def _is_oom(message: str) -> bool:
    return "memory" in message.lower() or "alloc" in message.lower()


# ------------------------------------------------------------------------------------------------
# The child
# ------------------------------------------------------------------------------------------------
def child() -> None:
    """Measure the point given as JSON in ``sys.argv[1]``; print ``RESULT {...}`` for the parent."""
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
    call(setup(name, pattern, *inputs(min(n, 1024)), point["block_size"]))
    q, k, v = inputs(n)
    before = torch.cuda.memory_allocated() / 2**20 if cuda else _status_mb("VmRSS")
    reset_peak = torch.cuda.reset_peak_memory_stats if cuda else _reset_high_water
    reset_peak()
    fn = setup(name, pattern, q, k, v, point["block_size"])
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


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status ("VmRSS": resident now, "VmHWM": its high-water mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def _reset_high_water() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
