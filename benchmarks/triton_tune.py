"""Tune the Triton kernels' launch settings on a CUDA GPU and print the ``LAUNCH_TABLE`` literal to paste.

    python benchmarks/triton_tune.py                  # the whole sweep; no config starts after 480 s
    python benchmarks/triton_tune.py --resume         # what a previous run left (same --out, GPU, versions)
    python benchmarks/triton_tune.py [--n 32768] [--dtype bf16 fp16 fp32] [--head-dim 64 128] [--block 64 128]
                                     [--warps 4 8] [--stages 1 2 3 4] [--budget-s 480] [--out benchmarks/results]

Inputs: B=1, H=16, N=--n, the Longformer pattern ``sa.Local(256) | sa.Global(first=16)`` in a layout of
block size --block. A *group* is (pass, dtype, head_dim, block); groups run bf16, then fp16, then fp32;
head_dim and block ascending; the forward, then the backward. In each group:

1. the setting the backend launches now (``triton_gpu.launch_for``: the group's ``LAUNCH_TABLE`` entry,
   else the rule) runs once, its results are the reference, and it is timed (the *default* row);
2. every other (warps, stages) of --warps x --stages is put into ``LAUNCH_TABLE`` under the group's key,
   runs once, and its results are compared with the reference: a relative Frobenius error above
   ``ERROR_BOUNDS`` (far above the rounding a changed reduction order causes, far below what a missed or
   corrupted key block causes) makes it an error row, never chosen; otherwise it is timed. The previous
   entry (or none) is put back after every config, whatever happened.

The forward times ``sparse_attention(..., backend="triton")`` under no_grad and checks out. The backward
runs the forward once, then times ``torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)``
alone (the preprocess, dK/dV and dQ kernels; the last two take the setting) and checks dq, dk, dv.
Times are medians of ``triton.testing.do_bench``. float32 runs as launched by default: exact matmuls
(TF32 not allowed), so its table entries are for exact float32 only. Tune on the GPU the table is for
(sm_90): on a GPU with under 128 KB of shared memory per block the backend runs one stage fewer at
head_dim > 64 than the row says.

A config that fails to compile or launch (Triton's OutOfResources: more shared memory than the GPU has)
is an error row; an error that leaves the CUDA context unusable stops the run (exit 1). No config starts
after --budget-s seconds; the configs left are listed in the json and md, and ``--resume`` measures
them. ``triton_tune.json`` (meta, rows, not_measured) and ``triton_tune.md`` in --out are rewritten
after every config. The md gives, per group, the best setting, its time, the default's and the speedup;
then block 64 against 128 per (pass, dtype, head_dim), the evidence for the default block size; and
ends with the ``LAUNCH_TABLE`` literal of the best settings, for sparse_attn/backends/triton_gpu.py.
The literal and then the summary tables are printed last.

Time on one H100: not measured yet. Each config compiles its kernels once (seconds) and is timed for
about 0.15 s; the default sweep is 24 groups of 8 configs, which may take more than one 480-s call:
rerun with ``--resume``. Needs a CUDA GPU; it refuses to run without one.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a bare checkout runs it without installing
import sparse_attn as sa  # noqa: E402
from sparse_attn.api import sparse_attention  # noqa: E402
from sparse_attn.backends import triton_gpu  # noqa: E402
from sparse_attn.bench.harness import cuda_usable  # noqa: E402
from sparse_attn.bench.results import error_text, header, resumed_rows, write_results  # noqa: E402
from sparse_attn.machine import gpu, load_average  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ERROR_BOUNDS = {"bf16": 2e-2, "fp16": 4e-3, "fp32": 1e-5}  # relative Frobenius error against the default setting
PASSES = ("forward", "backward")
BATCH, HEADS = 1, 16
PATTERN = sa.Local(256) | sa.Global(first=16)
PATTERN_TEXT = "Local(256) | Global(first=16)"
GROUP = ("pass", "dtype", "head_dim", "block")
CONFIG = (*GROUP, "warps", "stages")
RESUME_META = ("gpu", "torch", "triton", "n")   # --resume keeps rows only if these agree


class Group(NamedTuple):
    """What one launch setting is tuned for: a ``LAUNCH_TABLE`` key, with head_dim instead of BLOCK_D."""
    pass_name: str
    dtype: str
    head_dim: int
    block: int


def plan(dtypes, head_dims, blocks) -> list[Group]:
    """The groups in measuring order: bf16, fp16, fp32; head_dim and block ascending; forward, backward.

    >>> plan(["fp32", "bf16"], [64], [128, 64])[:3]      # doctest: +NORMALIZE_WHITESPACE
    [Group(pass_name='forward', dtype='bf16', head_dim=64, block=64),
     Group(pass_name='backward', dtype='bf16', head_dim=64, block=64),
     Group(pass_name='forward', dtype='bf16', head_dim=64, block=128)]
    """
    return [Group(pass_name, dtype, head_dim, block) for dtype in sorted(dtypes, key=list(DTYPES).index)
            for head_dim in sorted(head_dims) for block in sorted(blocks) for pass_name in PASSES]


def table_key(group: Group) -> tuple:
    """The group's ``LAUNCH_TABLE`` key: (pass, block, BLOCK_D, dtype).

    >>> table_key(Group("backward", "fp16", 96, 64))
    ('backward', 64, 128, torch.float16)
    """
    return group.pass_name, group.block, triton_gpu.padded_head_dim(group.head_dim), DTYPES[group.dtype]


@contextlib.contextmanager
def table_entry(key: tuple, setting: tuple[int, int]):
    """``LAUNCH_TABLE[key] = setting`` inside the block; the previous entry, or none, after it, even on error."""
    table = triton_gpu.LAUNCH_TABLE
    previous = table.get(key)
    table[key] = setting
    try:
        yield
    finally:
        if previous is None:
            del table[key]
        else:
            table[key] = previous


@functools.lru_cache(maxsize=None)
def longformer(n: int, heads: int, block: int, device: str):
    """The Longformer layout of the sweep (built once per N, heads and block)."""
    return PATTERN.layout(n, heads=heads, block_size=block).to(device)


def prepare(group: Group, n: int, device: str) -> tuple[Callable[[], tuple], tuple[int, int]]:
    """(step, default): ``step()`` runs the group's kernels with the settings ``LAUNCH_TABLE`` gives now and
    returns the results to check; ``default`` is the (warps, stages) the backend launches before any change."""
    layout = longformer(n, HEADS, group.block, device)
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, n, group.head_dim, device=device, dtype=DTYPES[group.dtype])
               for _ in range(3))                                                        # (B, H, N, D)
    launch = triton_gpu.launch_for(q, group.block, backward=group.pass_name == "backward")
    default = (launch["num_warps"], launch["num_stages"])
    if group.pass_name == "forward":
        def forward() -> tuple:
            with torch.no_grad():
                return (sparse_attention(q, k, v, layout, backend="triton"),)
        return forward, default
    inputs = tuple(t.requires_grad_() for t in (q, k, v))
    out = sparse_attention(*inputs, layout, backend="triton")                          # (B, H, N, D), once
    grad_out = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True), default


def bench_ms(step: Callable) -> float:
    """Median time of ``step`` in milliseconds (Triton's do_bench: warm-up, L2 flush, repeats)."""
    import triton.testing

    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")


def relative_error(actual: tuple, reference: tuple) -> float:
    """The largest ||a - r|| / ||r|| (Frobenius, float64) over the pairs of tensors; NaN or inf if a is not finite.

    >>> relative_error((torch.tensor([3.0, 4.5]), torch.zeros(2)), (torch.tensor([3.0, 4.0]), torch.zeros(2)))
    0.1
    """
    return max(((a.double() - r.double()).norm() / r.double().norm().clamp_min(1e-300)).item()
               for a, r in zip(actual, reference))


def check_and_time(step: Callable, reference: tuple, bound: float, timer: Callable) -> dict:
    """{"rel_error", "ms"} if ``step``'s results agree with ``reference`` within ``bound``, else {"error", ...}."""
    try:
        error = relative_error(step(), reference)
        if not error <= bound:                                                # NaN too
            return {"rel_error": error,
                    "error": f"wrong result: relative error {error:.2e} > {bound:g} against the default setting"}
        return {"rel_error": error, "ms": timer(step)}
    except Exception as failure:  # a setting that does not compile or launch is a result, not a crash
        return {"error": error_text(failure)}


def group_rows(group: Group, settings: list, prepare_group: Callable, timer: Callable, done: set):
    """Yield the group's rows one config at a time: the default setting (the reference) unless ``done`` has
    it, then each of ``settings`` not in ``done``. Nothing runs until the first row is asked for."""
    head = dict(zip(GROUP, group))
    try:
        step, default = prepare_group(group)
    except Exception as failure:
        yield {**head, "warps": None, "stages": None, "default": True, "error": error_text(failure)}
        return
    head |= {"warps": default[0], "stages": default[1], "default": True}
    try:
        reference = step()
        timed = {} if (*group, *default) in done else {"rel_error": 0.0, "ms": timer(step)}
    except Exception as failure:
        yield {**head, "error": error_text(failure)}
        return
    if timed:
        yield {**head, **timed}
    for setting in settings:
        if setting == default or (*group, *setting) in done:
            continue
        with table_entry(table_key(group), setting):
            result = check_and_time(step, reference, ERROR_BOUNDS[group.dtype], timer)
        yield {**head, "warps": setting[0], "stages": setting[1], "default": False, **result}


def config_key(row: dict) -> tuple:
    """(pass, dtype, head_dim, block, warps, stages) of a row."""
    return tuple(row[name] for name in CONFIG)


def left(groups: list[Group], settings: list, rows: list[dict]) -> list[dict]:
    """The configs of ``groups`` x ``settings`` that ``rows`` do not hold."""
    done = {config_key(r) for r in rows}
    return [dict(zip(CONFIG, (*group, *setting))) for group in groups for setting in settings
            if (*group, *setting) not in done]


def sweep(groups: list[Group], settings: list, prepare_group: Callable, timer: Callable, deadline: float,
          rows: list[dict], clock=time.monotonic, usable=lambda: True, save=lambda rows, pending: None
          ) -> tuple[list[dict], str]:
    """Measure every group's configs in order into ``rows`` (which may hold rows of an earlier run: their configs
    are skipped), calling ``save(rows, configs left)`` after each, until ``clock()`` reaches ``deadline`` or
    ``usable()`` says the last config left the GPU unusable. Returns the configs left and why ("" if none)."""
    for i, group in enumerate(groups):
        done = {config_key(r) for r in rows}
        if all((*group, *setting) in done for setting in settings):
            continue
        for row in _until(deadline, clock, group_rows(group, settings, prepare_group, timer, done)):
            rows.append(row)
            save(rows, left(groups[i:], settings, rows))
            print(json.dumps(row), flush=True)
            if not usable():
                why = f"the CUDA context is unusable after {row.get('error', 'a config')}"
                return left(groups[i:], settings, rows), why
        if clock() >= deadline:
            return left(groups[i:], settings, rows), "time budget spent"
    pending = left(groups, settings, rows)
    return pending, "the default setting of their group failed" if pending else ""


def _until(deadline: float, clock: Callable, rows):
    """The rows of the generator ``rows`` until ``clock()`` reaches ``deadline`` (checked before each starts)."""
    while clock() < deadline:
        try:
            yield next(rows)
        except StopIteration:
            return


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
def _group(row: dict) -> tuple:
    return tuple(row[name] for name in GROUP)


def best_rows(rows: list[dict]) -> dict[tuple, dict]:
    """The fastest correct row of each group (pass, dtype, head_dim, block), groups in row order."""
    best = {}
    for r in rows:
        if "ms" in r and (_group(r) not in best or r["ms"] < best[_group(r)]["ms"]):
            best[_group(r)] = r
    return best


def launch_table(rows: list[dict]) -> dict[tuple, tuple[int, int]]:
    """``LAUNCH_TABLE`` holding the best setting of every group measured."""
    return {table_key(Group(*group)): (r["warps"], r["stages"]) for group, r in best_rows(rows).items()}


def table_literal(table: dict) -> str:
    """``table`` as the Python assignment to paste into triton_gpu.py (``eval`` of the right side gives it back)."""
    lines = [f"    ({key[0]!r}, {key[1]}, {key[2]}, {key[3]!r}): {value!r}," for key, value in table.items()]
    return "\n".join(["LAUNCH_TABLE = {", *lines, "}"])


def _setting(row: dict | None) -> str:
    return "—" if row is None or row["warps"] is None else f"{row['warps']} x {row['stages']}"


def _ms(row: dict | None) -> str:
    return "—" if row is None or "ms" not in row else f"{row['ms']:.3f}"


def summary(rows: list[dict]) -> str:
    """Per group the best setting and the default's; per (pass, dtype, head_dim) block 64 against 128."""
    best = best_rows(rows)
    defaults = {_group(r): r for r in rows if r["default"]}
    lines = ["| pass | dtype | D | block | best warps x stages | best ms | default warps x stages | default ms "
             "| speedup |", "|---|---|---:|---:|---|---:|---|---:|---:|"]
    for group in dict.fromkeys(_group(r) for r in rows):
        fastest, default = best.get(group), defaults.get(group)
        speedup = f"{default['ms'] / fastest['ms']:.2f}x" if fastest and default and "ms" in default else "—"
        lines.append(f"| {' | '.join(map(str, group))} | {_setting(fastest)} | {_ms(fastest)} | {_setting(default)} "
                     f"| {_ms(default)} | {speedup} |")
    blocks = sorted({group[3] for group in best})
    lines += ["", "Block size (the fastest setting of each block):", "",
              "| pass | dtype | D | " + " | ".join(f"block {b} ms" for b in blocks) + " | fastest |",
              "|---|---|---:|" + "---:|" * len(blocks) + "---|"]
    for pass_name, dtype, head_dim in dict.fromkeys(group[:3] for group in best):
        of_block = {b: best[(pass_name, dtype, head_dim, b)] for b in blocks if (pass_name, dtype, head_dim, b) in best}
        lines.append(f"| {pass_name} | {dtype} | {head_dim} | " + " | ".join(_ms(of_block.get(b)) for b in blocks)
                     + f" | {_fastest_block(of_block)} |")
    return "\n".join(lines)


def _fastest_block(of_block: dict[int, dict]) -> str:
    """"block 64, 1.25x faster than block 128": the fastest block against the next one."""
    ranked = sorted(of_block, key=lambda b: of_block[b]["ms"])
    if len(ranked) < 2:
        return "—"
    first, second = ranked[:2]
    return f"block {first}, {of_block[second]['ms'] / of_block[first]['ms']:.2f}x faster than block {second}"


def to_markdown(record: dict) -> str:
    meta, rows, pending = record["meta"], record["rows"], record["not_measured"]
    errors = [r for r in rows if "error" in r]
    lines = [f"# Triton launch settings on {meta['gpu']}", "",
             f"B={meta['batch']}, H={meta['heads']}, N={meta['n']}, {meta['pattern']}; torch {meta['torch']}, "
             f"triton {meta['triton']}, driver {meta['driver'] or 'unknown'}. Times are medians of "
             "`triton.testing.do_bench` (ms); the backward is timed alone. *default* = what the backend launched "
             "before this run (`LAUNCH_TABLE`, else the rule); speedup = default ms / best ms. A setting whose "
             f"results differ from the default's by more than {meta['error_bounds']} (relative Frobenius) is "
             "rejected.", "", summary(rows)]
    if errors:
        lines += ["", "Errors:", "",
                  *(f"- {' '.join(map(str, _group(r)))}, {_setting(r)}: {r['error']}" for r in errors)]
    if pending:
        lines += ["", f"**Incomplete:** {len(pending)} configs not measured yet (time budget or a stop); "
                      "`--resume` measures them."]
    lines += ["", "The best settings, for `sparse_attn/backends/triton_gpu.py`:", "", "```python",
              table_literal(launch_table(rows)), "```"]
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict, rows: list[dict], pending: list[dict]) -> str:
    """``triton_tune.json`` and ``triton_tune.md`` in ``out``, each replaced whole; returns the markdown."""
    return write_results(out, "triton_tune", {"meta": meta, "rows": rows, "not_measured": pending}, to_markdown)


