"""Named patterns: the constructors of the well-known models and the preset files in ``patterns/``.

>>> import sparse_attn as sa
>>> sa.longformer(window=512)
Local(256) | Global(tokens=(0,))
>>> sa.preset("streaming-llm")
(Sink(first=4) | Local(1019, 0)) & Causal()

A preset file is TOML: ``name``, ``description``, optional ``heads`` (for per-head patterns) and a
``[pattern]`` table that is ``Pattern.to_dict()`` written out.
"""
from __future__ import annotations

import difflib
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from .blocks import ceil_div
from .checks import check_int
from .pattern import Causal, Global, Local, Pattern, Random, Sink, Stride
from .rules import Context, resolve
from .tiles import allowed_pairs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ------------------------------------------------------------------------------------------------
# Constructors
# ------------------------------------------------------------------------------------------------
def longformer(window: int = 512, global_tokens=(0,)) -> Pattern:
    """Longformer: ``attention_window=window`` (window // 2 each side) plus global tokens.

    >>> longformer(8, global_tokens=())
    Local(4)
    """
    check_int("window", window, 0)
    if window % 2:
        raise ValueError(f"window must be even (Longformer's attention_window covers window // 2 tokens each "
                         f"side), got {window}; use {window + 1}")
    local = Local(window // 2)
    return local | Global(tokens=global_tokens) if tuple(global_tokens) else local


def bigbird(block: int = 64, window_blocks: int = 3, global_blocks: int = 2, random_blocks: int = 3,
            seed: int = 0) -> Pattern:
    """BigBird ITC: sliding blocks, global blocks at both ends, random blocks.

    Query block ``i // block`` sees key blocks ``i // block - w .. i // block + w`` with
    ``w = window_blocks // 2``; the first ``ceil(g / 2)`` and last ``floor(g / 2)`` blocks are
    global (HF BigBird's first and last block for g = 2); each query block also sees
    ``random_blocks`` blocks chosen among the rest.
    """
    for name, value, minimum in (("block", block, 1), ("window_blocks", window_blocks, 1),
                                 ("global_blocks", global_blocks, 0), ("random_blocks", random_blocks, 0)):
        check_int(name, value, minimum)
    if window_blocks % 2 == 0:
        raise ValueError(f"window_blocks must be odd (the query block plus as many on each side), got "
                         f"{window_blocks}; use {window_blocks + 1}")
    pattern: Pattern = Local(window_blocks // 2, block_size=block)
    if global_blocks:
        pattern = pattern | Global(first=ceil_div(global_blocks, 2) * block, last=global_blocks // 2 * block)
    if random_blocks:
        pattern = pattern | Random(random_blocks, seed=seed, block_size=block)
    return pattern


def sparse_transformer(stride: int, mode: str = "strided", summary: int = 1) -> Pattern:
    """Sparse Transformer (Child et al. 2019), autoregressive.

    ``"strided"``: the previous ``stride`` tokens and every ``stride``-th token before.
    ``"fixed"``: the tokens of the same aligned block of ``stride`` and the last ``summary`` tokens
    of every block.

    >>> sparse_transformer(4)
    (Local(3, 0) | Stride(4)) & Causal()
    """
    check_int("stride", stride, 1)
    if mode == "strided":
        return (Local(stride - 1, 0) | Stride(stride)) & Causal()
    if mode == "fixed":
        check_int("summary", summary, 1)
        return (Local(0, block_size=stride) | Sink(period=stride, width=summary)) & Causal()
    raise ValueError(f"mode must be 'strided' or 'fixed', got {mode!r}")


def streaming(sink: int = 4, window: int = 1020) -> Pattern:
    """StreamingLLM: ``sink`` first tokens plus the ``window`` most recent ones (self included), causal.

    The defaults keep 1,024 keys per query, as in the StreamingLLM paper's cache.
    """
    check_int("sink", sink, 0)
    check_int("window", window, 1)
    recent = Local(window - 1, 0)
    return ((Sink(first=sink) | recent) if sink else recent) & Causal()


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------
def _preset_dir() -> Path:
    """``sparse_attn/patterns`` in an installed wheel, the top-level ``patterns/`` in a checkout."""
    packaged = resources.files("sparse_attn") / "patterns"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "patterns"


def list_presets() -> dict[str, str]:
    """Preset names and their one-line descriptions.

    >>> "bigbird-itc" in list_presets()
    True
    """
    directory = _preset_dir()
    return {name: _read(directory / f"{name}.toml")["description"] for name in _preset_names()}


def _preset_names() -> list[str]:
    return sorted(path.stem for path in _preset_dir().glob("*.toml"))


def preset_path(name: str) -> Path:
    """The file of preset ``name``: a name from ``list_presets()``, never a path.

    >>> preset_path("bigbird-itc").name
    'bigbird-itc.toml'
    >>> preset_path("bigbird-itx")
    Traceback (most recent call last):
    ...
    ValueError: no preset named 'bigbird-itx'; did you mean bigbird-itc? presets: bigbird-etc, ...
    """
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a str such as 'bigbird-itc', got {type(name).__name__}: {name!r}")
    names = _preset_names()
    if name not in names:  # names only: "../x", "/abs/x" or "dir/x" never reach the file system
        is_path = "/" in name or "\\" in name or name.endswith(".toml")
        raise ValueError(f"no preset named {name!r}; {did_you_mean(name, names)}presets: {', '.join(names)}"
                         + ("; load a pattern file with sa.load_pattern(path)" if is_path else ""))
    return _preset_dir() / f"{name}.toml"


def did_you_mean(name: str, choices) -> str:
    """``"did you mean X? "`` for the choice closest to a mistyped ``name`` (a prefix first), else ``""``.

    >>> did_you_mean("longformer", ["bigbird-itc", "dilated-longformer", "longformer-base-4096"])
    'did you mean longformer-base-4096? '
    """
    choices = list(choices)
    close = [c for c in choices if c.startswith(name.lower())] or difflib.get_close_matches(name.lower(), choices, n=1)
    return f"did you mean {close[0]}? " if close else ""


def preset(name: str) -> Pattern:
    """The preset pattern ``name`` (one of ``list_presets()``; files load with ``load_pattern``).

    >>> preset("bigbird-itc")
    Local(1, block_size=64) | Global(first=64, last=64) | Random(3)
    """
    return load_pattern(preset_path(name))


def preset_rows() -> list[tuple[str, str, int, float, float]]:
    """(name, description, heads, token density at 4K, at 16K) per preset: what ``sparse-attn patterns`` prints.

    >>> name, description, heads, d4, d16 = preset_rows()[0]
    >>> name, heads, f"{d4:.2%}", f"{d16:.2%}"
    ('bigbird-etc', 1, '10.64%', '2.72%')
    """
    rows = []
    for name, description in list_presets().items():
        path = preset_path(name)
        pattern, heads = load_pattern(path), declared_heads(path) or 1
        d4, d16 = (_density(pattern, n, heads) for n in (4096, 16384))
        rows.append((name, description, heads, d4, d16))
    return rows


def _density(pattern: Pattern, n: int, heads: int) -> float:
    """``pattern.layout(n, heads=heads).density``, counted from the tiles without the layout: ``sparse-attn patterns``
    then needs no torch (whose import took most of the command's seconds)."""
    pattern.check_heads(heads)
    counted = heads if pattern.head_dependent else 1
    allowed = sum(allowed_pairs(resolve(pattern, Context(n, n, h)), Context(n, n, h), 64) for h in range(counted))
    return allowed / (n * n * counted)


def declared_heads(path) -> int | None:
    """The ``heads`` a pattern file declares (per-head presets need that many), None when it declares none.

    >>> declared_heads(preset_path("dilated-longformer"))
    12
    """
    heads = _read(Path(path)).get("heads")
    if heads is not None:
        check_int(f"{path}: heads", heads, 1)
    return heads


def load_pattern(path) -> Pattern:
    """Read a pattern from a TOML file written by ``save_pattern`` (or by hand)."""
    data = _read(Path(path))
    if not isinstance(data.get("pattern"), dict):
        raise ValueError(f"{path}: a pattern file needs a [pattern] table, e.g. [pattern] type = \"local\" before = 64")
    try:
        pattern = Pattern.from_dict(data["pattern"])
        if "heads" in data:
            pattern.check_heads(data["heads"])
    except (ValueError, TypeError) as error:
        raise ValueError(f"{path}: {error}") from None
    return pattern


def save_pattern(pattern: Pattern, path, description: str = "", heads: int | None = None) -> None:
    """Write ``pattern`` as a TOML preset file."""
    doc: dict[str, Any] = {"name": Path(path).stem, "description": description}
    if heads is not None:
        pattern.check_heads(heads)
        doc["heads"] = heads
    doc["pattern"] = pattern.to_dict()
    Path(path).write_text(to_toml(doc))


def _read(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ValueError(f"no pattern file at {path}") from None
    except OSError as error:  # a directory, no permission, ...
        raise ValueError(f"cannot read pattern file {path}: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: {error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not valid TOML: not UTF-8 text ({error.reason} at byte {error.start})") from None


def to_toml(table: dict, path: str = "") -> str:
    """TOML for nested dicts of str/int/float/bool, lists of those, and lists of tables."""
    lines, nested = [], []
    for key, value in table.items():
        if isinstance(value, dict):
            nested.append((key, [value], False))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            nested.append((key, value, True))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for key, tables, is_array in nested:
        for sub in tables:
            header = f"{path}.{key}" if path else key
            lines += ["", f"[[{header}]]" if is_array else f"[{header}]", to_toml(sub, header).strip("\n")]
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")
