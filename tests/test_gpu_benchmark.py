"""benchmarks/gpu_kernels.py without a GPU: its table, figure, plan, resume, budget, arguments, set-up record and
refusals, and every implementation's measurement on CPU."""
import doctest
import importlib.util
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.testing
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import flex_attention

import sparse_attn as sa
from sparse_attn import machine
from sparse_attn.bench import peers

# Triton runs on CPU tensors in its interpreter (tests/conftest.py), but it must be installed.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
triton_on_cpu = [needs_triton, pytest.mark.skipif(torch.cuda.is_available(), reason="triton on CPU tensors: "
                                                 "its interpreter, which tests/conftest.py turns on without a GPU")]
without_a_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks what the script does on a machine without a GPU")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"
_spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
gk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gk)

META = {"device": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.1, "driver": "550.54.15", "cuda": "12.8",
        "torch": "2.11.0", "triton": "3.6.0", "python": "3.11.7", "dtype": "torch.bfloat16", "heads": 16,
        "block_size": 64}
N_32K = 32768


def row(impl, pattern, head_dim, batch, n, **results):
    return {"impl": impl, "pattern": pattern, "head_dim": head_dim, "batch": batch, "n": n, **results}


def timed(impl, pattern, head_dim, batch, n, fwd_ms, fwd_bwd_ms, **results):
    """A measured row: TFLOP/s from 1e12 forward FLOPs, peak memory 100 MiB per forward+backward ms."""
    return row(impl, pattern, head_dim, batch, n, fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms, fwd_tflops=1e3 / fwd_ms,
               fwd_bwd_tflops=3.5e3 / fwd_bwd_ms, fwd_bwd_peak_mb=100 * fwd_bwd_ms, **results)


def table_line(markdown: str, start: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(start))


def table_rows(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if line.startswith("| ") and not line.startswith("| pattern")]


def test_markdown_compares_triton_with_the_faster_flex_block_per_pass_and_with_masked_sdpa():
    rows = [timed("triton", "longformer", 64, 1, N_32K, 1.0, 4.0, density=0.031),
            timed("flex-128", "longformer", 64, 1, N_32K, 1.5, 3.6, density=0.031),
            row("flex-64", "longformer", 64, 1, N_32K, density=0.031, fwd_ms=1.25, fwd_tflops=800.0,
                error="BackendCompilerFailed: NoValidChoicesError"),          # forward done, its backward failed
            timed("sdpa", "longformer", 64, 1, N_32K, 2.0, 8.0, density=0.031),
            timed("masked-sdpa", "longformer", 64, 1, N_32K, 10.0, 40.0, density=0.031,
                  sdpa_backend="efficient_attention")]
    md = gk.to_markdown(rows[::-1], META)                                    # any row order
    assert md.startswith("# GPU kernels on NVIDIA H100 80GB HBM3\n")
    assert "(79.1 GiB), driver 550.54.15, CUDA 12.8; torch 2.11.0, triton 3.6.0." in md
    assert table_rows(md) == [
        "| longformer | 64 | 1 | 32768 | 3.10% | 1.00 (64) / 1.25 (64) / 2.00 / 10.00 | 4.00 (64) / 3.60 (128) / 8.00 "
        "/ 40.00 | 1000 / 800 / 500 | 875 / 972 / 438 | 1.25 | 0.90 | 10.0 | 200% | 400 / 360 / 800 / 4000 |"]
    assert table_line(md, "masked-sdpa ran") == "masked-sdpa ran torch's efficient_attention (1 points)."
    assert table_line(md, "- E1:") == "- E1: BackendCompilerFailed: NoValidChoicesError"
    assert table_line(md, "Targets (issue 25)").startswith("Targets (issue 25), bf16, B=1, D = 64 and 128, at N = 32K")
    assert "1M tokens" not in md and "Incomplete" not in md


