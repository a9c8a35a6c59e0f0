"""The Numba kernels compile for every CPU family they meet, whatever CPU runs the tests.

LLVM's code generation differs by target, and has crashed on one vendor only: the softcap kernels segfaulted
while compiling for Intel's AVX-512 CPUs (skylake-avx512, icelake-server) and compiled for AMD's. CI runs on
whatever CPU its machine has, so each CPU below gets its own subprocess (``tests/numba_compile_only.py``), with
``NUMBA_CPU_NAME`` naming it, ``NUMBA_CPU_FEATURES`` empty (that CPU's own features as LLVM defines them, not
this machine's) and an empty cache, which compiles every kernel of every dtype that CPU's hosts run, on the
routes they take, and runs none of them.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
# LLVM CPU name -> the dtypes and routes its hosts take (tests/numba_compile_only.py): float32 on brgemm where
# the CPU has AVX-512, bfloat16 on bf16 matmuls where it has bf16 dot products (elsewhere bfloat16 computes as
# float32 does)
TARGETS = {
    "haswell": ["float32:blas", "float64"],
    "znver3": ["float32:blas", "float64"],
    "skylake-avx512": ["float32:brgemm", "float64"],
    "icelake-server": ["float32:brgemm", "float64"],
    "sapphirerapids": ["float32:brgemm", "float64", "bfloat16:brgemm"],
    "znver4": ["float32:brgemm", "float64", "bfloat16:brgemm"],
}


def compile_for(cpu: str, specs: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "tests.numba_compile_only", *specs], cwd=CHECKOUT, env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
def test_every_kernel_compiles_for_every_cpu_family(tmp_path):
    """Two CPUs at a time (each compile is one thread); a crash (a negative exit status: the signal) or an error
    names its CPU."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(TARGETS, pool.map(lambda cpu: compile_for(cpu, TARGETS[cpu], tmp_path / cpu), TARGETS)))
    failed = {cpu: f"exit status {proc.returncode}: {proc.stderr[-1500:]}" for cpu, proc in done.items()
              if proc.returncode != 0}
    assert not failed, failed
    for cpu, proc in done.items():
        assert [line.split(":")[0] for line in proc.stdout.splitlines() if "compiled in" in line] == \
            [spec.split(":")[0] for spec in TARGETS[cpu]], (cpu, proc.stdout)
        for spec in TARGETS[cpu]:                   # each cold compile said so, naming its kernel and dtype
            for kernel in ("forward", "backward"):
                assert f"compiling the numba {kernel} kernel for {spec.split(':')[0]} on first use" in proc.stderr, \
                    (cpu, spec, kernel, proc.stderr[-1500:])
