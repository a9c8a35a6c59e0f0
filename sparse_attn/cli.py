"""The ``sparse-attn`` command (also ``python -m sparse_attn``).

    sparse-attn info                                  versions, devices, backends
    sparse-attn patterns                              presets with density at 4K and 16K tokens
    sparse-attn show "Local(64) | Global(first=2)" [--seq-len 4k] [--head 0] [--heads 0,1] [--out fig.png]
    sparse-attn bench --quick                         time and memory versus N, JSON + markdown + PNG

PATTERN arguments are a benchmark label (``longformer``), a preset name (``bigbird-itc``), a TOML file or an
expression over the pattern constructors, read the same way by every subcommand (``read_pattern``). Sizes take
``k`` (1024) and ``M`` (1024**2) suffixes. Errors in the arguments print ``sparse-attn: error: ...`` and exit
with status 2, before any work; a reader that stops early (``| head``) ends the command quietly.

This module parses arguments, calls the library and prints; ``--help`` imports neither torch nor
matplotlib; each subcommand imports what it uses.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from . import presets
from .expression import PatternTextError, parse_pattern, per_head_count
from .pattern import Pattern


class UsageError(Exception):
    """A bad argument: printed as ``sparse-attn: error: ...``, exit status 2."""


class BenchFailed(Exception):
    """A bench that measured none of this library's points: printed as ``sparse-attn: error: ...``, exit status 1."""