def load_rows(path: Path, meta: dict) -> list[dict]:
    """The rows at ``path`` ([] if none), refused if measured on another GPU, versions or N than ``meta``."""
    return resumed_rows(path, {key: meta[key] for key in RESUME_META})


def machine(args: argparse.Namespace) -> dict:
    """The set-up and the sweep the rows were measured on; ``--resume`` compares its ``RESUME_META``."""
    shared_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    return {**header(("torch", "triton")), **gpu(), "shared_memory_per_block": shared_memory,
            "batch": BATCH, "heads": HEADS, "n": args.n, "pattern": PATTERN_TEXT, "error_bounds": ERROR_BOUNDS,
            "command": " ".join(["python", *sys.argv])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32768)
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--head-dim", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--block", type=int, nargs="+", default=[64, 128], choices=[16, 32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no config after this many seconds (default 480: one 10-minute call)")
    parser.add_argument("--resume", action="store_true", help="keep the rows in --out and skip their configs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    start = time.monotonic()
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/triton_tune.py times CUDA kernels and needs a CUDA GPU; none is visible here "
                 "(torch.cuda.is_available() is False). Run it on a GPU machine.")
    meta = machine(args)
    rows = load_rows(args.out / "triton_tune.json", meta) if args.resume else []
    groups = plan(args.dtype, args.head_dim, args.block)
    settings = [(warps, stages) for warps in args.warps for stages in args.stages]
    print(f"{len(groups)} groups x {len(settings)} settings, {len(rows)} rows kept; no config starts after "
          f"{args.budget_s:.0f} s", flush=True)
    save = lambda rows, pending: write(args.out, meta, rows, pending)  # noqa: E731
    pending, why = sweep(groups, settings, functools.partial(prepare, n=args.n, device="cuda"), bench_ms,
                         start + args.budget_s, rows, usable=cuda_usable, save=save)
    meta["loadavg_after"] = load_average()
    write(args.out, meta, rows, pending)
    print(f"wrote {args.out / 'triton_tune.json'} and {args.out / 'triton_tune.md'}")
    if pending:
        print(f"not measured ({why}): {len(pending)} configs; rerun with --resume to measure them")
    print("\n" + table_literal(launch_table(rows)) + "\n\n" + summary(rows))
    if why.startswith("the CUDA context"):
        sys.exit(f"stopped: {why}")


if __name__ == "__main__":
    main()
