"""The ``sparse-attn`` command (also ``python -m sparse_attn``).

    sparse-attn info                                  versions, devices, backends
    sparse-attn patterns                              presets with density at 4K and 16K tokens
    sparse-attn show "Local(64) | Global(first=2)" --seq-len 4k [--heads 0,1] [--out fig.png]
    sparse-attn bench --quick                         time and memory versus N, JSON + markdown + PNG

PATTERN arguments are a preset name (``bigbird-itc``), a TOML file (a path ending in ``.toml``, or
one with a ``/`` and no call in it), or an expression over the pattern constructors, parsed with ``ast`` and evaluated
by walking the tree (no ``eval``): calls, int/str/bool constants, lists/tuples, keyword
arguments, unary minus, ``|`` and ``&``. Sizes take ``k`` (1024) and ``M`` (1024**2) suffixes.
Errors in the arguments print ``sparse-attn: error: ...`` and exit with status 2, before any work.

``--help`` imports neither torch nor matplotlib; each subcommand imports what it uses.
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import math
import operator
import os
import platform
import re
import shlex
import sys
from pathlib import Path

from . import presets
from .pattern import Causal, Dense, Dilated, Global, Local, Pattern, PerHead, Random, Sink, Stride

CONSTRUCTORS = {
    "Local": Local, "Stride": Stride, "Dilated": Dilated, "Global": Global, "Sink": Sink, "Random": Random,
    "Causal": Causal, "Dense": Dense, "PerHead": PerHead, "longformer": presets.longformer,
    "bigbird": presets.bigbird, "sparse_transformer": presets.sparse_transformer, "streaming": presets.streaming,
    "preset": presets.preset,
}
_NAME = re.compile(r"[A-Za-z][\w-]*")    # a preset name (or a benchmark label), never an expression or a path
_BAD_ARGUMENT = (ValueError, TypeError, OverflowError, MemoryError, RecursionError)  # what bad sizes or patterns raise


class UsageError(Exception):
    """A bad argument: printed as ``sparse-attn: error: ...``, exit status 2."""


# ------------------------------------------------------------------------------------------------
# PATTERN arguments
# ------------------------------------------------------------------------------------------------
def parse_pattern(text: str, named: dict[str, str] | None = None) -> tuple[Pattern, int | None]:
    """A preset name, a TOML file or a safe expression -> (pattern, heads the file asks for or None).

    ``named`` maps extra names (the benchmark's labels) to PATTERN strings.

    >>> parse_pattern("Local(64) | Global(first=2)")
    (Local(64) | Global(first=2), None)
    >>> parse_pattern("bigbird-itx")
    Traceback (most recent call last):
    ...
    sparse_attn.cli.UsageError: no preset named 'bigbird-itx'; did you mean bigbird-itc? ...
    >>> parse_pattern("__import__('os')")
    Traceback (most recent call last):
    ...
    sparse_attn.cli.UsageError: pattern expression: '__import__' is not a pattern constructor; use one of ...
    """
    named = named or {}
    if text in named:
        return parse_pattern(named[text])
    if text.endswith(".toml") or ("/" in text or os.sep in text) and "(" not in text:  # expressions call
        return _load_file(text)
    if _NAME.fullmatch(text) and text not in CONSTRUCTORS:
        return _load_preset(text, named)
    return _parse_expression(text), None


def _load_file(text: str) -> tuple[Pattern, int | None]:
    try:
        return presets.load_pattern(text), presets.declared_heads(text)
    except _BAD_ARGUMENT as error:
        raise UsageError(str(error)) from None


def _load_preset(name: str, named: dict[str, str]) -> tuple[Pattern, int | None]:
    choices = list(dict.fromkeys([*named, *presets.list_presets()]))
    if name not in choices:
        raise UsageError(f"no preset named {name!r}; {presets.did_you_mean(name, choices)}PATTERN is one of "
                         f"{', '.join(choices)}, a .toml file or an expression such as 'Local(64) | Global(first=2)'")
    path = presets.preset_path(name)
    return presets.load_pattern(path), presets.declared_heads(path)


def _parse_expression(text: str) -> Pattern:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise UsageError(f"pattern {text[:80]!r} is not a preset ({', '.join(presets.list_presets())}), a .toml "
                         f"file or a valid expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise UsageError(f"pattern expression of {len(text):,} characters nests too deeply for Python's parser; "
                         f"write it to a .toml file with sa.save_pattern") from None
    except UnicodeError:  # bytes that are not UTF-8 arrive as surrogates
        raise UsageError(f"pattern {text!r} is not valid UTF-8 text") from None
    try:
        value = _evaluate(tree.body)
    except UsageError:
        raise
    except _BAD_ARGUMENT as error:
        raise UsageError(f"pattern expression {text[:200]!r}: {error or type(error).__name__}") from None
    if not isinstance(value, Pattern):
        raise UsageError(f"pattern expression {text!r} gives a {type(value).__name__}, not a Pattern; "
                         f"call it, e.g. 'longformer()'")
    return value


def _operands(node: ast.BinOp) -> list[ast.AST]:
    """``a | b | c`` parses as ``(a | b) | c``: its operands left to right, without recursion."""
    op, operands = type(node.op), []
    while isinstance(node, ast.BinOp) and isinstance(node.op, op):
        operands.append(node.right)
        node = node.left
    return [node, *reversed(operands)]


def _evaluate(node: ast.AST):
    """Walk an expression tree that may only build patterns."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str, bool)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(item) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _evaluate(node.operand)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"pattern expression: unary minus applies to ints only, got {value!r}")
        return -value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitOr, ast.BitAnd)):
        values = [_evaluate(operand) for operand in _operands(node)]
        for value in values:
            if not isinstance(value, Pattern):
                raise UsageError(f"pattern expression: '|' and '&' combine patterns, got {value!r}")
        return functools.reduce(operator.or_ if isinstance(node.op, ast.BitOr) else operator.and_, values)
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in CONSTRUCTORS:
            name = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)
            raise UsageError(f"pattern expression: {name!r} is not a pattern constructor; use one of "
                             f"{', '.join(CONSTRUCTORS)}")
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            raise UsageError("pattern expression: *args and **kwargs are not allowed")
        args = [_evaluate(a) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value) for k in node.keywords}
        return CONSTRUCTORS[node.func.id](*args, **kwargs)
    if isinstance(node, ast.Name) and node.id in CONSTRUCTORS:
        raise UsageError(f"pattern expression: {node.id} must be called, e.g. {node.id}(...)")
    if isinstance(node, ast.Name):
        raise UsageError(f"{node.id!r} is not a preset ({', '.join(presets.list_presets())}), a .toml file or a "
                         f"pattern expression such as 'Local(64) | Global(first=2)'")
    raise UsageError(f"pattern expression: {ast.unparse(node)[:80]!r} is not allowed; use pattern constructors "
                     f"({', '.join(CONSTRUCTORS)}), int/str/bool constants, lists, '|' and '&'")