# ------------------------------------------------------------------------------------------------
# Outputs: checked before any work
# ------------------------------------------------------------------------------------------------
def _writable_dir(directory: Path, argument: str) -> None:
    """Create ``directory`` (and its parents) for ``argument`` (``--out PATH``), or say why it cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{argument}: cannot create the directory {directory} ({error.strerror or error}); "
                         f"choose another --out") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{argument}: the directory {directory} is not writable; choose another --out")


def _check_figure_path(path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError("--out draws with matplotlib, which is not installed: pip install 'sparse-attn[viz]'") \
            from None
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix.lstrip(".").lower() not in formats:
        raise UsageError(f"--out {path}: expected a file name ending in a figure format "
                         f"({', '.join(sorted(formats))}), e.g. fig.png")
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name such as {path / 'fig.png'}")
    _writable_dir(path.parent, f"--out {path}")


def _check_bench_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; bench writes a directory (results.json, results.md, time.png, "
                         f"memory.png)")
    if (out / "results.json").exists() and not overwrite:
        raise UsageError(f"--out {out} already holds results.json; pass --overwrite to replace it, another --out, "
                         f"or no --out (a fresh {_BENCH_OUT}-N folder)")
    _writable_dir(out, f"--out {out}")


def _fresh_bench_dir(base: Path) -> Path:
    """``base`` if it holds no results yet, else the first ``base-2``, ``base-3``, ... that holds none: where
    ``bench`` without ``--out`` writes, so that re-running it keeps the earlier runs."""
    candidate, number = base, 1
    while (candidate / "results.json").exists() or candidate.is_file():
        number += 1
        candidate = base.with_name(f"{base.name}-{number}")
    return candidate


# ------------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------------
def cmd_info(args) -> None:
    import torch

    from . import backends, machine

    print(f"sparse_attn {machine.versions(['sparse-attn'])['sparse-attn'] or '(not installed)'}")
    print(f"Python {platform.python_version()} ({platform.platform()})")
    for package, version in machine.versions(("torch", "numba", "triton", "transformers", "matplotlib",
                                              "tqdm")).items():
        print(f"{package:<13}{version or 'not installed'}")
    print("devices:")
    print(f"  cpu          {platform.machine()}, {machine.cpus()} CPUs, torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            print(f"  cuda:{index}       {torch.cuda.get_device_name(index)}")
    else:
        print("  cuda         not available")
    print("backends:")
    for name in backends.MODULES:
        ok, reason = backends.availability(name)
        print(f"  {name:<12} {'available' if ok else 'unavailable'}" + (f": {reason}" if reason else ""))


def cmd_patterns(args) -> None:
    rows = presets.preset_rows()
    width = max(len(r[0]) for r in rows)
    print(f"{'preset':<{width}}  {'@4K':>7}  {'@16K':>7}  description")
    for name, description, _, d4, d16 in rows:
        print(f"{name:<{width}}  {d4:>7.2%}  {d16:>7.2%}  {description}")
    print("\ntoken density = allowed token pairs / N^2; show one with: sparse-attn show NAME [--seq-len N]")


def read_pattern(text: str) -> tuple[Pattern, int | None]:
    """PATTERN as every subcommand reads it: a benchmark label (``bench.PATTERNS``), then what
    ``parse_pattern`` reads. Returns (pattern, heads its file declares or None).

    >>> read_pattern("longformer")
    (Local(256) | Global(first=16), None)
    """
    from .bench import PATTERNS

    return parse_pattern(text, named=PATTERNS)


def cmd_show(args) -> None:
    from . import viz

    pattern, file_heads = read_pattern(args.pattern)
    n_heads = args.num_heads or file_heads or per_head_count(pattern) or max([*(args.heads or ()), args.head]) + 1
    heads = list(dict.fromkeys(args.heads or range(min(n_heads, 4))))
    if max(heads) >= n_heads:
        raise UsageError(f"--heads {','.join(map(str, heads))} needs head indices below the pattern's "
                         f"{n_heads} heads; pass --num-heads")
    if args.head >= n_heads:
        raise UsageError(f"--head {args.head} needs a head index below the pattern's {n_heads} heads; pass "
                         f"--num-heads")
    if args.out:
        if len(heads) > _FIGURE_HEADS:
            raise UsageError(f"--heads: a figure draws at most {_FIGURE_HEADS} heads, got {len(heads)}; "
                             f"write several figures")
        if args.zoom is not None and args.zoom > viz.ZOOM_MAX:
            raise UsageError(f"--zoom {args.zoom:,}: the zoom draws at most {viz.ZOOM_MAX:,} tokens a side at token "
                             f"level; the block grid above it shows the whole sequence")
        _check_figure_path(args.out)
    try:
        layout = pattern.layout(args.seq_len, heads=n_heads, block_size=args.block_size)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    except (OverflowError, MemoryError, RecursionError) as error:
        raise UsageError(f"the layout of --seq-len {args.seq_len:,} with {n_heads:,} heads and --block-size "
                         f"{args.block_size:,} cannot be built here ({type(error).__name__}: {error}); use a "
                         f"smaller --seq-len, --num-heads or --block-size") from None
    dense_flops = layout.dense_flops(args.head_dim)
    print(str(layout).partition("\n  head 0 (")[0])      # its summary, without the grid of head 0 it prints
    print("  " + viz.ascii_grid(layout, head=args.head, max_side=_ASCII_SIDE).replace("\n", "\n  "))
    if pattern.head_dependent:
        print(f"  {_head_hint(args.head, n_heads)}")
    print(f"  forward FLOPs (head_dim {args.head_dim}) {layout.flops(args.head_dim):.3g} = "
          f"{layout.flops(args.head_dim) / dense_flops:.2%} of dense ({dense_flops:.3g})")
    if args.out:
        viz.save(viz.plot_layout(layout, heads=heads, zoom=args.zoom), args.out, dpi=110)
        print(f"wrote {args.out}")


def _head_hint(head: int, n_heads: int) -> str:
    """Which head the text grid of a pattern whose heads differ draws, and how to draw another.

    >>> _head_hint(0, 12)
    'head 0 of 12 drawn; the heads differ: --head 0..11 draws another'
    """
    if n_heads == 1:
        return "head 0 of 1 drawn; the pattern's heads differ: --head h draws head h (of --num-heads H)"
    return f"head {head} of {n_heads} drawn; the heads differ: --head 0..{n_heads - 1} draws another"


def bench_patterns(labels: Sequence[str], num_heads: int) -> dict[str, Pattern]:
    """label -> Pattern for ``bench --patterns``, each checked against ``--num-heads``."""

    patterns = {}
    for label in labels:
        pattern, file_heads = read_pattern(label)
        try:
            pattern.check_heads(num_heads)
        except ValueError as error:
            needed = file_heads or per_head_count(pattern)
            hint = f"; pass --num-heads {needed}" if needed else ""
            raise UsageError(f"pattern {label!r} does not fit --num-heads {num_heads}: {error}{hint}") from None
        patterns[label] = pattern
    return patterns


def _check_bench_setup(args, implementations: Sequence[str]) -> None:
    """What the sweep and the figures need, checked before the first point runs."""
    import torch

    from . import bench

    unknown = [name for name in implementations if name not in bench.IMPLEMENTATIONS]
    if unknown:
        raise UsageError(f"unknown --backends {', '.join(unknown)}; choose from {', '.join(bench.IMPLEMENTATIONS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    needs = (("matplotlib", "time.png and memory.png"), ("tqdm", "the progress bar (or pass --no-progress)"))
    for module, why in needs:
        if (module == "matplotlib" or not args.no_progress) and importlib.util.find_spec(module) is None:
            raise UsageError(f"bench needs {module} for {why}: pip install 'sparse-attn[bench]'")
    _check_bench_dir(args.out, args.overwrite)


def cmd_bench(args) -> None:
    import torch

    from . import bench

    if args.out is None:
        args.out = Path(_BENCH_OUT) if args.overwrite else _fresh_bench_dir(Path(_BENCH_OUT))
    settings = bench.settings(args.quick, patterns=args.patterns, lengths=args.lengths,
                              implementations=args.backends, repeats=args.repeats, timeout=args.timeout)
    patterns = bench_patterns(settings.patterns, args.num_heads)
    _check_bench_setup(args, settings.implementations)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unavailable = bench.unavailable_reasons(patterns, settings.implementations, device, args.backward)
    for (label, name), reason in unavailable.items():
        print(f"n/a: {name} on {label}: {reason}")
    results = bench.sweep(patterns, settings.lengths, settings.implementations, batch=args.batch,
                          heads=args.num_heads, head_dim=args.head_dim, block_size=args.block_size,
                          backward=args.backward, repeats=settings.repeats, timeout=settings.timeout,
                          memory_limit_gb=args.memory_limit_gb, device=device, command=_command_line(args.argv),
                          progress=not args.no_progress, out=args.out, unavailable=unavailable)
    for path in bench.write(results, args.out):
        print(f"wrote {path}")
    print(bench.tables(results).strip())
    missing = bench.own_lines_missing(results)
    if missing:
        raise BenchFailed("no measurement of this library's kernels for " + "; ".join(missing) +
                          " (a larger --timeout, or fewer --lengths, gives them the time)")


# ------------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------------
_SUFFIXES = {"k": 1024, "m": 1024 ** 2}


def _count(text: str) -> int:
    """A positive integer: ``4096``, ``16_384``, ``16,384``, ``4k`` / ``4K`` (x 1024), ``1M`` (x 1024**2).

    >>> _count("4k"), _count("16_384"), _count("1M")
    (4096, 16384, 1048576)
    """
    digits = text.strip().replace("_", "").replace(",", "")
    factor = _SUFFIXES.get(digits[-1:].lower(), 1)
    digits = digits[:-1] if factor > 1 else digits
    if not digits.isdecimal() or not digits.isascii():
        raise argparse.ArgumentTypeError(f"expected a positive integer such as 4096, 4k or 1M (k = 1024, "
                                         f"M = 1024**2), got {text!r}")
    value = int(digits) * factor
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _head_list(text: str) -> list[int]:
    try:
        heads = [int(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated head indices like 0,1,2, got {text!r}") from None
    if not heads or min(heads) < 0:
        raise argparse.ArgumentTypeError(f"expected head indices >= 0 like 0,1,2, got {text!r}")
    return heads


def _head(text: str) -> int:
    heads = _head_list(text)
    if len(heads) != 1:
        raise argparse.ArgumentTypeError(f"expected one head index such as 0 or 3, got {text!r} (--heads takes "
                                         f"several, for the figure)")
    return heads[0]


def _bounded(maximum: float):
    """An argparse type: a finite number in (0, maximum]."""
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not (math.isfinite(value) and 0 < value <= maximum):
            raise argparse.ArgumentTypeError(f"expected a finite number > 0 and <= {maximum:,.0f}, got {text!r}")
        return value
    return number


_FIGURE_HEADS = 16        # show --out: one column per head
_ASCII_SIDE = 64          # show: cells a side of the text grid (print(layout) draws it unbinned up to 64 blocks)
_SHOW_LENGTH = 4096       # show's default --seq-len: 64 blocks of 64, every block a cell of the text grid
_BENCH_OUT = "bench-results"
_BROKEN_PIPE = 141        # exit status when the reader of stdout left: 128 + SIGPIPE, as a shell tool's
_TIMEOUT_MAX = 1e6        # seconds (11 days): subprocess waits overflow past about 2e6 s
_MEMORY_LIMIT_MAX = 1e6   # GB: RLIMIT_AS is a 64-bit byte count


def build_parser() -> argparse.ArgumentParser:
    from .bench import DEFAULT, IMPLEMENTATIONS, PATTERNS, QUICK

    parser = argparse.ArgumentParser(prog="sparse-attn", description="Exact block-sparse attention: inspect "
                                     "patterns and benchmark time and memory against dense attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,patterns,show,bench}")
    sub.add_parser("info", help="versions, devices and which backends run here").set_defaults(run=cmd_info)
    sub.add_parser("patterns", help="the presets with their density at 4K and 16K tokens").set_defaults(
        run=cmd_patterns)

    show = sub.add_parser("show", help="density, blocks, FLOPs and an ASCII grid of a pattern; a figure with --out",
                          description="PATTERN: a benchmark label, a preset name, a .toml file, or an "
                                      "expression such as \"Local(64) | Global(first=2)\". Sizes accept 4096, 4k "
                                      "(x 1024), 1M (x 1024**2).")
    show.add_argument("pattern", metavar="PATTERN", help=f"a benchmark label ({', '.join(PATTERNS)}), a preset "
                      f"({', '.join(presets.list_presets())}), a .toml file or an expression")
    show.add_argument("--seq-len", type=_count, default=_SHOW_LENGTH, metavar="N", help="sequence length, e.g. "
                      f"4096 or 4k (default {_short(_SHOW_LENGTH)})")
    show.add_argument("--head", type=_head, default=0, metavar="H", help="the head the text grid draws (default "
                      "0; the heads of PerHead and Random patterns differ)")
    show.add_argument("--heads", type=_head_list, metavar="0,1,...", help=f"heads the figure (--out) draws, at most "
                      f"{_FIGURE_HEADS} (default: the first 4)")
    show.add_argument("--num-heads", type=_count, metavar="H", help="heads of the layout (default: the preset "
                      "file's, else a PerHead's length, else enough for --heads and --head)")
    show.add_argument("--block-size", type=_count, default=64, metavar="B", help="block size (default 64)")
    show.add_argument("--head-dim", type=_count, default=64, metavar="D", help="head dim for the FLOP count "
                      "(default 64)")
    show.add_argument("--zoom", type=_count, metavar="T", help="tokens in the zoomed corner of the figure, at most "
                      "8K (default 16 blocks, at most N)")
    show.add_argument("--out", type=Path, metavar="FILE.png", help="write a figure; its directory is created "
                      "(default: none; needs matplotlib)")
    show.set_defaults(run=cmd_show)

    bench = sub.add_parser("bench", help="time and peak memory versus sequence length, each point in a fresh "
                           "process; writes results.json, results.md, time.png, memory.png",
                           description="Sizes accept 4096, 4k (x 1024), 1M (x 1024**2).")
    bench.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK.patterns)}, N = "
                       f"{', '.join(map(_short, QUICK.lengths))}, {', '.join(QUICK.implementations)}, forward, "
                       f"{QUICK.repeats} timed calls per point: a few minutes (default: off)")
    bench.add_argument("--out", type=Path, metavar="DIR", help=f"output directory; an existing results.json is "
                       f"kept unless --overwrite (default: {_BENCH_OUT}, or {_BENCH_OUT}-2, -3, ... when it holds "
                       f"results: every run gets a fresh folder)")
    bench.add_argument("--overwrite", action="store_true", help=f"replace the results already in --out, or in "
                       f"{_BENCH_OUT} without --out (default: refuse)")
    labels = [f"{label} (= {expression})" for label, expression in PATTERNS.items() if label != expression]
    bench.add_argument("--patterns", nargs="+", metavar="PATTERN", help=f"{', '.join(labels)}, a preset "
                       f"({', '.join(presets.list_presets())}), a .toml file or an expression "
                       f"(default: {' '.join(DEFAULT.patterns)})")
    bench.add_argument("--lengths", nargs="+", type=_count, metavar="N", help="sequence lengths (default: "
                       f"{' '.join(map(_short, DEFAULT.lengths))})")
    bench.add_argument("--backends", nargs="+", metavar="IMPL", help=f"implementations: {', '.join(IMPLEMENTATIONS)} "
                       f"(default: {' '.join(DEFAULT.implementations)})")
    bench.add_argument("--backward", action="store_true", help="time forward + backward (default: forward only)")
    bench.add_argument("--batch", type=_count, default=1, metavar="B", help="batch size (default 1)")
    bench.add_argument("--num-heads", type=_count, default=8, metavar="H", help="heads (default 8)")
    bench.add_argument("--head-dim", type=_count, default=64, metavar="D", help="head dim (default 64)")
    bench.add_argument("--block-size", type=_count, default=64, metavar="B", help="block size (default 64)")
    bench.add_argument("--repeats", type=_count, metavar="R", help=f"timed calls per point (default "
                       f"{DEFAULT.repeats}, --quick {QUICK.repeats})")
    bench.add_argument("--timeout", type=_bounded(_TIMEOUT_MAX), metavar="S", help=f"seconds per point, at most "
                       f"{_TIMEOUT_MAX:,.0f} (default {DEFAULT.timeout}, --quick {QUICK.timeout})")
    bench.add_argument("--memory-limit-gb", type=_bounded(_MEMORY_LIMIT_MAX), default=12.0, metavar="G",
                       help="address-space cap of each point's process in GB (default 12)")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when torch sees a GPU, else cpu")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar (default: a tqdm bar on stderr)")
    bench.set_defaults(run=cmd_bench)
    return parser


def _command_line(argv: list[str]) -> str:
    """The command as a shell would take it back (quoted), undecodable bytes as escapes.

    >>> print(_command_line(["show", "Local(64) | Global(first=2)", "--seq-len", "4k"]))
    sparse-attn show 'Local(64) | Global(first=2)' --seq-len 4k
    """
    return shlex.join(["sparse-attn", *argv]).encode("utf-8", "backslashreplace").decode()


def _short(n: int) -> str:
    """4096 -> '4K' (the way the help writes lengths)."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        args.run(args)
        sys.stdout.flush()               # a reader that left shows here, not at exit
    except (UsageError, PatternTextError, ImportError) as error:
        parser.exit(2, f"sparse-attn: error: {error}\n")
    except BenchFailed as error:
        parser.exit(1, f"sparse-attn: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(130, "sparse-attn: interrupted\n")
    except BrokenPipeError:              # `sparse-attn show ... | head`: stop quietly, as a shell tool does
        _drop_stdout()
        return _BROKEN_PIPE
    return 0


def _drop_stdout() -> None:
    """Point stdout at the null device, so that Python's flush at exit finds no closed pipe to complain about."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
    except (OSError, ValueError):        # stdout is no file (replaced by a caller): nothing is flushed to a pipe
        pass


if __name__ == "__main__":
    sys.exit(main())