def test_markdown_error_footnotes_and_missing_implementations():
    rows = [row("triton", "bigbird-itc", 128, 1, N_32K, error="out of memory"),          # failed before the layout
            row("flex-128", "bigbird-itc", 128, 1, N_32K, density=0.1,
                error="OutOfResources: out of resource: shared memory"),
            row("flex-64", "bigbird-itc", 128, 1, N_32K, error="out of memory"),
            row("masked-sdpa", "bigbird-itc", 128, 1, N_32K, density=0.1, fwd_flops=1,
                error="does not fit: needs ~96.5 GiB, 78.0 GiB free"),
            timed("triton", "sliding-causal", 64, 1, 8192, 0.5, 2.0, density=0.2),
            row("sdpa", "longformer", 128, 1, 131072, error="out of memory")]     # no layout, no density
    md = gk.to_markdown(rows, META)
    assert table_rows(md) == [  # points in pattern order, then D, B, N
        "| longformer | 128 | 1 | 131072 | — | — / — / E1 / — | — / — / E1 / — | — / — / E1 | — / — / E1 | — | — | — "
        "| — | — / — / E1 / — |",
        "| bigbird-itc | 128 | 1 | 32768 | 10.00% | E1 / E2,E1 / — / E3 | E1 / E2,E1 / — / E3 | E1 / E2,E1 / — "
        "| E1 / E2,E1 / — | — | — | — | — | E1 / E2,E1 / — / E3 |",
        "| sliding-causal | 64 | 1 | 8192 | 20.00% | 0.50 (64) / — / — / — | 2.00 (64) / — / — / — | 2000 / — / — "
        "| 1750 / — / — | — | — | — | — | 200 / — / — / — |"]
    errors = md.split("Errors:\n\n")[1].split("\n\n")[0]
    assert errors == ("- E1: out of memory\n- E2: OutOfResources: out of resource: shared memory\n"
                      "- E3: does not fit: needs ~96.5 GiB, 78.0 GiB free")
    assert "masked-sdpa ran" not in md
    assert "Errors:" not in gk.to_markdown(rows[4:5], META)


def test_markdown_million_lines_and_pending_count():
    million = ("longformer", 64, 1, gk.MILLION)
    rows = [row("triton", *million, density=0.0005, fwd_ms=20.0, fwd_bwd_ms=75.25, fwd_tflops=150.0,
                fwd_bwd_tflops=140.0, fwd_bwd_peak_mb=1000.0, fwd_bwd_total_peak_mb=20480.0,
                fwd_bwd_reserved_peak_mb=22528.0),
            row("flex-128", *million, error="out of memory"),
            row("flex-64", *million, density=0.0005, fwd_ms=30.0, fwd_tflops=100.0)]   # killed mid-way: no memory
    md = gk.to_markdown(rows, META, pending=7)
    assert table_line(md, "| longformer | 64 | 1 | 1048576 |").startswith(
        "| longformer | 64 | 1 | 1048576 | 0.05% | 20.00 (64) / 30.00 (64) / — / — | 75.25 (64) / E1 / — / — |")
    assert table_line(md, "- triton:") == (
        "- triton: forward 20.0 ms, forward+backward 75.2 ms; forward+backward peak 20.0 GiB allocated in all "
        "(inputs, gradients, layout included; 22.0 GiB reserved by the allocator): fits in the GPU's 79.1 GiB")
    assert table_line(md, "- flex-128:") == "- flex-128: E1 (out of memory)"
    assert table_line(md, "- flex-64:") == "- flex-64: no memory measured"
    assert table_line(md, "**Incomplete:**").startswith("**Incomplete:** 7 requested points not measured yet")
    big = [dict(rows[0], fwd_bwd_total_peak_mb=79.2 * 1024)]
    assert table_line(gk.to_markdown(big, META), "- triton:").endswith(": does not fit in the GPU's 79.1 GiB")