def per_head_count(pattern: Pattern) -> int | None:
    """The number of heads a ``PerHead`` inside ``pattern`` asks for, None without one.

    >>> per_head_count(PerHead([Local(1), Dense()]) | Global(first=1))
    2
    """
    lengths, stack = set(), [pattern]
    while stack:  # iterative: expressions may nest deeply
        node = stack.pop()
        if isinstance(node, PerHead):
            lengths.add(len(node.patterns))
        stack.extend(getattr(node, "patterns", ()))      # the members of PerHead, | and &
    return lengths.pop() if len(lengths) == 1 else None  # several lengths: the layout says which is wrong


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
        raise UsageError(f"--out {path}: expected a file name ending in a figure format ({', '.join(sorted(formats))}), "
                         f"e.g. fig.png")
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name such as {path / 'fig.png'}")
    _writable_dir(path.parent, f"--out {path}")


def _check_bench_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; bench writes a directory (results.json, results.md, time.png, "
                         f"memory.png)")
    if (out / "results.json").exists() and not overwrite:
        raise UsageError(f"--out {out} already holds results.json; pass --overwrite to replace it, or another --out")
    _writable_dir(out, f"--out {out}")


# ------------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------------
def cmd_info(args) -> None:
    import torch

    from . import backends, bench

    print(f"sparse_attn {bench.versions(['sparse-attn'])['sparse-attn'] or '(not installed)'}")
    print(f"Python {platform.python_version()} ({platform.platform()})")
    for package, version in bench.versions(("torch", "numba", "triton", "transformers", "matplotlib", "tqdm")).items():
        print(f"{package:<13}{version or 'not installed'}")
    print("devices:")
    print(f"  cpu          {platform.machine()}, {bench.cpus()} CPUs, torch threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            print(f"  cuda:{index}       {torch.cuda.get_device_name(index)}")
    else:
        print("  cuda         not available")
    print("backends:")
    for name in backends.MODULES:
        ok, reason = backends.availability(name)
        print(f"  {name:<12} {'available' if ok else 'unavailable'}" + (f": {reason}" if reason else ""))


def preset_rows() -> list[tuple[str, str, int, float, float]]:
    """(name, description, heads, token density at 4K, at 16K) per preset."""
    rows = []
    for name, description in presets.list_presets().items():
        pattern, heads = parse_pattern(name)
        d4, d16 = (pattern.layout(n, heads=heads or 1).density for n in (4096, 16384))
        rows.append((name, description, heads or 1, d4, d16))
    return rows


def cmd_patterns(args) -> None:
    rows = preset_rows()
    width = max(len(r[0]) for r in rows)
    print(f"{'preset':<{width}}  {'@4K':>7}  {'@16K':>7}  description")
    for name, description, _, d4, d16 in rows:
        print(f"{name:<{width}}  {d4:>7.2%}  {d16:>7.2%}  {description}")
    print("\ntoken density = allowed token pairs / N^2; show one with: sparse-attn show NAME --seq-len 4096")


def cmd_show(args) -> None:
    pattern, file_heads = parse_pattern(args.pattern)
    n_heads = args.num_heads or file_heads or per_head_count(pattern) or (max(args.heads) + 1 if args.heads else 1)
    heads = list(dict.fromkeys(args.heads or range(min(n_heads, 4))))
    if max(heads) >= n_heads:
        raise UsageError(f"--heads {','.join(map(str, heads))} needs head indices below the pattern's "
                         f"{n_heads} heads; pass --num-heads")
    if args.out:
        if len(heads) > _FIGURE_HEADS:
            raise UsageError(f"--heads: a figure draws at most {_FIGURE_HEADS} heads, got {len(heads)}; "
                             f"write several figures")
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
    print(layout)
    print(f"  forward FLOPs (head_dim {args.head_dim}) {layout.flops(args.head_dim):.3g} = "
          f"{layout.flops(args.head_dim) / dense_flops:.2%} of dense ({dense_flops:.3g})")
    if args.out:
        from . import viz

        viz.plot_layout(layout, heads=heads, zoom=args.zoom).savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


def bench_patterns(labels: list[str], num_heads: int) -> dict[str, Pattern]:
    """label -> Pattern for ``bench --patterns``, each checked against ``--num-heads``."""
    from . import bench

    patterns = {}
    for label in labels:
        pattern, file_heads = parse_pattern(label, named=bench.PATTERNS)
        try:
            pattern.check_heads(num_heads)
        except ValueError as error:
            needed = file_heads or per_head_count(pattern)
            hint = f"; pass --num-heads {needed}" if needed else ""
            raise UsageError(f"pattern {label!r} does not fit --num-heads {num_heads}: {error}{hint}") from None
        patterns[label] = pattern
    return patterns


def _check_bench_setup(args, implementations: list[str]) -> None:
    """What the sweep and the figures need, checked before the first point runs."""
    import torch

    from . import bench

    unknown = [name for name in implementations if name not in bench.IMPLEMENTATIONS]
    if unknown:
        raise UsageError(f"unknown --backends {', '.join(unknown)}; choose from {', '.join(bench.IMPLEMENTATIONS)}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    for module, why in (("matplotlib", "time.png and memory.png"), ("tqdm", "the progress bar (or pass --no-progress)")):
        if (module == "matplotlib" or not args.no_progress) and importlib.util.find_spec(module) is None:
            raise UsageError(f"bench needs {module} for {why}: pip install 'sparse-attn[bench]'")
    _check_bench_dir(args.out, args.overwrite)


def cmd_bench(args) -> None:
    import torch

    from . import bench

    quick = bench.QUICK if args.quick else {}
    patterns = bench_patterns(args.patterns or quick.get("patterns") or list(bench.PATTERNS), args.num_heads)
    implementations = args.backends or quick.get("backends") or bench.DEFAULT_IMPLEMENTATIONS
    _check_bench_setup(args, implementations)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    unavailable = bench.unavailable_reasons(patterns, implementations, device, args.backward)
    for (label, name), reason in unavailable.items():
        print(f"n/a: {name} on {label}: {reason}")
    results = bench.sweep(patterns, sorted(set(args.lengths or quick.get("lengths") or bench.DEFAULT_LENGTHS)),
                          implementations, batch=args.batch, heads=args.num_heads, head_dim=args.head_dim,
                          block_size=args.block_size, backward=args.backward,
                          repeats=args.repeats or quick.get("repeats", 3),
                          timeout=args.timeout or quick.get("timeout", 120), memory_limit_gb=args.memory_limit_gb,
                          device=device, command=_command_line(args.argv),
                          progress=not args.no_progress, out=args.out, unavailable=unavailable)
    for path in bench.write(results, args.out):
        print(f"wrote {path}")
    print(bench.tables(results).strip())


# ------------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------------
_SUFFIXES = {"k": 1024, "m": 1024 ** 2}


def _count(text: str) -> int:
    """A positive integer: ``4096``, ``16_384``, ``16,384``, ``4k`` / ``4K`` (x 1024), ``1M`` (x 1024**2)."""
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
_TIMEOUT_MAX = 1e6        # seconds (11 days): subprocess waits overflow past about 2e6 s
_MEMORY_LIMIT_MAX = 1e6   # GB: RLIMIT_AS is a 64-bit byte count


def build_parser() -> argparse.ArgumentParser:
    from .bench import DEFAULT_IMPLEMENTATIONS, DEFAULT_LENGTHS, IMPLEMENTATIONS, PATTERNS, QUICK

    parser = argparse.ArgumentParser(prog="sparse-attn", description="Exact block-sparse attention: inspect "
                                     "patterns and benchmark time and memory against dense attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,patterns,show,bench}")
    sub.add_parser("info", help="versions, devices and which backends run here").set_defaults(run=cmd_info)
    sub.add_parser("patterns", help="the presets with their density at 4K and 16K tokens").set_defaults(
        run=cmd_patterns)

    show = sub.add_parser("show", help="density, blocks, FLOPs and an ASCII grid of a pattern; a figure with --out",
                          description="PATTERN: a preset name, a .toml file, or an expression such as "
                                      "\"Local(64) | Global(first=2)\". Sizes accept 4096, 4k (x 1024), 1M "
                                      "(x 1024**2).")
    show.add_argument("pattern", metavar="PATTERN", help=f"a preset ({', '.join(presets.list_presets())}), a .toml "
                      f"file or an expression")
    show.add_argument("--seq-len", type=_count, required=True, metavar="N", help="sequence length, e.g. 4096 or 4k "
                      "(required)")
    show.add_argument("--heads", type=_head_list, metavar="0,1,...", help=f"heads to draw, at most "
                      f"{_FIGURE_HEADS} (default: the first 4)")
    show.add_argument("--num-heads", type=_count, metavar="H", help="heads of the layout (default: the preset "
                      "file's, else a PerHead's length, else enough for --heads, else 1)")
    show.add_argument("--block-size", type=_count, default=64, metavar="B", help="block size (default 64)")
    show.add_argument("--head-dim", type=_count, default=64, metavar="D", help="head dim for the FLOP count "
                      "(default 64)")
    show.add_argument("--zoom", type=_count, metavar="T", help="tokens in the zoomed corner of the figure "
                      "(default 4 blocks, at most N)")
    show.add_argument("--out", type=Path, metavar="FILE.png", help="write a figure; its directory is created "
                      "(default: none; needs matplotlib)")
    show.set_defaults(run=cmd_show)

    quick = QUICK
    bench = sub.add_parser("bench", help="time and peak memory versus sequence length, each point in a fresh "
                           "process; writes results.json, results.md, time.png, memory.png",
                           description="Sizes accept 4096, 4k (x 1024), 1M (x 1024**2).")
    bench.add_argument("--quick", action="store_true", help=f"{', '.join(quick['patterns'])}, N = "
                       f"{', '.join(map(_short, quick['lengths']))}, {', '.join(quick['backends'])}, forward, "
                       f"{quick['repeats']} timed calls per point: a few minutes (default: off)")
    bench.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR", help="output directory "
                       "(default: bench-results); an existing results.json is kept unless --overwrite")
    bench.add_argument("--overwrite", action="store_true", help="replace the results already in --out "
                       "(default: refuse)")
    labels = [f"{label} (= {expression})" for label, expression in PATTERNS.items() if label != expression]
    bench.add_argument("--patterns", nargs="+", metavar="PATTERN", help=f"{', '.join(labels)}, a preset "
                       f"({', '.join(presets.list_presets())}), a .toml file or an expression "
                       f"(default: {' '.join(PATTERNS)})")
    bench.add_argument("--lengths", nargs="+", type=_count, metavar="N", help="sequence lengths (default: "
                       f"{' '.join(map(_short, DEFAULT_LENGTHS))})")
    bench.add_argument("--backends", nargs="+", metavar="IMPL", help=f"implementations: {', '.join(IMPLEMENTATIONS)} "
                       f"(default: {' '.join(DEFAULT_IMPLEMENTATIONS)})")
    bench.add_argument("--backward", action="store_true", help="time forward + backward (default: forward only)")
    bench.add_argument("--batch", type=_count, default=1, metavar="B", help="batch size (default 1)")
    bench.add_argument("--num-heads", type=_count, default=8, metavar="H", help="heads (default 8)")
    bench.add_argument("--head-dim", type=_count, default=64, metavar="D", help="head dim (default 64)")
    bench.add_argument("--block-size", type=_count, default=64, metavar="B", help="block size (default 64)")
    bench.add_argument("--repeats", type=_count, metavar="R", help=f"timed calls per point (default 3, --quick "
                       f"{quick['repeats']})")
    bench.add_argument("--timeout", type=_bounded(_TIMEOUT_MAX), metavar="S", help=f"seconds per point, at most "
                       f"{_TIMEOUT_MAX:,.0f} (default 120, --quick {quick['timeout']})")
    bench.add_argument("--memory-limit-gb", type=_bounded(_MEMORY_LIMIT_MAX), default=12.0, metavar="G",
                       help="address-space cap of each point's process in GB (default 12)")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when torch sees a GPU, else cpu")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar (default: a tqdm bar on stderr)")
    bench.set_defaults(run=cmd_bench)
    return parser


def _command_line(argv: list[str]) -> str:
    """The command as a shell would take it back (quoted), undecodable bytes as escapes."""
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
    except (UsageError, ImportError) as error:
        parser.exit(2, f"sparse-attn: error: {error}\n")
    except KeyboardInterrupt:
        parser.exit(130, "sparse-attn: interrupted\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
