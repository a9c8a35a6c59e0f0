"""sparse_attn.viz: figures build from layouts, sparse weights and benchmark results."""
import pytest
import torch

import sparse_attn as sa

pytest.importorskip("matplotlib")
from sparse_attn import viz  # noqa: E402


def test_plot_layout_has_a_grid_and_a_zoom_per_head(tmp_path):
    layout = sa.preset("bigbird-itc").layout(1024, heads=3)
    figure = viz.plot_layout(layout, heads=[0, 2], zoom=128)
    assert len(figure.axes) == 4
    zoom = figure.axes[3].images[0].get_array()                     # bottom row, head 2: tokens 0..127
    assert (zoom == layout.to_dense()[0, 2, :128, :128].numpy()).all()
    assert "head 2" in figure.axes[1].get_title()
    figure.savefig(tmp_path / "layout.png")
    assert (tmp_path / "layout.png").stat().st_size > 1000
    with pytest.raises(ValueError, match=r"head must be in \[0, 3\), got 5"):
        viz.plot_layout(layout, heads=[5])
    with pytest.raises(ValueError, match="heads must name at least one head to draw, got none"):
        viz.plot_layout(layout, heads=[])
    for zoom in (0, -4, 2.5, True, viz.ZOOM_MAX + 1):
        with pytest.raises(ValueError, match=f"zoom must be a number of tokens from 1 to 8192 .*, got {zoom!r}"):
            viz.plot_layout(layout, zoom=zoom)


@pytest.mark.parametrize("n", [4096, 65536])
def test_plot_layout_keeps_a_lone_global_token_in_view(n):
    """Issue 23, finding 15: at the default size the zoom of Longformer (Local(256) | Global(tokens=(0,))) was all
    black (4 blocks, all inside the window) and a lone row at the frame was drawn under it. Now: a zoom of 16
    blocks, any-allowed pooling, no more cells than pixels, and white space between row 0 and the frame."""
    layout = sa.longformer().layout(n)
    figure = viz.plot_layout(layout)
    figure.set_dpi(100)
    figure.canvas.draw()
    top, bottom = figure.axes
    grid, zoom = top.images[0].get_array(), bottom.images[0].get_array()
    assert (grid[0] > 0).all() and (grid[:, 0] > 0).all()                       # the global row and column
    assert zoom[0].all() and zoom[:, 0].all() and not zoom.all()               # visible against the window
    for ax, image in ((top, grid), (bottom, zoom)):
        box = ax.get_window_extent()
        assert min(box.width, box.height) >= max(image.shape)                  # no cell dropped when drawn
        assert ax.get_ylim()[1] < 0 and ax.get_xlim()[0] < 0                    # row 0 and column 0 inside the frame


def test_plot_layout_zoom_never_builds_a_row_of_n_keys(monkeypatch):
    """The zoom came from layout.row_mask: (rows, N) per stored head, a GiB at 1M tokens with a zoom of 1K."""
    layout = (sa.Local(256) | sa.Global(first=16)).layout(2 ** 20, heads=2)
    corner = (sa.Local(256) | sa.Global(first=16)).layout(1024).to_dense()[0, 0].numpy()    # the same 1K corner

    def whole_rows(*args):
        raise AssertionError("plot_layout built rows of N keys")

    monkeypatch.setattr(type(layout), "row_mask", whole_rows)
    zoom = viz.plot_layout(layout).axes[2].images[0].get_array()                   # head 0, bottom row
    assert (zoom == viz.any_pool(corner, 128)[0]).all()


def _inside(figure, artist) -> bool:
    figure.canvas.draw()
    box, page = artist.get_window_extent(), figure.bbox
    return page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1


