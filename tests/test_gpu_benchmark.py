"""benchmarks/gpu_kernels.py without a GPU: its table, plan, resume, budget, arguments and refusals."""
import doctest
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from torch.nn.attention.flex_attention import flex_attention

import sparse_attn as sa

# Triton runs on CPU tensors in its interpreter (tests/conftest.py), but it must be installed.
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"
_spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
gk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gk)

META = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "python": "3.11.7",
        "dtype": "torch.bfloat16", "heads": 16, "block_size": 64}


def row(impl, pattern, head_dim, batch, n, **results):
    return {"impl": impl, "pattern": pattern, "head_dim": head_dim, "batch": batch, "n": n, **results}


def table_line(markdown: str, start: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith(start))


def test_markdown_cells_ratios_errors_and_missing_implementations():
    rows = [row("triton", "longformer", 64, 1, 32768, density=0.031, fwd_ms=1.0, fwd_bwd_ms=4.0, fwd_tflops=100.0,
                fwd_bwd_tflops=90.0, fwd_bwd_peak_mb=300.0),
            row("flex", "longformer", 64, 1, 32768, density=0.031, fwd_ms=1.5, fwd_bwd_ms=3.6, fwd_tflops=66.7,
                fwd_bwd_tflops=97.2, fwd_bwd_peak_mb=400.0),
            row("sdpa", "longformer", 64, 1, 32768, density=0.031, fwd_ms=2.0, fwd_bwd_ms=8.0, fwd_tflops=200.0,
                fwd_bwd_tflops=150.0, fwd_bwd_peak_mb=900.0),
            row("triton", "bigbird-itc", 128, 1, 32768, error="out of memory"),       # failed before the layout
            row("flex", "bigbird-itc", 128, 1, 32768, density=0.1, fwd_ms=2.0, fwd_tflops=50.0,
                error="OutOfResources: out of resource: shared memory"),               # forward done, backward failed
            row("triton", "streaming-causal", 64, 2, 8192, density=0.2, fwd_ms=0.5, fwd_bwd_ms=2.0, fwd_tflops=80.0,
                fwd_bwd_tflops=70.0, fwd_bwd_peak_mb=50.0)]
    oom = row("sdpa", "longformer", 128, 4, 131072, error="out of memory")    # no layout, no density
    md = gk.to_markdown(rows[3:][::-1] + rows[:3] + [oom], META)                      # any row order
    assert md.startswith("# GPU kernels on NVIDIA H100 80GB HBM3\n")
    assert "torch 2.11.0, triton 3.6.0" in md
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| pattern")]
    assert lines == [  # points in pattern order, then D, B, N
        "| longformer | 64 | 1 | 32768 | 3.10% | 1.00 / 1.50 / 2.00 | 4.00 / 3.60 / 8.00 | 100 / 67 / 200 "
        "| 90 / 97 / 150 | 1.50 | 0.90 | 50% | 300 / 400 / 900 |",
        "| longformer | 128 | 4 | 131072 | — | — / — / E2 | — / — / E2 | — / — / E2 | — / — / E2 | — | — | — "
        "| — / — / E2 |",
        "| bigbird-itc | 128 | 1 | 32768 | 10.00% | E2 / 2.00 / — | E2 / E1 / — | E2 / 50 / — | E2 / E1 / — "
        "| — | — | — | E2 / E1 / — |",
        "| streaming-causal | 64 | 2 | 8192 | 20.00% | 0.50 / — / — | 2.00 / — / — | 80 / — / — | 70 / — / — "
        "| — | — | — | 50 / — / — |"]
    errors = md.split("Errors:\n\n")[1].split("\n\n")[0]
    assert errors == "- E1: OutOfResources: out of resource: shared memory\n- E2: out of memory"
    assert "1M tokens" not in md and "Incomplete" not in md


def test_markdown_without_errors_has_no_error_list():
    md = gk.to_markdown([row("sdpa", "longformer", 64, 1, 8192, density=0.5, fwd_ms=1.0, fwd_bwd_ms=2.0,
                             fwd_tflops=1.0, fwd_bwd_tflops=1.0, fwd_bwd_peak_mb=1.0)], META)
    assert "Errors:" not in md
    assert table_line(md, "| longformer").startswith("| longformer | 64 | 1 | 8192 | 50.00% | — / — / 1.00 |")


