"""The sparse-attn command: every subcommand in a subprocess with tiny settings, and its errors."""
import json
import subprocess
import sys

import pytest

from sparse_attn.cli import UsageError, parse_pattern

import sparse_attn as sa


def run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "sparse_attn", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_info_lists_versions_devices_and_backends():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    for word in ("Python", "torch", "numba", "triton", "transformers", "devices:", "cpu", "backends:",
                 "reference    available", "triton"):
        assert word in proc.stdout


def test_patterns_lists_every_preset_with_densities():
    proc = run("patterns")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in sa.list_presets():
        line = next(line for line in lines if line.startswith(name + " "))
        heads = parse_pattern(name)[1] or 1
        expected = [f"{sa.preset(name).layout(n, heads=heads).density:.2%}" for n in (4096, 16384)]
        assert line.split()[1:3] == expected, line


def test_show_prints_the_layout_and_writes_a_figure(tmp_path):
    out = tmp_path / "fig.png"
    proc = run("show", "Local(64) | Global(first=2)", "--seq-len", "512", "--heads", "0,1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "token density" in proc.stdout and "nnz blocks" in proc.stdout and "of dense" in proc.stdout
    grid = ["#+++++++",                                               # the ASCII grid of head 0 (heads shared):
            "+#+.....",                                               # '#' full, '+' partial, '.' skipped
            "++#+....",
            "+.+#+...",
            "+..+#+..",
            "+...+#+.",
            "+....+#+",
            "+.....+#"]
    lines = [line.strip() for line in proc.stdout.splitlines()]
    start = lines.index(grid[0])
    assert lines[start:start + len(grid)] == grid
    assert "68 computed (53.1%), 16 full, 52 partial" in proc.stdout
    assert "= 53.12% of dense" in proc.stdout                           # 68 of 2 heads x 64 blocks
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_takes_toml_files(tmp_path):
    path = tmp_path / "mine.toml"
    sa.save_pattern(sa.PerHead([sa.Local(8), sa.Causal()]), path, description="two heads", heads=2)
    proc = run("show", str(path), "--seq-len", "64")
    assert proc.returncode == 0, proc.stderr
    assert "BlockLayout of PerHead" in proc.stdout and "heads 2 (per head)" in proc.stdout
    assert parse_pattern("bigbird-itc")[0] == sa.preset("bigbird-itc")


def test_bench_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = run("bench", "--lengths", "256", "512", "--patterns", "longformer", "--backends", "sparse_attn-reference",
               "sdpa-dense", "--repeats", "1", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["machine"]["versions"]["torch"] and len(results["load_average_start"]) == 3
    assert results["command"].startswith("sparse-attn bench --lengths 256 512")
    points = results["points"]
    assert [(p["implementation"], p["n"], p["status"]) for p in points] == [
        ("sparse_attn-reference", 256, "ok"), ("sparse_attn-reference", 512, "ok"),
        ("sdpa-dense", 256, "ok"), ("sdpa-dense", 512, "ok")]
    assert all(p["time_s"] > 0 and p["memory_mb"] >= 0 and p["process_peak_mb"] > 0 for p in points)
    table = (out / "results.md").read_text()
    assert "| sdpa-dense |" in table and "| implementation | 256 | 512 |" in table
    for name in ("time.png", "memory.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_records_timeouts_and_keeps_going(tmp_path):
    from sparse_attn import bench

    results = bench.sweep({"p": sa.Local(1)}, [128, 256], ["sdpa-dense", "hf-longformer", "flex"], timeout=0.5,
                          progress=False)
    statuses = {(p["implementation"], p["n"]): p["status"] for p in results["points"]}
    assert statuses[("sdpa-dense", 128)] == "timeout" and statuses[("sdpa-dense", 256)] == "skipped"


def test_bench_availability():
    from sparse_attn import bench

    assert bench._longformer_window(sa.Local(256) | sa.Global(first=16)) == (256, sa.Global(first=16))
    assert bench._longformer_window(sa.Local(1)) == (1, None)
    assert bench._longformer_window(sa.preset("bigbird-itc")) is None
    assert bench._longformer_window(sa.Local(4, 2)) is None                 # HF windows are symmetric
    assert bench.availability("hf-longformer", sa.preset("bigbird-itc"), "cpu")[0] is False
    assert bench.availability("sparse_attn-numba", sa.Local(1), "cuda") == (False, "numba runs CPU tensors only")
    assert bench.availability("sparse_attn-triton", sa.Local(1), "cpu")[0] is False
    assert bench.availability("sdpa-dense", sa.Local(1), "cpu") == (True, "")


@pytest.mark.parametrize("args, message", [
    (["show", "Local(64) | __import__('os')", "--seq-len", "64"], "'__import__' is not a pattern constructor"),
    (["show", "Local(64).__class__", "--seq-len", "64"], "is not allowed"),
    (["show", "Local(", "--seq-len", "64"], "is not a preset"),
    (["show", "Local(-1)", "--seq-len", "64"], "Local before must be >= 0, got -1"),
    (["show", "longformer", "--seq-len", "64"], "longformer must be called"),
    (["show", "Local(4)", "--seq-len", "0"], "expected a positive integer"),
    (["show", "Local(4)", "--seq-len", "64", "--heads", "a"], "expected comma-separated head indices"),
    (["show", "missing.toml", "--seq-len", "64"], "no pattern file at missing.toml"),
    (["bench", "--backends", "cuda-magic"], "unknown --backends cuda-magic"),
    (["bench", "--patterns", "longformerr"], "'longformerr' is not a preset (bigbird-etc, "),
    (["bench", "--lengths", "-5"], "expected a positive integer"),
    (["bench", "--patterns", "dilated-longformer", "--lengths", "256", "--no-progress"],
     "pattern 'dilated-longformer' does not fit --num-heads 8: PerHead has 12 patterns but heads=8"),
    (["bench", "--patterns", "dilated-longformer", "--lengths", "256", "--no-progress"], "pass --num-heads 12"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_message(args, message):
    proc = run(*args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_parse_pattern_builds_what_python_would():
    assert parse_pattern("Local(64) | Global(first=2)")[0] == sa.Local(64) | sa.Global(first=2)
    assert parse_pattern("(Local(3, 0) | Stride(4)) & Causal()")[0] == sa.sparse_transformer(4)
    assert parse_pattern("PerHead([Local(1), Dense()])")[0] == sa.PerHead([sa.Local(1), sa.Dense()])
    assert parse_pattern("preset('bigbird-itc')")[0] == sa.preset("bigbird-itc")
    assert parse_pattern("dilated-longformer") == (sa.preset("dilated-longformer"), 12)
    with pytest.raises(UsageError, match="gives a int, not a Pattern"):
        parse_pattern("3")
    with pytest.raises(UsageError, match="unary minus applies to ints only"):
        parse_pattern("-Local(1)")