def test_plot_layout_title_fits_and_labels_are_not_repeated():
    layout = sa.preset("dilated-longformer").layout(1024, heads=12)     # a repr longer than the figure is wide
    figure = viz.plot_layout(layout, heads=[0, 6, 9])
    assert _inside(figure, figure._suptitle)
    assert "Dilated(64, 4)" in figure._suptitle.get_text()
    top, bottom = figure.axes[:3], figure.axes[3:]
    assert [ax.get_ylabel() for ax in top + bottom] == ["query position", "", ""] * 2   # one per row
    assert all(ax.get_xlabel() == "key position" for ax in figure.axes)
    assert [ax.get_title() for ax in bottom] == ["tokens 0..1023 (red box above), 8x8 tokens a pixel"] * 3


@pytest.mark.parametrize("n", [10, 300])
def test_plot_attention_short_and_long(n, tmp_path):
    q = k = torch.randn(1, 1, n, 8)
    weights = sa.attention_weights(q, k, sa.Local(2) | sa.Global(first=1))[0][0]
    tokens = [f"t{i}" for i in range(n)] if n <= 48 else None
    figure = viz.plot_attention(weights, tokens=tokens)
    if tokens:
        assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == tokens
    colorbar = figure.axes[1]
    assert colorbar.get_ylabel() == "attention probability"
    assert figure.axes[0].get_xlabel() in ("key token", "key position")
    assert figure.axes[0].get_ylabel() in ("query token", "query position")
    assert all(_inside(figure, artist) for artist in (figure.axes[0].xaxis.label, figure.axes[0].yaxis.label,
                                                      figure.axes[0].title, colorbar.yaxis.label))
    figure.savefig(tmp_path / "attention.png")
    with pytest.raises(ValueError, match=rf"tokens must have one label per key \({n}\), got 1"):
        viz.plot_attention(weights, tokens=["x"])
    with pytest.raises(TypeError, match="weights must be a scipy sparse matrix .*, got Tensor"):
        viz.plot_attention(torch.zeros(n, n))


def test_plot_bench_marks_failures():
    results = {"patterns": {"p": "Local(1)"}, "implementations": {"a": "", "b": ""},
               "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "device": "cpu", "backward": False},
               "points": [{"pattern_label": "p", "implementation": "a", "n": n, "status": "ok", "time_s": n / 1e3,
                           "memory_mb": n / 10} for n in (256, 512)]
                         + [{"pattern_label": "p", "implementation": "b", "n": 256, "status": "ok", "time_s": 1.0,
                             "memory_mb": 5.0},
                            {"pattern_label": "p", "implementation": "b", "n": 512, "status": "oom"}]}
    for metric in ("time", "memory"):
        figure = viz.plot_bench(results, metric)
        ax = figure.axes[0]
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in figure.legends[0].get_texts()] == ["a", "b"]
        assert any(t.get_text() == "oom" for t in ax.texts)
    with pytest.raises(ValueError, match="metric must be 'time' or 'memory', got 'speed'"):
        viz.plot_bench(results, "speed")


def test_plot_bench_one_legend_one_y_label_and_missing_lines_named():
    results = {"patterns": {"p": "Local(1)", "q": "Local(256) | Global(first=64, last=64) | Random(3, seed=1234567)"},
               "implementations": {"a": "", "b": ""},
               "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "device": "cpu", "backward": True},
               "points": [{"pattern_label": label, "implementation": "a", "n": n, "status": "ok", "time_s": 0.1,
                           "memory_mb": 1.0} for label in "pq" for n in (256, 512)]
                         + [{"pattern_label": "p", "implementation": "b", "n": 256, "status": "ok", "time_s": 0.2,
                             "memory_mb": 2.0},
                            {"pattern_label": "q", "implementation": "b", "n": 256, "status": "unavailable"}]}
    figure = viz.plot_bench(results, "time")
    left, right = figure.axes
    assert len(figure.legends) == 1 and left.get_legend() is None and right.get_legend() is None
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["a", "b"]
    assert left.get_ylabel() == "time per call (s)" and right.get_ylabel() == ""
    assert [t.get_text() for t in right.texts] == ["no points: b (n/a)"]
    assert [line.get_color() for line in left.lines] == [line.get_color() for line in right.lines] + ["C1"]
    assert all(_inside(figure, ax.title) for ax in figure.axes)
