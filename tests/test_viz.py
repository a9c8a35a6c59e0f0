"""sparse_attn.viz: figures build from layouts, sparse weights and benchmark results."""
import pytest
import torch

import sparse_attn as sa

pytest.importorskip("matplotlib")
from sparse_attn import viz  # noqa: E402


def test_plot_layout_has_a_grid_and_a_zoom_per_head(tmp_path):
    layout = sa.preset("bigbird-itc").layout(1024, heads=3)
    figure = viz.plot_layout(layout, heads=[0, 2])
    assert len(figure.axes) == 4
    zoom = figure.axes[3].images[0].get_array()                     # bottom row, head 2: tokens 0..255
    assert (zoom == layout.to_dense()[0, 2, :256, :256].numpy()).all()
    assert "head 2" in figure.axes[1].get_title()
    figure.savefig(tmp_path / "layout.png")
    assert (tmp_path / "layout.png").stat().st_size > 1000
    with pytest.raises(ValueError, match=r"head must be in \[0, 3\), got 5"):
        viz.plot_layout(layout, heads=[5])


@pytest.mark.parametrize("n", [10, 300])
def test_plot_attention_short_and_long(n, tmp_path):
    q = k = torch.randn(1, 1, n, 8)
    weights = sa.attention_weights(q, k, sa.Local(2) | sa.Global(first=1))[0][0]
    tokens = [f"t{i}" for i in range(n)] if n <= 48 else None
    figure = viz.plot_attention(weights, tokens=tokens)
    if tokens:
        assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == tokens
    figure.savefig(tmp_path / "attention.png")
    with pytest.raises(ValueError, match=r"tokens must have one label per key \(%d\), got 1" % n):
        viz.plot_attention(weights, tokens=["x"])


def test_plot_bench_marks_failures():
    results = {"patterns": {"p": "Local(1)"}, "implementations": {"a": "", "b": ""},
               "config": {"batch": 1, "heads": 8, "head_dim": 64, "dtype": "float32", "device": "cpu", "backward": False},
               "points": [{"pattern_label": "p", "implementation": "a", "n": n, "status": "ok", "time_s": n / 1e3,
                           "memory_mb": n / 10} for n in (256, 512)]
                         + [{"pattern_label": "p", "implementation": "b", "n": 256, "status": "ok", "time_s": 1.0,
                             "memory_mb": 5.0},
                            {"pattern_label": "p", "implementation": "b", "n": 512, "status": "oom"}]}
    for metric in ("time", "memory"):
        ax = viz.plot_bench(results, metric).axes[0]
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]
        assert any(t.get_text() == "oom" for t in ax.texts)
    with pytest.raises(ValueError, match="metric must be 'time' or 'memory', got 'speed'"):
        viz.plot_bench(results, "speed")
