"""What the Triton kernels cost an H100, read from the compiler, with no GPU: registers, spills, shared memory.

    python benchmarks/triton_resources.py [--head-dim 64 128] [--dtype bf16 fp32 tf32] [--sweep] [--ragged]
                                          [--softcap] [--out benchmarks/results]

Each of the four kernels of ``sparse_attn/backends/triton_gpu.py`` is lowered for sm_90 (H100/H200)
exactly as a launch would specialise it (16-byte aligned pointers, unit stride along head_dim),
then assembled by Triton's bundled ``ptxas -v``. For every (kernel, head_dim, dtype, warps, stages)
it records the registers per thread, the bytes spilled to local memory, the shared memory per
block, and whether the key-block loop is software-pipelined. By default only the setting the
backend launches with (``triton_gpu.launch_settings``) is compiled; ``--sweep`` adds 4 and 8 warps
x 1..3 stages, the evidence behind that choice. ``--ragged`` compiles for N not a multiple of the
block (bounds-masked loads), ``--softcap`` with the soft-capping switch on (the hardware tanh for half
and TF32 inputs). This is static information, not speed. Writes
``triton_resources.json`` and ``triton_resources.md`` into ``--out``; exits 1 if a launched setting
needs more than the 227 KB of shared memory of sm_90 or its key-block loop is not pipelined.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # lower the kernels, do not interpret them

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout runs it without installing
from sparse_attn.backends import triton_gpu  # noqa: E402
from sparse_attn.machine import versions  # noqa: E402
from sparse_attn.score_mods import NO_MODS, ScoreMods  # noqa: E402

H100_SHARED_MEMORY = 227 * 1024   # bytes a block may opt in to on sm_90
BLOCK = 64                        # the layouts' default block size
KERNELS = {"forward": triton_gpu._fwd_kernel, "preprocess": triton_gpu._bwd_preprocess_kernel,
           "dk_dv": triton_gpu._bwd_kv_kernel, "dq": triton_gpu._bwd_q_kernel}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "tf32": torch.float32}  # float32 with torch.backends.cuda.matmul.allow_tf32 = True
_FLOAT32_POINTERS = {"Lse", "DLse", "Delta", "Lse2", "PieceOut", "PieceLse", "PieceDK", "PieceDV", "PieceDQ"}
_DATA_POINTERS = {"Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV"}


def signature(kernel, constants: dict, dtype: str) -> ASTSource:
    """The kernel as a launch specialises it: pointers and sizes 16-byte divisible, head_dim strides 1, and the
    other strides of contiguous (B, H, N, D) inputs divisible by 16 where D is (what makes K/V loads 16 bytes
    wide and lets the key-block loops copy them asynchronously)."""
    types, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants or name.startswith("stride_") and name.endswith("d"):
            types[name], constexprs[(i,)] = "constexpr", constants.get(name, 1)
            continue
        data = "fp32" if dtype == "tf32" else dtype
        types[name] = ("*fp32" if name in _FLOAT32_POINTERS else f"*{data}" if name in _DATA_POINTERS
                       else "*u8" if name == "Masks" else "*i32" if name[0].isupper()
                       else "fp32" if "scale" in name else "i32")
        strided = name.startswith("stride_") and constants.get("HEAD_DIM", 0) % 16 == 0
        if types[name][0] == "*" or name.startswith("n_") or strided:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(kernel, types, constexprs, attrs)


def constants(kernel_name: str, head_dim: int, dtype_name: str, ragged: bool, softcap: bool) -> dict:
    """The constexpr arguments the launchers pass for a (B, H, N, head_dim) input; ``ragged``: N % BLOCK != 0;
    ``softcap``: with a softcap (any value: the kernels take it as an argument)."""
    n = 4 * BLOCK + ragged
    mods = ScoreMods(softcap=30.0) if softcap else NO_MODS
    meta = triton_gpu.kernel_constants(head_dim, DTYPES[dtype_name], n, n, BLOCK, mods)
    if kernel_name == "preprocess":
        return dict(HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK=BLOCK, HAS_DLSE=True)
    return meta | ({"PRECISION": "tf32"} if dtype_name == "tf32" else {})


def compile_for_h100(kernel, constexprs: dict, dtype: str, warps: int, stages: int) -> dict:
    """Lower ``kernel`` for sm_90 and read its resources from ptxas' report."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(signature(kernel, constexprs, dtype), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
    report = log.getvalue()
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas report for {kernel.__name__}; got:\n{report[-2000:]}")
    return {"registers": int(registers.group(1)), "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
            "shared_bytes": compiled.metadata.shared,
            "pipelined": "async_copy_global_to_local" in compiled.asm["ttgir"] or "async_tma" in compiled.asm["ttgir"]}