def test_markdown_million_line_and_pending_count():
    rows = [row("triton", "longformer", 64, 1, gk.MILLION, density=0.0005, fwd_ms=20.0, fwd_bwd_ms=75.25,
                fwd_tflops=150.0, fwd_bwd_tflops=140.0, fwd_bwd_peak_mb=1000.0, fwd_bwd_total_peak_mb=20000.0,
                fwd_bwd_reserved_peak_mb=22000.0),
            row("flex", "longformer", 64, 1, gk.MILLION, error="out of memory")]
    md = gk.to_markdown(rows, META, pending=7)
    assert table_line(md, "| longformer | 64 | 1 | 1048576 |").startswith("| longformer | 64 | 1 | 1048576 | 0.05% |")
    assert table_line(md, "| longformer | 64 | 1 | 1048576 |").endswith("| — | — | — | 1000 / E1 / — |")
    assert table_line(md, "- triton:") == (
        "- triton: forward 20.0 ms, forward+backward 75.2 ms; forward+backward peak 21.0 GB allocated in all "
        "(inputs, gradients, layout included; 23.1 GB reserved by the allocator): fits in 80 GB")
    assert table_line(md, "- flex:") == "- flex: E1 (out of memory)"
    assert table_line(md, "**Incomplete:**").startswith("**Incomplete:** 7 requested points not measured yet")
    big = [dict(rows[0], fwd_bwd_total_peak_mb=80e9 / 2**20 + 1)]
    assert table_line(gk.to_markdown(big, META), "- triton:").endswith("80.0 GB allocated in all (inputs, gradients, "
                                                                       "layout included; 23.1 GB reserved by the "
                                                                       "allocator): does not fit in 80 GB")


def test_plan_puts_the_target_points_first():
    points = gk.plan(gk.parse_args([]))
    assert len(points) == 5 * 3 * 2 * 3 * 3                                  # N x B x D x patterns x impls
    assert len(set(points)) == len(points)
    first = [(impl, pattern, d) for impl, pattern, d, b, n in points[:18]]
    assert {(b, n) for *_, b, n in points[:18]} == {(1, 32768)}
    assert first == [(impl, pattern, d) for d in (64, 128) for pattern in gk.PATTERNS for impl in gk.IMPLEMENTATIONS]
    assert [point[2:] for point in points[18:21]] == [(64, 1, 8192)] * 3    # then B=1, D=64 at the other N
    assert points[-1] == ("sdpa", "streaming-causal", 128, 4, 131072)
    assert doctest.testmod(gk) == (0, 1)                                     # plan's example: (failed, attempted)


def test_arguments_defaults_quick_and_million(tmp_path):
    args = gk.parse_args([])
    assert (args.budget_s, args.resume, args.million, args.list) == (500.0, False, False, False)
    assert (args.n, args.batch, args.head_dim) == ([8192, 16384, 32768, 65536, 131072], [1, 2, 4], [64, 128])
    assert args.out == SCRIPT.parent / "results"
    quick = gk.parse_args(["--quick", "--budget-s", "60", "--out", str(tmp_path)])
    assert (quick.n, quick.batch, quick.head_dim, quick.budget_s, quick.out) == ([8192], [1], [64], 60.0, tmp_path)
    assert gk.plan(gk.parse_args(["--million"])) == [("triton", "longformer", 64, 1, 1_048_576),
                                                     ("flex", "longformer", 64, 1, 1_048_576)]
    assert gk.plan(gk.parse_args(["--million", "--impls", "sdpa", "triton"])) == [
        ("triton", "longformer", 64, 1, 1_048_576)]
    with pytest.raises(SystemExit):
        gk.parse_args(["--impls", "xformers"])


def test_resume_keeps_rows_and_lists_only_what_is_left(tmp_path, capsys):
    rows = [row("triton", "longformer", 64, 1, 8192, fwd_ms=1.0), row("flex", "longformer", 64, 1, 8192,
                                                                       error="out of memory")]
    gk.write(tmp_path, META, rows, pending=[("sdpa", "longformer", 64, 1, 8192)])
    record = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert record["not_measured"] == [row("sdpa", "longformer", 64, 1, 8192)]
    assert (tmp_path / "gpu_kernels.md").read_text() == gk.to_markdown(rows, META, 1)
    assert not list(tmp_path.glob("*.tmp"))
    assert gk.load_rows(tmp_path / "gpu_kernels.json", META) == rows
    assert gk.load_rows(tmp_path / "missing.json", META) == []
    with pytest.raises(SystemExit, match="device: 'NVIDIA H100 80GB HBM3' there, 'NVIDIA H200' here"):
        gk.load_rows(tmp_path / "gpu_kernels.json", dict(META, device="NVIDIA H200"))
    grid = ["--quick", "--patterns", "longformer", "--out", str(tmp_path)]
    gk.main(["--list", "--resume", *grid])                                   # error rows count as measured
    assert capsys.readouterr().out == "sdpa longformer 64 1 8192\n"
    gk.main(["--list", *grid])                                               # without --resume: everything
    assert capsys.readouterr().out.splitlines() == [f"{impl} longformer 64 1 8192" for impl in gk.IMPLEMENTATIONS]


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


