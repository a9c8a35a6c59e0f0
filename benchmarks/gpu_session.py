"""The GPU runs behind the Triton backend's numbers, in stages that each fit one 10-minute call on a lent GPU.

    python benchmarks/gpu_session.py check     # ~1 min: the GPU, driver, versions, clocks; the two ceilings
    python benchmarks/gpu_session.py tests     # <= 9 min: the test suite on the GPU (-n 12), log + summary
    python benchmarks/gpu_session.py tune      # <= 8 min: benchmarks/triton_tune.py --resume (launch settings)
    python benchmarks/gpu_session.py bench     # <= 8 min: benchmarks/gpu_kernels.py --resume (targets first)
    python benchmarks/gpu_session.py profile   # ~2 min: torch.profiler of triton and FlexAttention at N=32K
    python benchmarks/gpu_session.py decode    # ~1 min: a SparseKVCache decode step against SDPA over the held keys
    python benchmarks/gpu_session.py all       # <= 8 min: check, the targets, 1M, decode, tests, triton's profile
    python benchmarks/gpu_session.py fair      # ~6 min: the peers' knobs (flex-64, autotuned flex), Flex on our
                                               # exported BlockMask vs create_block_mask, decode (--resume of all)
    python benchmarks/gpu_session.py autotune  # ~4 min: flex-64-max (autotuned, the only flex-64 with a backward)
    python benchmarks/gpu_session.py tests --dry-run     # print the commands, run nothing (no GPU needed)

Every stage writes into ``--out`` (default: ``$OUT``, the folder a GPU machine lent by the device tool
sends back): at most four files a stage. ``tune`` and ``bench`` first copy their committed rows
(``benchmarks/results/triton_tune.json``, ``gpu_kernels.json``) there and run with ``--resume``, so a
second call goes on where the first stopped once its files are copied back into ``benchmarks/results/``
(and committed: the device machine keeps nothing between calls). A stage's
commands run in order; the stage's exit status is the first non-zero one, and it still runs the rest,
so a failing test run leaves its log.

On a GPU the machine sends back only the end of the output, so every stage ends with a short summary.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PYTHON = sys.executable
RESUMED = {"tune": "triton_tune.json", "bench": "gpu_kernels.json", "fair": "gpu_kernels.json",
           "autotune": "gpu_kernels.json"}  # a stage's rows, kept by its --resume

def check(out: Path) -> None:
    """The GPU as found (nvidia-smi: driver, clocks, temperature) and the two ceilings every kernel is judged
    against, measured: memory bandwidth and the bf16 matmul rate. Printed and written to gpu_check.txt."""
    import torch
    import triton
    from triton.testing import do_bench

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                          "temperature.gpu,power.draw", "--format=csv"], capture_output=True, text=True)
    props = torch.cuda.get_device_properties(0)
    lines = [smi.stdout.strip() or smi.stderr.strip(),
             f"{props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB, "
             f"L2 {props.L2_cache_size / 2**20:.0f} MiB; torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"triton {triton.__version__}"]
    src = torch.randn(2**28, device="cuda", dtype=torch.bfloat16)                          # 512 MiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    lines.append(f"device-to-device copy: {2 * src.numel() * src.element_size() / ms / 1e6:.0f} GB/s "
                 f"(read + written, median)")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = do_bench(lambda: a @ b, return_mode="median")
    lines.append(f"bf16 8192^3 matmul: {2 * 8192**3 / ms / 1e9:.0f} TFLOP/s (random data, median)")
    (out / "gpu_check.txt").write_text("\n".join(lines) + "\n")
    print(*lines, sep="\n")


def profile(out: Path, n: int = 32768, heads: int = 16, flex: bool = True) -> None:
    """Where the time of forward+backward goes: CUDA kernels of triton and (``flex``) of FlexAttention (block
    128), the peers of ``sparse_attn.bench.peers`` as gpu_kernels.py runs them, on the Longformer pattern at the
    target length, warm, three steps each; the tables go to gpu_profile.txt."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sys.path.insert(0, str(REPO))
    import sparse_attn as sa
    from sparse_attn.bench import peers

    pattern = sa.Local(256) | sa.Global(first=16)
    layout = pattern.layout(n, heads=heads).to("cuda")
    flex_layout = pattern.layout(n, heads=heads, block_size=128).to("cuda")
    tables = []
    for head_dim in (64, 128):
        q, k, v = (torch.randn(1, heads, n, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))                                                       # (B, H, N, D)
        grad_out = torch.randn_like(q)
        runs = {"triton": peers.sparse_attn(q, k, v, layout, backend="triton")}
        if flex:
            runs["flex-128"] = peers.flex(q, k, v, flex_layout)                             # compiled for this D
        for name, forward in runs.items():
            for _ in range(2):                                                              # compile, warm up
                forward().backward(grad_out)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    forward().backward(grad_out)
                torch.cuda.synchronize()
            tables.append(f"## {name}: Longformer, N={n}, B=1, H={heads}, D={head_dim}, bf16, forward+backward x3\n\n"
                          + prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    (out / "gpu_profile.txt").write_text("\n\n".join(tables) + "\n")
    print("\n\n".join(tables))


def profile_triton(out: Path) -> None:
    """``profile`` of triton alone (no FlexAttention compile: the ``all`` stage's budget)."""
    profile(out, flex=False)


def decode(out: Path, context: int = 65536, steps: int = 50) -> None:
    """One decode step with ``SparseKVCache(Local(4095, 0) | Sink(first=4), backend="triton")`` on the GPU (B=8,
    8 query / 2 key-value heads, D=64, bf16) after ``context`` tokens, against dense SDPA (GQA) over exactly the
    keys the cache holds, and the attention of the step alone (``cache.attention`` on the held keys, no update).
    Medians of ``steps`` steps, wall clock with the GPU synchronised; written to gpu_decode.txt."""
    import statistics

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    sys.path.insert(0, str(REPO))
    import sparse_attn as sa
    from sparse_attn.kv_cache import SparseKVCache

    batch, q_heads, kv_heads, dim, chunk = 8, 8, 2, 64, 8192
    cache = SparseKVCache(sa.Local(4095, 0) | sa.Sink(first=4), backend="triton")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(heads, n):
        return torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)

    for _ in range(context // chunk):
        cache.update(randn(kv_heads, chunk), randn(kv_heads, chunk))
    step_s, attend_s = [], []
    for i in range(steps + 5):
        q, k, v = randn(q_heads, 1), randn(kv_heads, 1), randn(kv_heads, 1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        cache.attend(q, k, v)
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
    keys, values, positions = cache.update(randn(kv_heads, 1), randn(kv_heads, 1))
    q = randn(q_heads, 1)
    for i in range(steps + 5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        cache.attention(q, keys, values, positions)
        torch.cuda.synchronize()
        attend_s.append(time.perf_counter() - start)
    sdpa_ms = do_bench(lambda: F.scaled_dot_product_attention(q, keys, values, enable_gqa=True),
                       return_mode="median")
    step_ms, attend_ms = (1e3 * statistics.median(t[5:]) for t in (step_s, attend_s))
    lines = [f"decode after {context} tokens, B={batch}, {q_heads} q / {kv_heads} kv heads, D={dim}, bf16, "
             f"Local(4095, 0) | Sink(first=4): {keys.shape[2]} keys held",
             f"SparseKVCache step (update + attention): {step_ms:.3f} ms median of {steps}",
             f"attention over the held keys alone (cache.attention): {attend_ms:.3f} ms",
             f"SDPA (enable_gqa) over the held keys: {sdpa_ms:.3f} ms (do_bench median)",
             f"step / SDPA: {step_ms / sdpa_ms:.2f}x; attention / SDPA: {attend_ms / sdpa_ms:.2f}x (target <= 1.5x)"]
    (out / "gpu_decode.txt").write_text("\n".join(lines) + "\n")
    print(*lines, sep="\n")


def flex_export(out: Path, n: int = 32768, heads: int = 16) -> None:
    """FlexAttention on ``layout.to_block_mask()`` (block lists from the layout, the pattern's own predicate)
    against ``create_block_mask`` of the same predicate, compiled, as a FlexAttention user builds it: the block
    lists and outputs are compared, and both the build and the compiled forward timed (Longformer and the causal
    sliding window, block 128, bf16, D=64, B=1). Written to gpu_flex_export.txt."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from triton.testing import do_bench

    sys.path.insert(0, str(REPO))
    import sparse_attn as sa
    from sparse_attn.bench import peers

    lines = [f"FlexAttention, N={n}, H={heads}, D=64, bf16, block 128: layout.to_block_mask() vs "
             f"create_block_mask(pattern.mask_mod(...), _compile=True)"]
    q, k, v = (torch.randn(1, heads, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for name, pattern in (("longformer", sa.Local(256) | sa.Global(first=16)),
                          ("sliding-causal", sa.Local(1023, 0) & sa.Causal())):
        layout = pattern.layout(n, heads=heads, block_size=128).to("cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        exported = layout.to_block_mask()
        torch.cuda.synchronize()
        export_s = time.perf_counter() - start
        start = time.perf_counter()
        made = create_block_mask(pattern.mask_mod(n, n, heads, device="cuda"), None, None, n, n, device="cuda",
                                 BLOCK_SIZE=128, _compile=True)
        torch.cuda.synchronize()
        made_s = time.perf_counter() - start
        same_blocks = torch.equal(exported.to_dense().expand_as(made.to_dense()), made.to_dense()) and torch.equal(
            exported.full_kv_num_blocks.expand_as(made.full_kv_num_blocks), made.full_kv_num_blocks)
        times, outs = [], []
        for block_mask in (exported, made):
            flex = peers.compiled_flex()
            with torch.no_grad():
                outs.append(flex(q, k, v, block_mask=block_mask))
                times.append(do_bench(lambda: flex(q, k, v, block_mask=block_mask), return_mode="median"))
        lines.append(f"{name}: build {export_s * 1e3:.1f} ms (export) vs {made_s * 1e3:.0f} ms (create_block_mask, "
                     f"compile included); same block lists: {same_blocks}; outputs max |diff| "
                     f"{(outs[0].float() - outs[1].float()).abs().max().item():.3g}; forward {times[0]:.3f} ms vs "
                     f"{times[1]:.3f} ms (exported / created: {times[0] / times[1]:.3f})")
    (out / "gpu_flex_export.txt").write_text("\n".join(lines) + "\n")
    print(*lines, sep="\n")


_ENDED = re.compile(r"\[gw\d+\] \[ *\d+%\] ([A-Z]+) (\S+)")  # a -v line of pytest-xdist: "[gw3] [  5%] PASSED tests/..."


def pytest_summary(out: Path) -> None:
    """gpu_pytest_summary.txt from the -v log of the ``tests`` stage, printed too: the tests that failed or
    errored, each outcome's count, and the pytest-xdist workers that crashed (a finished run's own summary line
    comes last)."""
    log = (out / "gpu_pytest.log").read_text(errors="replace").splitlines()
    ended = [match.groups() for match in map(_ENDED.match, log) if match]                       # (outcome, test)
    failed = sorted({test for outcome, test in ended if outcome in ("FAILED", "ERROR")})
    counts = "  ".join(f"{outcome} {sum(o == outcome for o, _ in ended)}"
                       for outcome in ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL"))
    crashes = sum("node down" in line for line in log)
    finished = [line for line in log if line.startswith("=") and (" passed" in line or " failed" in line)]
    lines = [*(f"failed: {test}" for test in failed), counts, f"workers crashed: {crashes}", *finished[-1:]]
    (out / "gpu_pytest_summary.txt").write_text("\n".join(lines) + "\n")
    print(*lines, sep="\n")


def stages(out: Path) -> dict[str, list]:
    """Each stage's steps writing into ``out``: commands (argument lists, run from the repository root) or
    functions of this module called with ``out``."""
    pytest_log = shlex.quote(str(out / "gpu_pytest.log"))
    # the whole suite, 12 workers of 2 numba/torch threads on the 16 cores; -v names each test as it ends, so the
    # log says what ran even where the time limit stops it
    suite = shlex.join([PYTHON, "-m", "pytest", "-n", "12", "-v", "-rfEs", "--timeout", "300", "-p", "no:cacheprovider"])
    kernels = [PYTHON, "benchmarks/gpu_kernels.py", "--resume", "--out", str(out)]
    quick_tests = shlex.join([PYTHON, "-m", "pytest", "-q", "-rs", "-n", "12", "--timeout", "130", "-p",
                              "no:cacheprovider", "tests/test_triton_backend.py", "tests/test_nn.py",
                              "tests/test_work_split.py"])
    return {
        "check": [check],
        "tests": [["bash", "-c", f"NUMBA_NUM_THREADS=2 OMP_NUM_THREADS=2 timeout 520 {suite} > {pytest_log} 2>&1"],
                  pytest_summary],
        "tune": [[PYTHON, "benchmarks/triton_tune.py", "--resume", "--budget-s", "480", "--out", str(out)]],
        "bench": [[PYTHON, "benchmarks/gpu_kernels.py", "--resume", "--budget-s", "480", "--out", str(out)]],
        "profile": [profile],
        "decode": [decode],
        "fair": [check, decode, [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kv_cache.py", "-k",
                                 "triton"],
                 flex_export,
                 [*kernels, "--n", "32768", "--head-dim", "64", "128", "--impls", "flex-64", "--no-million",
                  "--budget-s", "100"],
                 [*kernels, "--n", "32768", "--head-dim", "64", "128", "--impls", "flex-128-max", "--patterns",
                  "sliding-causal", "--no-million", "--budget-s", "150"]],
        "autotune": [[PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kv_cache.py", "-k", "triton",
                      "--junitxml", str(out / "gpu_kv_cache_tests.xml")],
                     [*kernels, "--n", "32768", "--head-dim", "64", "128", "--impls", "flex-64-max", "--no-million",
                      "--budget-s", "150"]],
        "all": [check,
                [*kernels, "--n", "32768", "--head-dim", "64", "128", "--impls", "triton", "triton-128", "flex-128",
                 "sdpa", "--no-million", "--budget-s", "200"],
                [*kernels, "--million", "--impls", "triton", "--budget-s", "60"],
                decode,
                ["bash", "-c", f"set -o pipefail; timeout 140 {quick_tests} 2>&1 | tee {pytest_log}"],
                profile_triton],
    }


def run(steps: list, out: Path, dry_run: bool) -> int:
    """Run ``steps`` in order; the first non-zero exit status (0 if none). A step that cannot start or a
    function step that raises prints its error and counts as status 1."""
    status = 0
    for step in steps:
        print("$", shlex.join(step) if isinstance(step, list) else f"{Path(__file__).name}: {step.__name__}(out)",
              flush=True)
        if dry_run:
            continue
        start = time.monotonic()
        code = _call(lambda: subprocess.run(step, cwd=REPO).returncode if isinstance(step, list) else step(out))
        print(f"[exit {code} after {time.monotonic() - start:.0f} s]", flush=True)
        status = status or code
    return status


def _call(function) -> int:
    """function()'s exit status (None: 0), or 1 with the error printed if it raises."""
    try:
        return function() or 0
    except Exception as error:  # one step failing is reported and the stage goes on, like a failed command
        print(f"{type(error).__name__}: {error}", flush=True)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["check", "tests", "tune", "bench", "profile", "decode", "all", "fair",
                                                 "autotune"])
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"),
                        help="where the stage writes its files (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and run nothing")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out is needed where $OUT is not set (the device tool sets it on a lent GPU)")
    out = args.out.resolve()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu_session.py runs on a CUDA GPU and none is visible here "
                     "(torch.cuda.is_available() is False); --dry-run prints what a stage would run")
        out.mkdir(parents=True, exist_ok=True)
        resumed = RESUMED.get(args.stage)
        if resumed and (RESULTS / resumed).exists() and not (out / resumed).exists():
            shutil.copy(RESULTS / resumed, out / resumed)                         # --resume keeps its rows
    return run(stages(out)[args.stage], out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