def launched(kernel_name: str, head_dim: int, dtype_name: str) -> tuple[int, int]:
    """(num_warps, num_stages) the backend launches ``kernel_name`` with on an H100, block ``BLOCK``."""
    if kernel_name == "preprocess":
        settings = triton_gpu.PREPROCESS_LAUNCH
    else:
        precision = "tf32" if dtype_name == "tf32" else triton_gpu.dot_precision(DTYPES[dtype_name])
        settings = triton_gpu.launch_settings(head_dim, DTYPES[dtype_name], H100_SHARED_MEMORY,
                                              backward=kernel_name != "forward", block=BLOCK, precision=precision)
    return settings["num_warps"], settings["num_stages"]


def compile_all(head_dims, dtypes, sweep: bool, ragged: bool, softcap: bool) -> list[dict]:
    knobs.nvidia.dump_ptxas_log = True        # ptxas -v's report goes to stdout, captured per kernel
    knobs.compilation.always_compile = True   # a cached kernel would print no report
    rows = []
    for dtype_name in dtypes:
        for head_dim in head_dims:
            for kernel_name, kernel in KERNELS.items():
                chosen = launched(kernel_name, head_dim, dtype_name)
                settings = {chosen}
                if sweep and kernel_name != "preprocess":
                    settings |= {(w, s) for w in (4, 8) for s in (1, 2, 3)}
                for w, s in sorted(settings):
                    row = {"kernel": kernel_name, "dtype": dtype_name, "head_dim": head_dim, "ragged": ragged,
                           "softcap": softcap, "warps": w, "stages": s, "launched": (w, s) == chosen}
                    row.update(compile_for_h100(kernel, constants(kernel_name, head_dim, dtype_name, ragged, softcap),
                                                dtype_name, w, s))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def _name(r: dict) -> str:
    return f"{r['kernel']} {r['dtype']} D={r['head_dim']} warps={r['warps']} stages={r['stages']}"


def spills(rows: list[dict]) -> list[str]:
    """The launched settings that spill registers to local memory (slower, still correct)."""
    return [f"{_name(r)}: {r['spill_bytes']} bytes" for r in rows if r["launched"] and r["spill_bytes"]]


def problems(rows: list[dict]) -> list[str]:
    """Why a setting the backend launches would fail or lose its pipelining on an H100."""
    found = []
    for r in rows:
        if not r["launched"]:
            continue
        name = _name(r)
        if r["shared_bytes"] > H100_SHARED_MEMORY:
            found.append(f"{name} needs {r['shared_bytes']} bytes of shared memory")
        if r["stages"] > 1 and r["kernel"] != "preprocess" and not r["pipelined"]:
            found.append(f"{name} is not software-pipelined")
    return found


def to_markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Triton kernels lowered for sm_90 (H100/H200), block {BLOCK}", "",
             f"triton {meta['triton']}, torch {meta['torch']}; read from `ptxas -v`, no GPU involved; "
             f"N {'not ' if meta['ragged'] else ''}a multiple of the block. "
             "**bold** = the setting the backend launches on an H100. Registers are per thread (255 at most); "
             f"shared memory is per block ({H100_SHARED_MEMORY // 1024} KB at most on sm_90).", "",
             "| kernel | dtype | D | warps | stages | registers | spill bytes | shared KB | pipelined |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["kernel"], r["dtype"], str(r["head_dim"]), str(r["warps"]), str(r["stages"]), str(r["registers"]),
                 str(r["spill_bytes"]), f"{r['shared_bytes'] / 1024:.1f}", "yes" if r["pipelined"] else "no"]
        if r["launched"]:
            cells = [f"**{c}**" for c in cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Launched settings that spill: " + ("; ".join(spills(rows)) or "none") + ".",
              "Launched settings that do not fit or are not pipelined: " + ("; ".join(problems(rows)) or "none") + ".",
              ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dim", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32", "tf32"], choices=list(DTYPES),
                        help="tf32: float32 inputs with torch.backends.cuda.matmul.allow_tf32 = True")
    parser.add_argument("--sweep", action="store_true", help="also compile 4 and 8 warps x 1..3 stages")
    parser.add_argument("--ragged", action="store_true", help="N not a multiple of the block (masked loads)")
    parser.add_argument("--softcap", action="store_true", help="the kernels with logit soft-capping on")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = compile_all(args.head_dim, args.dtype, args.sweep, args.ragged, args.softcap)
    meta = {**versions(("triton", "torch")), "target": "cuda sm_90", "block": BLOCK,
            "ragged": args.ragged, "softcap": args.softcap, "command": " ".join(["python", *sys.argv])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_resources.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "triton_resources.md").write_text(to_markdown(rows, meta))
    print(f"wrote {args.out / 'triton_resources.json'} and {args.out / 'triton_resources.md'}")
    found = problems(rows)
    if found:
        sys.exit("launched settings with problems:\n  " + "\n  ".join(found))


if __name__ == "__main__":
    main()