def test_main_saves_resumes_and_stops_with_a_fake_gpu(monkeypatch, tmp_path, capsys):
    measured = []

    def fake_measure(*point):
        measured.append(point)
        return row(*point, fwd_ms=1.0)

    for target, name, value in ((torch.cuda, "is_available", lambda: True), (gk, "machine", lambda: META),
                                (gk, "measure", fake_measure), (gk, "cuda_usable", lambda: True)):
        monkeypatch.setattr(target, name, value)
    grid = ["--quick", "--patterns", "longformer", "--out", str(tmp_path)]
    points = [(impl, "longformer", 64, 1, 8192) for impl in gk.IMPLEMENTATIONS]

    def saved():
        record = json.loads((tmp_path / "gpu_kernels.json").read_text())
        return [gk._key(r) for r in record["rows"]], [gk._key(p) for p in record["not_measured"]]

    gk.main([*grid, "--budget-s", "0"])                                      # spent at once: nothing measured
    assert measured == [] and saved() == ([], points)
    assert "not measured (time budget spent): 3 points" in capsys.readouterr().out
    gk.main([*grid, "--impls", "triton"])
    gk.main([*grid, "--resume"])                                             # triton kept, the others measured
    gk.main([*grid, "--resume", "--million"])
    million = [(impl, *gk.MILLION_POINT) for impl in ("triton", "flex")]
    assert measured == points + million and saved() == (points + million, [])
    assert "1M tokens" in (tmp_path / "gpu_kernels.md").read_text()
    monkeypatch.setattr(gk, "cuda_usable", lambda: False)
    with pytest.raises(SystemExit, match="^stopped: the CUDA context is unusable after this point$"):
        gk.main(grid)                                                        # without --resume: replaces the file
    assert saved() == (points[:1], points[1:])
    assert "replacing" in capsys.readouterr().out


def test_main_refuses_without_cuda_and_writes_nothing(tmp_path):
    assert not torch.cuda.is_available()
    with pytest.raises(SystemExit) as stop:
        gk.main(["--quick", "--out", str(tmp_path)])
    assert "needs a CUDA GPU" in str(stop.value.code) and "torch.cuda.is_available() is False" in str(stop.value.code)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_point_is_a_row_not_a_crash():
    assert gk.measure("flex", "bigbird-itc", 128, 2, 256) == row(
        "flex", "bigbird-itc", 128, 2, 256, error="AssertionError: Torch not compiled with CUDA enabled")


@needs_triton
def test_flex_compiles_afresh_for_every_point_and_matches_triton(monkeypatch):
    """Past recompile_limit shapes Dynamo would run flex_attention eagerly; compiled_flex resets its cache
    each time, and fullgraph=True would raise instead of falling back. Eager backend, CPU, interpreter."""
    counter, options_seen = torch._dynamo.testing.CompileCounter(), []
    compile_ = torch.compile

    def compile_eagerly(fn, **options):
        options_seen.append(options)
        return compile_(fn, backend=counter, **options)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    pattern = sa.Local(16) | sa.Global(first=2)
    with torch._dynamo.config.patch(recompile_limit=1):
        for n in (64, 96):                                                   # the second shape would exceed it
            layout = pattern.layout(n, heads=2, block_size=16)
            q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))            # (B, H, N, D)
            flex = gk.make_runner("flex", q, k, v, layout, causal=False)()
            triton = gk.make_runner("triton", q, k, v, layout, causal=False)()
            torch.testing.assert_close(flex, triton, atol=1e-5, rtol=1e-5)
        assert counter.frame_count == 2
        assert options_seen == [{"dynamic": False, "fullgraph": True}] * 2
        stale = compile_(flex_attention, backend=counter, **options_seen[0])
        q = torch.randn(1, 2, 128, 16)                                       # (B, H, N, D)
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):       # no reset: an error, not eager
            stale(q, q, q, block_mask=pattern.layout(128, heads=2, block_size=16).to_block_mask())


@pytest.mark.parametrize("impl, pattern, flops", [
    pytest.param("triton", "longformer", 2 * (sa.Local(256) | sa.Global(first=16)).layout(80, heads=2).flops(16),
                 marks=needs_triton),                                                                    # B=2
    ("sdpa", "streaming-causal", 4 * 2 * 2 * 80 * 80 * 16 // 2)])            # dense, causal: half
def test_a_point_fills_every_field_on_cpu(monkeypatch, impl, pattern, flops):
    """The whole measurement on CPU (triton in its interpreter): device, dtype and heads swapped, timers
    faked (2 ms; peaks 1, 2, 3 MiB)."""
    for name, value in {"DEVICE": "cpu", "DTYPE": torch.float32, "HEADS": 2,
                        "bench_ms": lambda fn, grads=(): (fn(), 2.0)[1],
                        "peak_mb": lambda fn: (fn(), (1.0, 2.0, 3.0))[1]}.items():
        monkeypatch.setattr(gk, name, value)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    result = gk.measure(impl, pattern, 16, 2, 80)
    assert "error" not in result, result["error"]
    warmups = [result.pop(key) for key in ("fwd_warmup_s", "fwd_bwd_warmup_s")]
    assert all(0 < seconds < 60 for seconds in warmups)
    assert result == row(impl, pattern, 16, 2, 80, density=gk.PATTERNS[pattern][0].layout(80, heads=2).density,
                         fwd_flops=flops, fwd_ms=2.0, fwd_tflops=flops / 2.0 / 1e9, fwd_peak_mb=1.0,
                         fwd_bwd_ms=2.0, fwd_bwd_tflops=3.5 * flops / 2.0 / 1e9, fwd_bwd_peak_mb=1.0,
                         fwd_bwd_total_peak_mb=2.0, fwd_bwd_reserved_peak_mb=3.0)