def test_figure_draws_time_and_memory_per_pattern_and_head_dim(tmp_path, monkeypatch):
    rows = [timed(impl, pattern, d, 1, n, 1.0, n / 1000) for impl in ("triton", "flex-128", "masked-sdpa")
            for pattern in ("longformer", "sliding-causal") for d in (64, 128) for n in (4096, 8192)]
    rows += [row("sdpa", "longformer", 64, 1, 8192, error="out of memory"),          # nothing to draw
             timed("triton", "longformer", 64, 2, 8192, 1.0, 99.0)]                # another batch: not drawn
    import matplotlib.pyplot as plt

    subplots, drawn = plt.subplots, {}

    def spy(*args, **kwargs):
        fig, drawn["axes"] = subplots(*args, **kwargs)
        return fig, drawn["axes"]
    monkeypatch.setattr(plt, "subplots", spy)
    gk.figure({"meta": META, "rows": rows}, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = drawn["axes"]
    assert axes.shape == (4, 3)                                              # (time, memory) x D rows, patterns
    assert [ax.get_title() for ax in axes[:, 0]] == ["longformer, D=64", "longformer, D=128"] * 2
    time_lines = {line.get_label(): list(line.get_ydata()) for line in axes[0, 0].get_lines()}
    assert time_lines == {"triton": [4.096, 8.192], "flex-128": [4.096, 8.192], "masked-sdpa": [4.096, 8.192]}
    assert [list(line.get_ydata()) for line in axes[2, 0].get_lines()][0] == [409.6, 819.2]   # peak MiB
    assert axes[0, 1].get_lines() == []                                      # no BigBird rows


def test_plan_puts_the_targets_first_then_the_million_then_the_rest_by_d_and_n():
    points = gk.plan(gk.parse_args([]))
    assert len(points) == 6 * 2 * 3 * 6 + 4                                 # N x D x patterns x impls + 1M
    assert len(set(points)) == len(points)
    targets = [(impl, pattern, d) for d in (64, 128) for pattern in gk.PATTERNS for impl in gk.DEFAULT_IMPLS]
    assert [(impl, pattern, d) for impl, pattern, d, b, n in points[:36]] == targets
    assert {(b, n) for *_, b, n in points[:36]} == {(1, N_32K)}
    assert points[36:40] == [(impl, "longformer", 64, 1, gk.MILLION) for impl in gk.DEFAULT_IMPLS if impl in gk.SPARSE]
    rest = [(d, n) for _, _, d, _, n in points[40::18]]                      # 18 points (patterns x impls) each
    assert rest == [(d, n) for d in (64, 128) for n in (4096, 8192, 16384, 65536, 131072)]
    assert points[40:43] == [("triton", "longformer", 64, 1, 4096), ("triton-128", "longformer", 64, 1, 4096),
                             ("flex-128", "longformer", 64, 1, 4096)]
    assert points[-1] == ("masked-sdpa", "sliding-causal", 128, 1, 131072)
    assert gk.MILLION not in {n for *_, n in gk.plan(gk.parse_args(["--no-million"]))}
    assert gk.MILLION not in {n for *_, n in gk.plan(gk.parse_args(["--patterns", "bigbird-itc"]))}
    assert gk.plan(gk.parse_args(["--n", str(gk.MILLION), "--impls", "triton", "--patterns", "longformer",
                                  "--head-dim", "64"])) == [("triton", "longformer", 64, 1, gk.MILLION)]
    assert doctest.testmod(gk) == (0, 3)                                     # examples: (failed, attempted)


def test_arguments_defaults_quick_and_million(tmp_path):
    args = gk.parse_args([])
    assert (args.budget_s, args.resume, args.million, args.no_million, args.list) == (500.0, False, False, False, False)
    assert (args.n, args.batch, args.head_dim) == ([4096, 8192, 16384, 32768, 65536, 131072], [1], [64, 128])
    assert args.impls == ["triton", "triton-128", "flex-128", "flex-64", "sdpa", "masked-sdpa"]
    assert args.patterns == ["longformer", "bigbird-itc", "sliding-causal"]
    assert args.out == SCRIPT.parent / "results"
    quick = gk.parse_args(["--quick", "--budget-s", "60", "--out", str(tmp_path)])
    assert (quick.n, quick.batch, quick.head_dim, quick.budget_s, quick.out) == ([8192], [1], [64], 60.0, tmp_path)
    assert len(gk.plan(quick)) == 18                                         # no 1M point in a smoke run
    million = [(impl, "longformer", 64, 1, 1_048_576) for impl in ("triton", "triton-128", "flex-128", "flex-64")]
    assert gk.plan(gk.parse_args(["--million"])) == million
    assert gk.plan(gk.parse_args(["--million", "--impls", "sdpa", "triton"])) == million[:1]
    for wrong in (["--impls", "xformers"], ["--million", "--no-million"], ["--patterns", "streaming-causal"]):
        with pytest.raises(SystemExit):
            gk.parse_args(wrong)


def test_patterns_are_the_issues():
    assert gk.PATTERNS["longformer"] == (sa.Local(256) | sa.Global(first=16), False)
    assert gk.PATTERNS["sliding-causal"] == (sa.Local(1023, 0) & sa.Causal(), True)
    assert gk.PATTERNS["bigbird-itc"] == (sa.bigbird(), False)                # ITC: global blocks, no extra tokens
    mask = gk.PATTERNS["sliding-causal"][0].mask(2048)[0]                     # (N, N)
    assert mask.sum(1).tolist() == [min(i + 1, 1024) for i in range(2048)]   # the token and the 1023 before it


def test_resume_keeps_rows_and_lists_only_what_is_left(tmp_path, capsys):
    rows = [row("triton", "longformer", 64, 1, 8192, fwd_ms=1.0), row("flex-128", "longformer", 64, 1, 8192,
                                                                       error="out of memory")]
    pending = [(impl, "longformer", 64, 1, 8192) for impl in ("triton-128", "flex-64", "sdpa", "masked-sdpa")]
    gk.write(tmp_path, META, rows, pending=pending)
    record = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert record["not_measured"] == [row(*point) for point in pending]
    assert (tmp_path / "gpu_kernels.md").read_text() == gk.to_markdown(rows, META, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_kernels.json", "gpu_kernels.md"]  # nothing half
    assert gk.resumed_rows(tmp_path / "gpu_kernels.json", META) == rows
    with pytest.raises(SystemExit, match="device: 'NVIDIA H100 80GB HBM3' there, 'NVIDIA H200' here"):
        gk.resumed_rows(tmp_path / "gpu_kernels.json", dict(META, device="NVIDIA H200"))
    with pytest.raises(SystemExit, match="driver: '550.54.15' there, None here"):
        gk.resumed_rows(tmp_path / "gpu_kernels.json", dict(META, driver=None))
    grid = ["--quick", "--patterns", "longformer", "--out", str(tmp_path)]
    gk.main(["--list", "--resume", *grid])                                   # error rows count as measured
    assert capsys.readouterr().out.splitlines() == [" ".join(map(str, point)) for point in pending]
    gk.main(["--list", *grid])                                               # without --resume: everything
    assert capsys.readouterr().out.splitlines() == [f"{impl} longformer 64 1 8192" for impl in gk.DEFAULT_IMPLS]


def test_machine_records_gpu_memory_driver_and_cuda(monkeypatch):
    class Properties:
        name, total_memory = "NVIDIA H100 80GB HBM3", 85_031_714_816          # an H100's 79.19 GiB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    monkeypatch.setattr(machine, "nvidia_driver", lambda: "550.54.15")
    meta = gk.machine()
    assert (meta["device"], meta["gpu_memory_gib"], meta["driver"], meta["cuda"]) == (
        "NVIDIA H100 80GB HBM3", 79.2, "550.54.15", torch.version.cuda)
    assert list(meta) == list(META)


def test_run_stops_at_the_budget_and_saves_after_every_point():
    todo = [("triton", "longformer", 64, 1, n) for n in (1, 2, 3, 4, 5)]
    ticks, saved = iter([0.0, 4.0, 8.0, 12.0]), []
    rows = [row("sdpa", "longformer", 64, 1, 99)]                            # kept from an earlier run

    def save(rows, pending):
        saved.append(([r["n"] for r in rows], pending))

    left, why = gk.run(todo, rows, lambda *point: row(*point, fwd_ms=1.0), save, deadline=10.0,
                       usable=lambda: True, clock=lambda: next(ticks))
    assert (left, why) == (todo[3:], "time budget spent")
    assert saved == [([99, 1], todo[1:]), ([99, 1, 2], todo[2:]), ([99, 1, 2, 3], todo[3:])]
    assert gk.run(todo[:1], [], lambda *p: row(*p), lambda *_: None, 10.0, lambda: True, lambda: 0.0) == ([], "")
    assert gk.run(todo, [], lambda *p: row(*p), lambda *_: None, 10.0, lambda: True, lambda: 10.0) == (
        todo, "time budget spent")


def test_run_stops_when_the_gpu_is_lost():
    todo = [("triton", "longformer", 64, 1, n) for n in (1, 2, 3)]
    health = iter([True, False])
    rows = []
    left, why = gk.run(todo, rows, lambda *point: row(*point, error=f"boom at {point[-1]}"), lambda *_: None,
                       deadline=10.0, usable=lambda: next(health), clock=lambda: 0.0)
    assert left == todo[2:]
    assert why == "the CUDA context is unusable after boom at 2"
    assert [r["n"] for r in rows] == [1, 2]


def test_main_saves_resumes_draws_and_stops_with_a_fake_gpu(monkeypatch, tmp_path, capsys):
    measured, drawn = [], []

    def fake_measure(*point):
        measured.append(point)
        return timed(*point, 1.0, 2.0)

    def fake_figure(record, path):
        drawn.append(len(record["rows"]))
        path.write_bytes(b"png")

    for target, name, value in ((torch.cuda, "is_available", lambda: True), (gk, "machine", lambda: META),
                                (gk, "measure", fake_measure), (gk, "cuda_usable", lambda: True),
                                (gk, "figure", fake_figure)):
        monkeypatch.setattr(target, name, value)
    grid = ["--quick", "--patterns", "longformer", "--out", str(tmp_path)]
    points = [(impl, "longformer", 64, 1, 8192) for impl in gk.DEFAULT_IMPLS]

    def saved():
        record = json.loads((tmp_path / "gpu_kernels.json").read_text())
        return [gk.point_of(r) for r in record["rows"]], [gk.point_of(p) for p in record["not_measured"]]

    gk.main([*grid, "--budget-s", "0"])                                      # spent at once: nothing measured
    assert measured == [] and saved() == ([], points) and drawn == [0]       # the figure too, when it stops
    assert "not measured (time budget spent): 6 points" in capsys.readouterr().out
    gk.main([*grid, "--impls", "triton"])
    gk.main([*grid, "--resume"])                                             # triton kept, the others measured
    assert drawn == [0, 1, 6]                                                # once a run, not after every point
    gk.main([*grid, "--resume", "--million"])
    million = [(impl, *gk.MILLION_POINT) for impl in gk.DEFAULT_IMPLS if impl in gk.SPARSE]
    assert measured == points + million and saved() == (points + million, [])
    assert "1M tokens" in (tmp_path / "gpu_kernels.md").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_kernels.json", "gpu_kernels.md", "gpu_kernels.png"]
    monkeypatch.setattr(gk, "cuda_usable", lambda: False)
    with pytest.raises(SystemExit, match="^stopped: the CUDA context is unusable after this point$"):
        gk.main(grid)                                                        # without --resume: replaces the file
    assert saved() == (points[:1], points[1:]) and drawn[-1] == 1
    assert "replacing" in capsys.readouterr().out


@without_a_gpu
def test_main_refuses_without_cuda_and_writes_nothing(tmp_path):
    assert not torch.cuda.is_available()
    with pytest.raises(SystemExit) as stop:
        gk.main(["--quick", "--out", str(tmp_path)])
    assert "needs a CUDA GPU" in str(stop.value.code) and "torch.cuda.is_available() is False" in str(stop.value.code)
    assert list(tmp_path.iterdir()) == []


@without_a_gpu
def test_a_failing_point_is_a_row_not_a_crash():
    assert gk.measure("flex-128", "bigbird-itc", 128, 2, 256) == row(
        "flex-128", "bigbird-itc", 128, 2, 256, error="AssertionError: Torch not compiled with CUDA enabled")


def test_masked_sdpa_that_would_not_fit_is_an_error_row_without_allocating(monkeypatch):
    def allocates(*args, **kwargs):
        raise AssertionError("allocated")

    monkeypatch.setattr(gk, "DEVICE", "cpu")
    monkeypatch.setattr(gk, "free_gpu_bytes", lambda: 40 * 2**30)
    monkeypatch.setattr(torch, "randn", allocates)                           # no inputs ...
    monkeypatch.setattr(sa.BlockLayout, "row_mask", allocates)               # ... and no mask were made
    result = gk.measure("masked-sdpa", "bigbird-itc", 64, 1, N_32K)          # heads differ: 16 masks
    assert result == row("masked-sdpa", "bigbird-itc", 64, 1, N_32K, density=result["density"],
                         fwd_flops=4 * 16 * N_32K**2 * 64, error="does not fit: needs ~48.5 GiB, 40.0 GiB free")
    assert "AssertionError" in gk.measure("masked-sdpa", "longformer", 64, 1, N_32K)["error"]  # 3.5 GiB: tries


@pytest.mark.parametrize("pattern", list(gk.PATTERNS))
def test_masked_sdpa_attends_where_the_pattern_allows(pattern, monkeypatch):
    """The mask is the pattern's, broadcast over heads when they share it; the output the reference's."""
    sdpa, masks = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask):
        masks.append((attn_mask.shape, attn_mask.dtype))
        return sdpa(q, k, v, attn_mask=attn_mask)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layout = gk.PATTERNS[pattern][0].layout(96, heads=2, block_size=32)
    q, k, v = (torch.randn(2, 2, 96, 16) for _ in range(3))                  # (B, H, N, D)
    forward, details = gk.make_runner("masked-sdpa", q, k, v, layout, causal=False)
    torch.testing.assert_close(forward(), sa.sparse_attention(q, k, v, layout, backend="reference"))
    assert details["sdpa_backend"] in {name.lower() for name in SDPBackend.__members__} - {"error"}
    heads = 2 if pattern == "bigbird-itc" else 1                            # BigBird's random blocks differ by head
    assert masks == [((1, heads, 96, 96), torch.bool)]
    assert gk.masked_sdpa_bytes(layout, batch=2, head_dim=16) == heads * 96 * 96 * 3 + 8 * 2 * 16 * 96 * 16 * 2


@needs_triton
@without_a_gpu
def test_flex_compiles_afresh_for_every_point_and_matches_triton(monkeypatch):
    """Past recompile_limit shapes Dynamo would run flex_attention eagerly; peers.compiled_flex resets its cache
    each time, and fullgraph=True would raise instead of falling back. Eager backend, CPU, interpreter."""
    counter, options_seen = torch._dynamo.testing.CompileCounter(), []
    compile_ = torch.compile

    def compile_eagerly(fn, **options):
        options_seen.append(options)
        return compile_(fn, backend=counter, **options)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    pattern = sa.Local(16) | sa.Global(first=2)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n, block in ((128, 64), (96, 32)):                               # the second shape would exceed it
            layout = pattern.layout(n, heads=2, block_size=block)
            q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))            # (B, H, N, D)
            flex, details = gk.make_runner("flex-64", q, k, v, layout, causal=False)
            triton, _ = gk.make_runner("triton", q, k, v, layout, causal=False)
            torch.testing.assert_close(flex(), triton(), atol=1e-5, rtol=1e-5)
            assert details == {}
        assert counter.frame_count == 2
        assert options_seen == [{"dynamic": False, "fullgraph": True, "mode": None}] * 2
        stale = compile_(flex_attention, backend=counter, **options_seen[0])
        q = torch.randn(1, 2, 128, 16)                                       # (B, H, N, D)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):       # no reset: an error, not eager
            stale(q, q, q, block_mask=pattern.layout(128, heads=2, block_size=16).to_block_mask())


