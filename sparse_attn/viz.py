"""Figures: block layouts, attention heatmaps and benchmark curves (matplotlib, imported lazily).

>>> import sparse_attn as sa
>>> from sparse_attn import viz
>>> fig = viz.plot_layout(sa.preset("bigbird-itc").layout(4096, heads=12), heads=[0, 1])
>>> fig.savefig("bigbird.png")                                             # doctest: +SKIP

Install with ``pip install "sparse-attn[viz]"``. Every function returns a matplotlib ``Figure``
(the Agg backend is used when no backend has been chosen, so it works without a display).
"""
from __future__ import annotations

import textwrap

import numpy as np

from .blocks import ceil_div
from .layout import BlockLayout

_GRID_PIXELS = 128        # cells a side of the block grid and the zoom: 1.8 pixels or more each at 100 dpi
_MARGIN = 0.02            # white space inside a panel's frame, as a fraction of its side: row 0 is not under it
ZOOM_MAX = 8192           # tokens a side of plot_layout's zoom (its token mask is built whole: 64 MiB here)
_ZOOM_BLOCKS = 16         # the zoom's default side, in blocks: wider than a window of a few blocks
_EDGES_DRAWN = 32         # block edges drawn on the zoom up to this many a side
_LABELLED_TOKENS = 48     # plot_attention writes token labels up to this many tokens
_COLORS = {"skipped": "#ffffff", "partial": "#f4a259", "full": "#1d4e89"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("sparse_attn.viz needs matplotlib: pip install 'sparse-attn[viz]'") from None
    if "matplotlib.pyplot" not in __import__("sys").modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_layout(layout: BlockLayout, heads=None, zoom: int | None = None, batch: int = 0, title: str | None = None):
    """One column per head: the block grid (full and partial blocks in two colours) above a token-level zoom.

    Args:
        layout: a BlockLayout (``pattern.layout(n, heads=..., block_size=...)``).
        heads: the heads to draw, default ``range(min(heads, 4))``.
        zoom: side of the top-left corner drawn at token level, default 16 blocks (at most N and ``ZOOM_MAX``).
        batch: the example, for layouts built with per-example masks.

    Neither panel drops a lone row or column (a global token): each has at most 128 cells a side, at least
    1.8 pixels each at 100 dpi or more; where a cell stands for several blocks or tokens it shows the most
    computed of them (the grid) or is lit when any of its pairs is allowed (the zoom); and a little white
    space inside each frame keeps row 0 and column 0 clear of it.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    heads = list(range(min(layout.heads, 4))) if heads is None else list(heads)
    if not heads:
        raise ValueError("heads must name at least one head to draw, got none; e.g. heads=[0]")
    for h in heads:
        layout.check_example_head(batch, h)
    zoom = _zoom_side(layout, zoom)
    figure, axes = plt.subplots(2, len(heads), figsize=(max(3.2 * len(heads) + 0.6, 6.4), 6.8), squeeze=False,
                                gridspec_kw={"height_ratios": [1, 1]})
    colours = ListedColormap([_COLORS["skipped"], _COLORS["partial"], _COLORS["full"]])
    factor = layout.bin_factor(_GRID_PIXELS)
    for column, h in enumerate(heads):
        grid = layout.block_grid(batch, h, max_side=_GRID_PIXELS)
        top = axes[0, column]
        top.imshow(grid, cmap=colours, vmin=0, vmax=2, interpolation="nearest",
                   extent=(0, layout.n_k, layout.n_q, 0))
        _inset(top, layout.n_q, layout.n_k)
        top.set_title(f"head {h}: blocks of {layout.block_size}" + (f" (binned {factor}x)" if factor > 1 else ""),
                      fontsize=9)
        top.add_patch(plt.Rectangle((0, 0), zoom, zoom, fill=False, edgecolor="#d62828", linewidth=1.2))
        pixels, pooled = any_pool(corner_mask(layout, batch, h, zoom), _GRID_PIXELS)
        bottom = axes[1, column]
        bottom.imshow(pixels, cmap=ListedColormap(["#ffffff", "#333333"]), vmin=0, vmax=1,
                      interpolation="nearest", extent=(0, zoom, zoom, 0))
        _inset(bottom, zoom, zoom)
        if zoom // layout.block_size <= _EDGES_DRAWN:
            for edge in range(layout.block_size, zoom, layout.block_size):
                bottom.axhline(edge, color="#d62828", linewidth=0.5, alpha=0.6)
                bottom.axvline(edge, color="#d62828", linewidth=0.5, alpha=0.6)
        bottom.set_title(f"tokens 0..{zoom - 1} (red box above)"
                         + (f", {pooled}x{pooled} tokens a pixel" if pooled > 1 else ""), fontsize=9)
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
            ax.set_xlabel("key position", fontsize=8)
        if column == 0:  # one label per row, not one per panel
            top.set_ylabel("query position", fontsize=8)
            bottom.set_ylabel("query position", fontsize=8)
    figure.legend(handles=[Patch(facecolor=_COLORS["full"], label="full block (no mask)"),
                           Patch(facecolor=_COLORS["partial"], label="partial block (token mask)"),
                           Patch(facecolor="#333333", label="allowed pair")],
                  loc="lower center", ncol=3, fontsize=8, frameon=False)
    _suptitle(figure, title or f"{layout.pattern!r}, N={layout.n_q:,}, density {layout.density:.2%}", bottom=0.04)
    return figure


def _inset(ax, rows: int, cols: int) -> None:
    """Limits a little past the image's top and left, so that row 0 and column 0 are not drawn under the frame."""
    ax.set_xlim(-_MARGIN * cols, cols)
    ax.set_ylim(rows, -_MARGIN * rows)


def _zoom_side(layout: BlockLayout, zoom: int | None) -> int:
    """The zoom's side in tokens: ``zoom`` (checked), else 16 blocks; at most N."""
    if zoom is not None and (isinstance(zoom, bool) or not isinstance(zoom, int) or not 1 <= zoom <= ZOOM_MAX):
        raise ValueError(f"zoom must be a number of tokens from 1 to {ZOOM_MAX} (or None for 16 blocks), got "
                         f"{zoom!r}; the block grid shows larger spans")
    return min(zoom or _ZOOM_BLOCKS * layout.block_size, layout.n_q, layout.n_k)


def corner_mask(layout: BlockLayout, batch: int, head: int, side: int) -> np.ndarray:
    """Token mask of the top-left ``side`` x ``side`` pairs of one (example, head), from the blocks that hold
    them: memory side², never a row of N keys.

    >>> import sparse_attn as sa
    >>> corner_mask(sa.Local(1).layout(1024, block_size=4), 0, 0, 4).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    b, h = layout.check_example_head(batch, head)
    (tq, tk), masks = layout.tile_shape, layout.masks.cpu().numpy()
    rows, cols = ceil_div(side, tq), ceil_div(side, tk)
    tiles = np.zeros((rows, tq, cols, tk), dtype=bool)                          # (row block, tq, col block, tk)
    for ptr, idx, tile in ((layout.full_ptr, layout.full_idx, None),
                           (layout.part_ptr, layout.part_idx, layout.part_mask)):
        bounds = ptr[b, h, :rows + 1].cpu().numpy()                       # entries of row blocks 0 .. rows-1
        entries = np.arange(bounds[0], bounds[-1])
        row = np.searchsorted(bounds, entries, side="right") - 1
        col = idx[bounds[0]:bounds[-1]].cpu().numpy()
        shown = col < cols
        tiles[row[shown], :, col[shown], :] = True if tile is None else masks[tile[entries[shown]].cpu().numpy()]
    return tiles.reshape(rows * tq, cols * tk)[:side, :side]


def any_pool(mask: np.ndarray, max_side: int) -> tuple[np.ndarray, int]:
    """``mask`` binned into at most ``max_side`` cells a side, a cell lit when any of its pairs is: (cells,
    pairs a cell side).

    >>> any_pool(np.eye(4, dtype=bool), 2)[0].astype(int).tolist()
    [[1, 0], [0, 1]]
    """
    factor = max(1, ceil_div(max(mask.shape), max_side))
    rows, cols = ceil_div(mask.shape[0], factor), ceil_div(mask.shape[1], factor)
    padded = np.zeros((rows * factor, cols * factor), dtype=bool)
    padded[:mask.shape[0], :mask.shape[1]] = mask
    return np.asarray(padded.reshape(rows, factor, cols, factor).any(axis=(1, 3))), factor


def ascii_grid(layout: BlockLayout, head: int = 0, batch: int = 0, max_side: int = 64) -> str:
    """The block grid of one (example, head) as text, binned to at most ``max_side`` cells a side; a cell shows
    the most computed of its blocks, so a lone global row or column stays in view. Unbinned, it is the grid
    ``print(layout)`` draws of head 0, for any head.

    >>> import sparse_attn as sa
    >>> print(ascii_grid((sa.Local(64) | sa.Global(first=1)).layout(1024, block_size=64), max_side=4))
    head 0, 4 x 4 blocks a cell ('#' holds a full block, '+' a partial one, '.' none):
    #+++
    +#+.
    ++#+
    +.+#
    """
    factor = layout.bin_factor(max_side)
    rows = ["".join(".+#"[state] for state in row) for row in layout.block_grid(batch, head, max_side=max_side)]
    legend = (f"head {head}, {factor} x {factor} blocks a cell ('#' holds a full block, '+' a partial one, '.' none):"
              if factor > 1 else f"head {head} ('#' full, '+' partial, '.' skipped):")   # print(layout)'s words
    return "\n".join([legend, *rows])


def save(figure, path, **options) -> None:
    """``figure.savefig(path, **options)``, then the figure closed: pyplot holds every figure it made until then.

    >>> import sparse_attn as sa
    >>> save(plot_layout(sa.Local(8).layout(256)), "local.png", dpi=110)               # doctest: +SKIP
    """
    plt = _pyplot()
    try:
        figure.savefig(path, **options)
    finally:
        plt.close(figure)


def _wrap(text: str, inches: float, fontsize: float) -> str:
    """``text`` wrapped to fit ``inches`` at ``fontsize`` points (about 0.6 em per character)."""
    return textwrap.fill(text, width=max(20, int(inches * 72 / (0.6 * fontsize))), break_on_hyphens=False)


def _suptitle(figure, text: str, bottom: float = 0.0, fontsize: float = 10) -> None:
    """A figure title wrapped to the figure's width (tight_layout leaves room for its lines)."""
    figure.suptitle(_wrap(text, figure.get_figwidth() - 0.4, fontsize), fontsize=fontsize)
    figure.tight_layout(rect=(0, bottom, 1, 1))


def plot_attention(weights, tokens=None, title: str | None = None, ax=None):
    """Heatmap of one sparse attention matrix (from ``sa.attention_weights(...)[b][h]``).

    Short inputs (up to 48 tokens) are drawn as a grid with token labels on both axes; longer
    ones as a scatter of the allowed pairs, coloured by probability (never densified).

    >>> import torch, sparse_attn as sa
    >>> w = sa.attention_weights(torch.randn(1, 1, 12, 8), torch.randn(1, 1, 12, 8), sa.Local(2))
    >>> fig = plot_attention(w[0][0], tokens="the cat sat on the mat and then it went to sleep".split())
    """
    if not hasattr(weights, "tocoo"):
        raise TypeError(f"weights must be a scipy sparse matrix (sa.attention_weights(...)[b][h]), got "
                        f"{type(weights).__name__}")
    plt = _pyplot()
    coo = weights.tocoo()
    n_q, n_k = coo.shape
    if tokens is not None and len(tokens) != n_k:
        raise ValueError(f"tokens must have one label per key ({n_k}), got {len(tokens)}")
    figure = ax.figure if ax is not None else plt.figure(figsize=(6, 5.2), layout="constrained")
    ax = ax if ax is not None else figure.add_subplot()
    labelled = max(n_q, n_k) <= _LABELLED_TOKENS
    if labelled:
        image = np.full((n_q, n_k), np.nan)
        image[coo.row, coo.col] = coo.data
        shown = ax.imshow(image, cmap="viridis", vmin=0, interpolation="nearest")
        labels = tokens if tokens is not None else [str(j) for j in range(n_k)]
        ax.set_xticks(range(n_k), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(n_q), labels[n_k - n_q:] if tokens is not None else range(n_q), fontsize=7)
    else:
        order = np.argsort(coo.data)
        shown = ax.scatter(coo.col[order], coo.row[order], c=coo.data[order], s=max(0.05, 4000 / max(coo.nnz, 1)),
                           marker="s", linewidths=0, cmap="viridis", vmin=0)
        ax.set_xlim(-0.5, n_k - 0.5)
        ax.set_ylim(n_q - 0.5, -0.5)
        ax.set_aspect("equal")
    ax.set_xlabel("key" + (" token" if labelled and tokens is not None else " position"))
    ax.set_ylabel("query" + (" token" if labelled and tokens is not None else " position"))
    ax.set_title(title or f"attention probabilities ({coo.nnz:,} allowed pairs; blank = not allowed)", fontsize=9)
    figure.colorbar(shown, ax=ax, shrink=0.9).set_label("attention probability")
    return figure


def plot_bench(results: dict, metric: str = "time"):
    """Time or memory versus N, log-log, one line per implementation, one panel per pattern.

    ``results`` is what ``sparse_attn.bench.sweep`` returns (or its ``results.json``). Points that
    ran out of memory or time are marked with an ``x`` at the last length that fitted; an
    implementation with no point in a panel is named in it with its status (``n/a``, ``error``).
    One legend for the figure, one colour per implementation in every panel.
    """
    if metric not in ("time", "memory"):
        raise ValueError(f"metric must be 'time' or 'memory', got {metric!r}")
    plt = _pyplot()
    from matplotlib.lines import Line2D

    key, label = {"time": ("time_s", "time per call (s)"),
                  "memory": ("memory_mb", "peak memory beyond q, k, v (MB)")}[metric]
    labels, names = list(results["patterns"]), list(results["implementations"])
    figure, axes = plt.subplots(1, len(labels), figsize=(5.6 * len(labels), 4.6), squeeze=False, sharey=True)
    markers = "osD^v<>p"
    drawn: set[str] = set()
    for ax, pattern in zip(axes[0], labels):
        missing = []
        for index, name in enumerate(names):
            points = sorted((p for p in results["points"] if p["pattern_label"] == pattern
                             and p["implementation"] == name), key=lambda p: p["n"])
            done = [p for p in points if p["status"] == "ok"]
            if not done:
                statuses = dict.fromkeys("n/a" if p["status"] == "unavailable" else p["status"] for p in points)
                missing.append(f"{name} ({', '.join(statuses) or 'not run'})")
                continue
            drawn.add(name)
            colour = f"C{index % 10}"
            ax.plot([p["n"] for p in done], [max(p[key], 1e-3) for p in done], marker=markers[index % 8],
                    markersize=4, color=colour)
            failed = next((p for p in points if p["status"] in ("oom", "timeout")), None)
            if failed is not None:
                ax.plot([failed["n"]], [max(done[-1][key], 1e-3)], marker="x", markersize=9, color=colour)
                ax.annotate(failed["status"], (failed["n"], max(done[-1][key], 1e-3)), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=colour)
        if missing:
            ax.text(0.98, 0.02, _wrap("no points: " + "; ".join(missing), 5.0, 7), transform=ax.transAxes,
                    ha="right", va="bottom", fontsize=7, color="#555555")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_title(_wrap(f"{pattern}: {results['patterns'][pattern]}", 5.2, 9), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].set_ylabel(label)  # shared y axis: one label
    handles = [Line2D([], [], color=f"C{i % 10}", marker=markers[i % 8], markersize=4, label=name)
               for i, name in enumerate(names) if name in drawn]
    columns = max(1, min(len(handles), int(figure.get_figwidth() / 1.8)))
    figure.legend(handles=handles, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    config = results["config"]
    rows = ceil_div(len(handles), columns)
    _suptitle(figure, f"{metric} vs N: B={config['batch']} H={config['heads']} D={config['head_dim']} "
                      f"{config['dtype']} {config['device']}, {'fwd+bwd' if config['backward'] else 'forward'}",
              bottom=(0.05 + 0.2 * rows) / figure.get_figheight())
    return figure
