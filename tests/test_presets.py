"""Named constructors and the preset files shipped in the wheel."""
import pytest
import torch

import sparse_attn as sa

REQUIRED = ["longformer-base-4096", "longformer-large-4096", "bigbird-itc", "bigbird-etc",
            "sparse-transformer-strided", "sparse-transformer-fixed", "streaming-llm", "dilated-longformer"]


def test_every_required_preset_is_listed_with_a_description():
    listing = sa.list_presets()
    assert set(REQUIRED) <= set(listing)
    assert all(len(description) > 20 for description in listing.values())


@pytest.mark.parametrize("name", REQUIRED)
def test_presets_load_and_compile(name):
    pattern = sa.preset(name)
    heads = 12 if name == "dilated-longformer" else 2
    layout = pattern.layout(1024, heads=heads, block_size=64)
    assert 0 < layout.density < 1


def test_unknown_preset_lists_the_names_and_suggests_one():
    with pytest.raises(ValueError, match="no preset named 'longformer'; did you mean longformer-base-4096\\? "
                                         "presets: bigbird-etc, bigbird-itc, "):
        sa.preset("longformer")
    with pytest.raises(ValueError, match="no preset named 'bigbird-itx'; did you mean bigbird-itc\\?"):
        sa.preset("bigbird-itx")
    with pytest.raises(TypeError, match="preset name must be a str such as 'bigbird-itc', got int: 3"):
        sa.preset(3)


def test_presets_are_names_not_paths():
    """sa.preset once loaded any TOML file: '../x', absolute paths, anything the path led to."""
    with pytest.raises(ValueError, match="no preset named '../patterns/bigbird-itc'"):
        sa.preset("../patterns/bigbird-itc")                         # a real file, reached by a path
    from sparse_attn.presets import preset_path

    real = preset_path("bigbird-itc")
    for name in [str(real.with_suffix("")), str(real), "bigbird-itc.toml",
                 "../../../etc/passwd", "/tmp/x"]:
        with pytest.raises(ValueError, match=r"no preset named .*; load a pattern file with sa.load_pattern\(path\)"):
            sa.preset(name)
    assert sa.load_pattern(real) == sa.preset("bigbird-itc")        # files go through load_pattern


def test_save_and_load_round_trip(tmp_path):
    pattern = sa.PerHead([sa.Local(3) | sa.Random(2, seed=4), sa.Dilated(2, 3) & sa.Causal()]) | sa.Global(first=1)
    path = tmp_path / "mine.toml"
    sa.save_pattern(pattern, path, description="two heads", heads=2)
    assert sa.load_pattern(path) == pattern
    assert 'description = "two heads"' in path.read_text()


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no pattern file at"):
        sa.load_pattern(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\n")
    with pytest.raises(ValueError, match=r"needs a \[pattern\] table"):
        sa.load_pattern(bad)
    bad.write_text("[pattern\n")
    with pytest.raises(ValueError, match="is not valid TOML"):
        sa.load_pattern(bad)
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="bad.toml is not valid TOML: not UTF-8 text"):
        sa.load_pattern(bad)
    with pytest.raises(ValueError, match="cannot read pattern file .*: Is a directory"):
        sa.load_pattern(tmp_path)
    bad.write_text('[pattern]\ntype = "union"\npatterns = 5\n')             # valid TOML, not a pattern
    with pytest.raises(ValueError, match="bad.toml: .*must be an iterable"):
        sa.load_pattern(bad)
    bad.write_text('heads = 0\n[pattern]\ntype = "local"\nbefore = 1\n')
    with pytest.raises(ValueError, match="bad.toml: heads must be >= 1, got 0"):
        sa.load_pattern(bad)


def test_declared_heads():
    from sparse_attn.presets import declared_heads, preset_path

    assert declared_heads(preset_path("dilated-longformer")) == 12
    assert declared_heads(preset_path("bigbird-itc")) is None


def test_longformer_window_is_split_each_side():
    assert sa.longformer(512) == sa.Local(256) | sa.Global(tokens=(0,))
    with pytest.raises(ValueError, match="window must be even"):
        sa.longformer(511)


def test_bigbird_blocks():
    mask = sa.bigbird(block=4, random_blocks=0).mask(32)[0]
    tiles = mask.reshape(8, 4, 8, 4).all(dim=(1, 3))
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for r in range(8):
        expected[r, max(r - 1, 0):r + 2] = True
    expected[[0, 7], :] = True
    expected[:, [0, 7]] = True
    assert torch.equal(tiles, expected)
    assert torch.equal(mask, tiles.repeat_interleave(4, 0).repeat_interleave(4, 1))
    with pytest.raises(ValueError, match="window_blocks must be odd"):
        sa.bigbird(window_blocks=2)


def test_sparse_transformer_modes():
    strided = sa.sparse_transformer(4).mask(16)[0]
    assert strided[10].nonzero().flatten().tolist() == [2, 6, 7, 8, 9, 10]
    fixed = sa.sparse_transformer(4, "fixed", summary=1).mask(16)[0]
    assert fixed[10].nonzero().flatten().tolist() == [3, 7, 8, 9, 10]
    with pytest.raises(ValueError, match="mode must be 'strided' or 'fixed'"):
        sa.sparse_transformer(4, mode="axial")


def test_streaming_keeps_sinks_and_recent_window():
    mask = sa.streaming(sink=2, window=3).mask(10)[0]
    assert mask[9].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    assert mask[1].nonzero().flatten().tolist() == [0, 1]


def test_the_listed_densities_are_the_layouts_without_torch():
    """`sparse-attn patterns` counted each density by building the layout, which imported torch (most of the
    command's time); it counts them from the tiles now, and the counts are the layouts' exactly."""
    import subprocess
    import sys

    from sparse_attn.presets import preset_rows

    for name, _, heads, d4, d16 in preset_rows():
        assert (d4, d16) == tuple(sa.preset(name).layout(n, heads=heads).density for n in (4096, 16384)), name
    code = "import sys; from sparse_attn import cli; cli.main(['patterns']); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "False", done.stderr[-1000:]


@pytest.mark.parametrize("pattern", [sa.Local(3) | sa.Global(first=2), sa.bigbird(block=16), sa.Stride(7) & sa.Causal(),
                                     sa.PerHead([sa.Local(5), ~sa.Local(2)])], ids=repr)
@pytest.mark.parametrize("n, block", [(100, 16), (37, 64), (300, 64)])
def test_tile_counts_equal_the_layouts_allowed_pairs(pattern, n, block):
    from sparse_attn.rules import Context, resolve
    from sparse_attn.tiles import allowed_pairs

    heads = 2
    counted = sum(allowed_pairs(resolve(pattern, Context(n, n, h)), Context(n, n, h), block)
                  for h in range(heads if pattern.head_dependent else 1))
    layout = pattern.layout(n, heads=heads, block_size=block)
    assert counted * (1 if pattern.head_dependent else heads) == layout.allowed_pairs()
