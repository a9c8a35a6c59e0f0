"""Points measured in fresh processes, for ``sparse-attn bench`` and every script in ``benchmarks/``.

``run_json(command, limit_s)`` runs a process that prints its result as JSON on its last line, under a time
limit and optionally an address-space limit, and turns a time-out, out-of-memory or a crash into a status:
the one way a benchmark runs something in a fresh process, so that its memory is its own. ``cuda_usable``
says whether a point left CUDA working (the GPU scripts stop when it did not).

``sparse-attn bench``'s points: the parent calls ``run_point(point)``, which runs ``python -m sparse_attn.bench
POINT_JSON`` (the package's ``__main__``, which calls ``child``). In the child, after the imports and after
q, k, v exist:

0. a short run of the implementation (N <= 1024) loads its libraries and JIT code;
1. ``setup``: build what the implementation needs from the pattern (a BlockLayout, a dense mask,
   a FlexAttention BlockMask and the compiled kernel, HF's layer; see ``peers``), then one warm-up call (JIT and
   compilation happen here, outside the measurement);
2. reset the process high-water mark (``machine.reset_peak_rss``; on CUDA
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
import math
import os
import resource
import statistics
import subprocess
import sys
import time

from .. import machine
from ..pattern import Pattern
from .implementations import setup


# ------------------------------------------------------------------------------------------------
# The parent
# ------------------------------------------------------------------------------------------------
def run_json(command: list[str], limit_s: float | None = None, *, memory_gib: float | None = None,
             env: dict[str, str] | None = None) -> dict:
    """Run ``command``, a process that prints its result as JSON on its last line of stdout, within ``limit_s``
    seconds (None: no limit) and, with ``memory_gib``, that much address space (allocations past it fail in the
    process, not in its neighbours); ``env``: variables set on top of this process's environment.

    Its JSON (also when it died after printing it), else ``{"status": "timeout" | "oom" | "error", "error":
    why}``: the time limit; SIGKILL (the out-of-memory killer); or the last line of its stderr (or its exit
    status), "oom" where that line speaks of memory or allocation. Cut to 300 characters.

    >>> import sys
    >>> run_json([sys.executable, "-c", "print('warming up'); print('{\\"ms\\": 2.5}')"], 60)
    {'ms': 2.5}
    >>> run_json([sys.executable, "-c", "raise SystemExit('out of memory')"], 60, memory_gib=8)
    {'status': 'oom', 'error': 'out of memory under the 8 GiB limit: out of memory'}
    >>> run_json([sys.executable, "-c", "import sys; sys.exit(3)"], 60)
    {'status': 'error', 'error': 'exit status 3'}
    >>> run_json([sys.executable, "-c", "import time; time.sleep(5)"], 1)
    {'status': 'timeout', 'error': 'did not finish within the 1 s limit'}
    """
    def limit_memory():  # in the child, before it runs command
        size = int(memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (size, size))

    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=limit_s,
                              env={**os.environ, **(env or {})}, preexec_fn=limit_memory if memory_gib else None)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"did not finish within the {limit_s:g} s limit"}
    printed = proc.stdout.strip().splitlines()
    try:
        result = json.loads(printed[-1]) if printed else None
    except json.JSONDecodeError:
        result = None
    if isinstance(result, dict):
        return result
    if proc.returncode in (-9, 137):
        status, why = "oom", "killed (SIGKILL, most likely the out-of-memory killer)"
    else:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {proc.returncode}"
        status = "oom" if _is_oom(why) else "error"
    if status == "oom" and memory_gib:
        why = f"out of memory under the {memory_gib:g} GiB limit: {why}"
    return {"status": status, "error": why[:300]}


def _is_oom(message: str) -> bool:
    return "memory" in message.lower() or "alloc" in message.lower()


def run_point(point: dict) -> dict:
    """One ``sparse-attn bench`` point in a fresh process (``child``), with its wall time; out-of-memory,
    crashes and time-outs become its status."""
    start = time.perf_counter()
    result = run_json([sys.executable, "-m", "sparse_attn.bench", json.dumps(point)], point["timeout"],
                      memory_gib=point.get("memory_limit_gb"),
                      env={"OPENBLAS_NUM_THREADS": "1"})  # numba's BLAS calls run inside its own worker threads
    return {**result, "wall_s": time.perf_counter() - start}


def cuda_usable() -> bool:
    """True after a measurement that left CUDA working: frees its memory (garbage, the allocator's cache)
    first; False if an error (an illegal memory access, say) left the CUDA context unusable."""
    import gc

    import torch

    gc.collect()                                                             # autograd graphs, tracebacks
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.ones(1, device="cuda").item() == 1.0
    except RuntimeError:
        return False


# ------------------------------------------------------------------------------------------------
# The child
# ------------------------------------------------------------------------------------------------
def child() -> None:
    """Measure the point given as JSON in ``sys.argv[1]``; print the result as JSON, the last line, for the parent."""
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
    print(json.dumps(result), flush=True)


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
    warm_q, warm_k, warm_v = inputs(min(n, 1024))
    call(setup(name, pattern, warm_q, warm_k, warm_v, point["block_size"]))
    q, k, v = inputs(n)
    before = (torch.cuda.memory_allocated() if cuda else machine.status_bytes("VmRSS")) / 2**20
    reset_peak = torch.cuda.reset_peak_memory_stats if cuda else machine.reset_peak_rss
    reset_peak()
    fn = setup(name, pattern, q, k, v, point["block_size"])
    start = time.perf_counter()
    call(fn)
    first_s = time.perf_counter() - start
    budget = (point["timeout"] or math.inf) / 3                             # None: no limit (the sweep's warm-up)
    if first_s > budget:  # too slow to repeat: the warm-up call is the measurement
        times, timed = [first_s], "warm-up call (setup included in memory)"
    else:
        reset_peak()
        times, timed = [], "calls after the warm-up"
        for _ in range(point["repeats"]):
            start = time.perf_counter()
            call(fn)
            times.append(time.perf_counter() - start)
            if sum(times) + first_s > budget:  # enough to know; leave time for the rest
                break
    peak = (torch.cuda.max_memory_allocated() if cuda else machine.status_bytes("VmHWM")) / 2**20
    return {"status": "ok", "time_s": statistics.median(times), "times_s": times, "first_call_s": first_s,
            "measured": timed, "memory_mb": peak - before,
            "process_peak_mb": machine.process_peak_bytes() / 2**20}
