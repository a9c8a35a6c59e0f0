"""The ``sparse-attn`` command (also ``python -m sparse_attn``).

    sparse-attn info                                  versions, devices, backends
    sparse-attn patterns                              presets with density at 4K and 16K tokens
    sparse-attn show "Local(64) | Global(first=2)" --seq-len 4096 [--heads 0,1] [--out fig.png]
    sparse-attn bench --quick                         time and memory versus N, JSON + markdown + PNG

PATTERN arguments are a preset name (``bigbird-itc``), a TOML file, or an expression over the
pattern constructors, parsed with ``ast`` and evaluated by walking the tree (no ``eval``): calls,
int/str/bool constants, lists/tuples, keyword arguments, unary minus, ``|`` and ``&``.
Errors in the arguments print ``sparse-attn: error: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import ast
import platform
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


class UsageError(Exception):
    """A bad argument: printed as ``sparse-attn: error: ...``, exit status 2."""


# ------------------------------------------------------------------------------------------------
# PATTERN arguments
# ------------------------------------------------------------------------------------------------
def parse_pattern(text: str) -> tuple[Pattern, int | None]:
    """A preset name, a TOML file or a safe expression -> (pattern, heads the file asks for or None).

    >>> parse_pattern("Local(64) | Global(first=2)")
    (Local(64) | Global(first=2), None)
    >>> parse_pattern("__import__('os')")
    Traceback (most recent call last):
    ...
    sparse_attn.cli.UsageError: pattern expression: '__import__' is not a pattern constructor; use one of ...
    """
    preset_file = presets._preset_dir() / f"{text}.toml"
    if "/" not in text and preset_file.is_file():
        return presets.preset(text), _file_heads(preset_file)
    if text.endswith(".toml"):
        try:
            return presets.load_pattern(text), _file_heads(Path(text))
        except (ValueError, TypeError) as error:
            raise UsageError(str(error)) from None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as error:
        raise UsageError(f"pattern {text!r} is not a preset ({', '.join(presets.list_presets())}), a .toml "
                         f"file or a valid expression: {error.msg}") from None
    try:
        value = _evaluate(tree.body)
    except UsageError:
        raise
    except (ValueError, TypeError) as error:
        raise UsageError(f"pattern expression {text!r}: {error}") from None
    if not isinstance(value, Pattern):
        raise UsageError(f"pattern expression {text!r} gives a {type(value).__name__}, not a Pattern; "
                         f"call it, e.g. 'longformer()'")
    return value, None


def _file_heads(path: Path) -> int | None:
    return presets._read(path).get("heads")


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
        left, right = _evaluate(node.left), _evaluate(node.right)
        for side in (left, right):
            if not isinstance(side, Pattern):
                raise UsageError(f"pattern expression: '|' and '&' combine patterns, got {side!r}")
        return left | right if isinstance(node.op, ast.BitOr) else left & right
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
    raise UsageError(f"pattern expression: {ast.unparse(node)!r} is not allowed; use pattern constructors "
                     f"({', '.join(CONSTRUCTORS)}), int/str/bool constants, lists, '|' and '&'")


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
    """(name, description, heads, density at 4K, density at 16K) per preset, block 64."""
    rows = []
    for name, description in presets.list_presets().items():
        pattern = presets.preset(name)
        heads = _file_heads(presets._preset_dir() / f"{name}.toml") or 1
        d4, d16 = (pattern.layout(n, heads=heads).density for n in (4096, 16384))
        rows.append((name, description, heads, d4, d16))
    return rows


def cmd_patterns(args) -> None:
    rows = preset_rows()
    width = max(len(r[0]) for r in rows)
    print(f"{'preset':<{width}}  {'@4K':>7}  {'@16K':>7}  description")
    for name, description, _, d4, d16 in rows:
        print(f"{name:<{width}}  {d4:>7.2%}  {d16:>7.2%}  {description}")
    print("\ndensity = allowed token pairs / N^2 (block 64); show one with: sparse-attn show NAME --seq-len 4096")


def cmd_show(args) -> None:
    pattern, file_heads = parse_pattern(args.pattern)
    n_heads = args.num_heads or file_heads or (max(args.heads) + 1 if args.heads else 1)
    heads = args.heads or list(range(min(n_heads, 4)))
    if max(heads) >= n_heads:
        raise UsageError(f"--heads {','.join(map(str, heads))} needs head indices below the pattern's "
                         f"{n_heads} heads; pass --num-heads")
    try:
        layout = pattern.layout(args.seq_len, heads=n_heads, block_size=args.block_size)
    except (ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    dense_flops = 4 * args.head_dim * args.seq_len * args.seq_len * n_heads
    print(layout)
    print(f"  nnz blocks {layout.nnz_blocks:,}; forward FLOPs (head_dim {args.head_dim}) "
          f"{layout.flops(args.head_dim):.3g} = {layout.flops(args.head_dim) / dense_flops:.2%} of dense "
          f"({dense_flops:.3g})")
    if args.out:
        from . import viz

        figure = viz.plot_layout(layout, heads=heads, zoom=args.zoom)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


def cmd_bench(args) -> None:
    from . import bench

    quick = bench.QUICK if args.quick else {}
    labels = args.patterns or quick.get("patterns") or list(bench.PATTERNS)
    patterns = {}
    for label in labels:
        pattern, file_heads = parse_pattern(bench.PATTERNS.get(label, label))
        try:
            pattern._check_heads(args.num_heads)
        except ValueError as error:
            hint = f"; pass --num-heads {file_heads}" if file_heads else ""
            raise UsageError(f"pattern {label!r} does not fit --num-heads {args.num_heads}: {error}{hint}") from None
        patterns[label] = pattern
    implementations = args.backends or quick.get("backends") or bench.DEFAULT_IMPLEMENTATIONS
    unknown = [name for name in implementations if name not in bench.IMPLEMENTATIONS]
    if unknown:
        raise UsageError(f"unknown --backends {', '.join(unknown)}; choose from {', '.join(bench.IMPLEMENTATIONS)}")
    lengths = args.lengths or quick.get("lengths") or bench.DEFAULT_LENGTHS
    device = args.device or ("cuda" if __import__("torch").cuda.is_available() else "cpu")
    command = "sparse-attn " + " ".join(args.argv)
    results = bench.sweep(patterns, lengths, implementations, batch=args.batch, heads=args.num_heads,
                          head_dim=args.head_dim, block_size=args.block_size, backward=args.backward,
                          repeats=args.repeats or quick.get("repeats", 3),
                          timeout=args.timeout or quick.get("timeout", 120), memory_limit_gb=args.memory_limit_gb,
                          device=device, command=command, progress=not args.no_progress, out=args.out)
    for path in bench.write(results, args.out):
        print(f"wrote {path}")
    print(bench.tables(results).strip())


# ------------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------------
def _positive(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", "")) if not text.lower().endswith("k") else \
            int(text[:-1]) * 1024
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (or 4k, 16k), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _head_list(text: str) -> list[int]:
    try:
        heads = [int(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated head indices like 0,1,2, got {text!r}") from None
    if not heads or min(heads) < 0:
        raise argparse.ArgumentTypeError(f"expected head indices >= 0 like 0,1,2, got {text!r}")
    return heads


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparse-attn", description="Exact block-sparse attention: inspect "
                                     "patterns and benchmark time and memory against dense attention.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{info,patterns,show,bench}")
    sub.add_parser("info", help="versions, devices and which backends run here").set_defaults(run=cmd_info)
    sub.add_parser("patterns", help="the presets with their density at 4K and 16K tokens").set_defaults(
        run=cmd_patterns)

    show = sub.add_parser("show", help="density, blocks, FLOPs and an ASCII grid of a pattern; a figure with --out",
                          description="PATTERN: a preset name, a .toml file, or an expression such as "
                                      "\"Local(64) | Global(first=2)\".")
    show.add_argument("pattern", metavar="PATTERN")
    show.add_argument("--seq-len", type=_positive, required=True, metavar="N")
    show.add_argument("--heads", type=_head_list, metavar="0,1,...", help="heads to draw (default: up to 4)")
    show.add_argument("--num-heads", type=_positive, help="heads of the layout (default: the preset's, else "
                      "enough for --heads, else 1)")
    show.add_argument("--block-size", type=_positive, default=64, metavar="B")
    show.add_argument("--head-dim", type=_positive, default=64, help="for the FLOP count (default 64)")
    show.add_argument("--zoom", type=_positive, help="tokens in the zoomed corner (default 4 blocks)")
    show.add_argument("--out", type=Path, metavar="FILE.png", help="write a figure (needs matplotlib)")
    show.set_defaults(run=cmd_show)

    bench = sub.add_parser("bench", help="time and peak memory versus sequence length, each point in a fresh "
                           "process; writes results.json, results.md, time.png, memory.png")
    bench.add_argument("--quick", action="store_true", help="longformer, N = 1K..8K, numba vs dense SDPA "
                       "(with and without the pattern as a mask), forward: a few minutes")
    bench.add_argument("--out", type=Path, default=Path("bench-results"), metavar="DIR")
    bench.add_argument("--patterns", nargs="+", metavar="PATTERN", help="longformer, bigbird-itc (default: both), "
                       "any preset, .toml file or expression")
    bench.add_argument("--lengths", nargs="+", type=_positive, metavar="N", help="default 1K .. 64K")
    bench.add_argument("--backends", nargs="+", metavar="IMPL", help="implementations: sparse_attn-numba, "
                       "sparse_attn-triton, sparse_attn-reference, sdpa-dense, sdpa-masked, flex, hf-longformer")
    bench.add_argument("--backward", action="store_true", help="time forward + backward")
    bench.add_argument("--batch", type=_positive, default=1)
    bench.add_argument("--num-heads", type=_positive, default=8)
    bench.add_argument("--head-dim", type=_positive, default=64)
    bench.add_argument("--block-size", type=_positive, default=64)
    bench.add_argument("--repeats", type=_positive, help="timed calls per point (default 3, --quick 2)")
    bench.add_argument("--timeout", type=_positive_float, metavar="S", help="seconds per point (default 120, "
                       "--quick 60)")
    bench.add_argument("--memory-limit-gb", type=_positive_float, default=12.0,
                       help="address-space cap of each point's process (default 12)")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(run=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        args.run(args)
    except (UsageError, ImportError) as error:
        parser.exit(2, f"sparse-attn: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