def fake_flex(calls):
    """peers.compiled_flex's stand-in on CPU, where FlexAttention has no backward: dense attention, differentiable;
    records the block mask's block and the kernel options it was called with."""
    def flex(q, k, v, block_mask, kernel_options):
        calls.append((block_mask.BLOCK_SIZE, kernel_options))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return lambda mode=None, fresh=True: flex


def sparse_flops(pattern, block):
    return 2 * gk.PATTERNS[pattern][0].layout(80, heads=2, block_size=block).flops(16)          # B=2


@pytest.mark.slow  # Triton's interpreter at N = 80
@pytest.mark.parametrize("impl, pattern, flops, details", [
    pytest.param("triton", "longformer", sparse_flops("longformer", 64), {}, marks=triton_on_cpu),
    pytest.param("triton-128", "sliding-causal", sparse_flops("sliding-causal", 128), {}, marks=triton_on_cpu),
    ("flex-128", "bigbird-itc", sparse_flops("bigbird-itc", 128), {}),
    ("flex-64", "bigbird-itc", sparse_flops("bigbird-itc", 64), {}),
    ("sdpa", "sliding-causal", 4 * 2 * 2 * 80 * 80 * 16 // 2, {}),            # dense, causal: half
    ("masked-sdpa", "sliding-causal", 4 * 2 * 2 * 80 * 80 * 16, {"sdpa_backend": "flash_attention"})])  # every pair
def test_a_point_fills_every_field_on_cpu(monkeypatch, impl, pattern, flops, details):
    """The whole measurement on CPU (triton in its interpreter, flex faked): device, dtype and heads swapped,
    timers faked (2 ms, warm-ups 0.5 s; peaks 1, 2, 3 MiB)."""
    calls = []
    monkeypatch.setattr(peers, "compiled_flex", fake_flex(calls))
    for name, value in {"DEVICE": "cpu", "DTYPE": torch.float32, "HEADS": 2,
                        "free_gpu_bytes": lambda: 2**30, "bench_ms": lambda fn, grads=(): (fn(), 2.0)[1],
                        "peak_mb": lambda fn: (fn(), (1.0, 2.0, 3.0))[1],
                        "time": SimpleNamespace(perf_counter=itertools.count(0.0, 0.5).__next__)}.items():
        monkeypatch.setattr(gk, name, value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    result = gk.measure(impl, pattern, 16, 2, 80)
    assert "error" not in result, result["error"]
    warmups = [result.pop(key) for key in ("fwd_warmup_s", "fwd_bwd_warmup_s")]
    assert warmups == [0.5, 0.5]                                 # one clock step around each warm-up call
    assert result == row(impl, pattern, 16, 2, 80, density=gk.PATTERNS[pattern][0].layout(80, heads=2).density,
                         fwd_flops=flops, **details, fwd_ms=2.0, fwd_tflops=flops / 2.0 / 1e9, fwd_peak_mb=1.0,
                         fwd_bwd_ms=2.0, fwd_bwd_tflops=3.5 * flops / 2.0 / 1e9, fwd_bwd_peak_mb=1.0,
                         fwd_bwd_total_peak_mb=2.0, fwd_bwd_reserved_peak_mb=3.0)
    block = gk.FLEX_BLOCKS.get(impl)
    assert calls == ([((block, block), peers.FLEX_TILES.get(block))] * 6 if block else [])  # warm-up, timer, peak x 2
