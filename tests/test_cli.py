"""The sparse-attn command: every subcommand with tiny settings, and its errors.

Most tests call ``cli.main`` in this process (fast); a few run ``python -m sparse_attn`` in a
subprocess, where what is imported and the whole command line matter.
"""
import argparse
import json
import os
import subprocess
import sys

import pytest

import sparse_attn as sa
from sparse_attn import bench, cli, expression
from sparse_attn.bench import harness
from sparse_attn.expression import parse_pattern


def run(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "sparse_attn", *args], capture_output=True, text=True,
                          timeout=timeout)


def call(capsys, *args):
    """(exit status, stdout, stderr) of ``sparse-attn ARGS`` run in this process."""
    try:
        code = cli.main(list(args))
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fake_point(point):
    """Stands in for ``harness.run_point``: an instant 'ok' point, so bench tests run no child process."""
    return {"status": "ok", "time_s": 0.01, "times_s": [0.01], "first_call_s": 0.01, "measured": "calls after the "
            "warm-up", "memory_mb": point["n"] / 1024, "process_peak_mb": 100.0, "wall_s": 0.1}


# ------------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------------
def test_info_lists_versions_devices_and_backends():
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    for word in ("Python", "torch", "numba", "triton", "transformers", "devices:", "cpu", "backends:",
                 "reference    available", "triton"):
        assert word in proc.stdout


def test_patterns_lists_every_preset_with_densities(capsys):
    code, out, _ = call(capsys, "patterns")
    assert code == 0
    lines = out.splitlines()
    for name in sa.list_presets():
        line = next(line for line in lines if line.startswith(name + " "))
        heads = parse_pattern(name)[1] or 1
        expected = [f"{sa.preset(name).layout(n, heads=heads).density:.2%}" for n in (4096, 16384)]
        assert line.split()[1:3] == expected, line


def test_show_prints_the_layout_and_writes_a_figure(capsys, tmp_path):
    out = tmp_path / "figures" / "fig.png"                            # its directory is created
    code, stdout, err = call(capsys, "show", "Local(64) | Global(first=2)", "--seq-len", "512", "--heads", "0,1",
                             "--out", str(out))
    assert code == 0, err
    assert "token density" in stdout and "of dense" in stdout
    grid = ["#+++++++",                                               # the ASCII grid of head 0 (heads shared):
            "+#+.....",                                               # '#' full, '+' partial, '.' skipped
            "++#+....",
            "+.+#+...",
            "+..+#+..",
            "+...+#+.",
            "+....+#+",
            "+.....+#"]
    lines = [line.strip() for line in stdout.splitlines()]
    start = lines.index(grid[0])
    assert lines[start:start + len(grid)] == grid
    assert "68 computed (53.1%), 16 full, 52 partial" in stdout
    assert "= 53.12% of dense" in stdout                              # 68 of 2 heads x 64 blocks
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_says_each_number_once(capsys):
    """The block count is in the layout's summary; show does not print it a second time."""
    code, stdout, _ = call(capsys, "show", "Local(64)", "--seq-len", "512")
    assert code == 0
    assert stdout.count("computed") == 1 and "nnz blocks" not in stdout


def test_show_takes_toml_files(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    sa.save_pattern(sa.PerHead([sa.Local(8), sa.Causal()]), path, description="two heads", heads=2)
    code, stdout, err = call(capsys, "show", str(path), "--seq-len", "64")
    assert code == 0, err
    assert "BlockLayout of PerHead" in stdout and "heads 2 (per head)" in stdout
    assert parse_pattern("bigbird-itc")[0] == sa.preset("bigbird-itc")


def test_show_per_head_expression_takes_its_heads_from_the_list(capsys):
    """docs/cli.md's PerHead example runs as written: --num-heads defaults to the PerHead's length."""
    code, stdout, err = call(capsys, "show", "PerHead([Local(256), Dilated(128, 2)])", "--seq-len", "4096")
    assert code == 0, err
    assert "heads 2 (per head)" in stdout
    code, _, err = call(capsys, "show", "PerHead([Local(256), Dilated(128, 2)])", "--seq-len", "4096",
                        "--num-heads", "3")
    assert code == 2 and "PerHead has 2 patterns but heads=3" in err


def test_long_expressions_are_parsed_not_looked_up_as_files(capsys):
    """An expression of 300+ characters once failed with 'File name too long' (a file check first)."""
    expression = " | ".join(f"Local({i})" for i in range(40))
    assert len(expression) > 300
    code, stdout, err = call(capsys, "show", expression, "--seq-len", "128")
    assert code == 0, err
    assert "BlockLayout of Local(0) | Local(1)" in stdout


def grid_rows(stdout: str, head: int = 0) -> list[str]:
    """The rows of the text block grid that ``show`` printed (the lines after its 'head 0' header)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(f"head {head} (")
                 or line.strip().startswith(f"head {head},")) + 1
    return [line.strip() for line in lines[start:] if set(line.strip()) <= set("#+.") and line.strip()]


def test_show_has_a_default_length_that_shows_a_global_token(capsys):
    """Issue 23, finding 15: --seq-len was required; the default shows every block, the global row and column."""
    code, stdout, err = call(capsys, "show", "longformer()")
    assert code == 0, err
    assert "tokens 4096 x 4096" in stdout
    rows = grid_rows(stdout)
    assert len(rows) == 64 and stdout.count("head 0") == 1
    assert ("." not in rows[0]) and all(row[0] != "." for row in rows)            # token 0: a global row and column
    assert rows[-1].startswith("+") and rows[-1][1:].count(".") > 50                 # not all lit


def test_show_bins_the_text_grid_of_long_sequences_keeping_globals_lit(capsys):
    """Past 64 blocks the layout prints no grid; show prints one binned to 64 cells, a cell lit when any of its
    blocks is computed, so token 0's row and column stay visible."""
    code, stdout, err = call(capsys, "show", "longformer()", "--seq-len", "64k")
    assert code == 0, err
    assert stdout.count("head 0") == 1 and "16 x 16 blocks a cell" in stdout
    rows = grid_rows(stdout)
    assert len(rows) == 64 and all(len(row) == 64 for row in rows)
    assert "." not in rows[0] and all(row[0] != "." for row in rows)
    assert rows[32][32] == "#" and rows[32][48] == "."


def test_show_draws_the_head_asked_for_and_says_which_where_heads_differ(capsys):
    """bigbird-itc (random blocks drawn per head) showed head 0 with no word that the other heads differ."""
    code, stdout, err = call(capsys, "show", "bigbird-itc", "--num-heads", "12", "--head", "5")
    assert code == 0, err
    layout = sa.preset("bigbird-itc").layout(4096, heads=12)
    expected = {h: ["".join(".+#"[state] for state in row) for row in layout.block_grid(0, h)] for h in (0, 5)}
    assert grid_rows(stdout, head=5) == expected[5] != expected[0]
    assert stdout.splitlines()[4:6] == ["  head 5 ('#' full, '+' partial, '.' skipped):", "  " + expected[5][0]]
    assert "\n  head 5 of 12 drawn; the heads differ: --head 0..11 draws another\n" in stdout
    code, stdout, err = call(capsys, "show", "bigbird-itc")                 # the preset declares no heads
    assert code == 0, err
    assert "\n  head 0 of 1 drawn; the pattern's heads differ: --head h draws head h (of --num-heads H)\n" in stdout
    code, stdout, err = call(capsys, "show", "dilated-longformer", "--seq-len", "64k", "--head", "11")   # binned
    assert code == 0, err
    assert "\n  head 11, 16 x 16 blocks a cell" in stdout and "head 11 of 12 drawn" in stdout
    assert len(grid_rows(stdout, head=11)) == 64
    code, stdout, err = call(capsys, "show", "longformer()", "--num-heads", "4", "--head", "3")   # heads alike
    assert code == 0, err
    assert "  head 3 ('#' full" in stdout and "drawn" not in stdout


def test_show_and_bench_read_pattern_text_alike(capsys, monkeypatch, tmp_path):
    """Finding 15: `show longformer` was refused while `bench --patterns longformer` ran it; one reader now."""
    monkeypatch.setattr(harness, "run_point", fake_point)
    for label, text in bench.PATTERNS.items():
        code, stdout, err = call(capsys, "show", label, "--seq-len", "1k")
        assert code == 0, err
        assert stdout.startswith(f"BlockLayout of {parse_pattern(text)[0]!r}")
        code, _, err = call(capsys, "bench", "--patterns", label, "--lengths", "256", "--backends", "sdpa-dense",
                            "--no-progress", "--out", str(tmp_path / label))
        results = json.loads((tmp_path / label / "results.json").read_text())
        assert code == 0 and results["patterns"] == {label: repr(parse_pattern(text)[0])}, err
    assert cli.read_pattern("longformer") == (parse_pattern(bench.PATTERNS["longformer"])[0], None)


def test_show_and_bench_close_the_figures_they_write(capsys, monkeypatch, tmp_path):
    """cli.main in a process (a notebook, these tests) left every figure open in pyplot."""
    plt = pytest.importorskip("matplotlib.pyplot")
    monkeypatch.setattr(harness, "run_point", fake_point)
    before = plt.get_fignums()
    assert call(capsys, "show", "Local(4)", "--seq-len", "256", "--out", str(tmp_path / "fig.png"))[0] == 0
    assert call(capsys, "bench", "--lengths", "256", "--backends", "sdpa-dense", "--patterns", "longformer",
                "--no-progress", "--out", str(tmp_path / "bench"))[0] == 0
    assert plt.get_fignums() == before


def test_show_zoom_is_bounded_before_any_work(capsys, tmp_path):
    code, _, err = call(capsys, "show", "Local(4)", "--seq-len", "64k", "--zoom", "16k", "--out",
                        str(tmp_path / "fig.png"))
    assert code == 2 and "--zoom 16,384: the zoom draws at most 8,192 tokens" in err
    assert not (tmp_path / "fig.png").exists()


@pytest.mark.parametrize("args", [["show", "longformer()"], ["patterns"]])
def test_a_reader_that_stops_early_ends_the_command_quietly(args):
    """Finding 15: `sparse-attn show ... | head` printed a BrokenPipeError traceback. Here stdout is a pipe whose
    reader has already left, so the first write fails; the command stops quietly with 128 + SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "sparse_attn", *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=240)
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141


# ------------------------------------------------------------------------------------------------
# bench
# ------------------------------------------------------------------------------------------------
def test_bench_writes_json_markdown_and_plots(tmp_path):
    out = tmp_path / "bench"
    proc = run("bench", "--lengths", "256", "512", "--patterns", "longformer", "--backends", "sparse_attn-reference",
               "sdpa-dense", "--repeats", "1", "--out", str(out), "--no-progress", "--device", "cpu")
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


def test_bench_fails_when_the_library_measured_nothing(capsys, monkeypatch, tmp_path):
    """The command exited 0 with the table and plots showing only SDPA when every numba point timed out: now it
    writes what it measured and exits 1 naming why the library's line is empty."""
    def timed_out_numba(point):
        if point["implementation"] == "sparse_attn-numba" and point["timeout"] is not None:
            return {"status": "timeout", "error": "did not finish within the 60 s limit", "wall_s": 60.0}
        return fake_point(point)

    monkeypatch.setattr(harness, "run_point", timed_out_numba)
    code, out, err = call(capsys, "bench", "--quick", "--no-progress", "--out", str(tmp_path / "bench"))
    assert code == 1 and "wrote" in out
    assert ("sparse-attn: error: no measurement of this library's kernels for longformer: sparse_attn-numba: "
            "timeout at N=1024: did not finish within the 60 s limit") in err


@pytest.mark.slow
def test_bench_quick_measures_the_library_from_a_cold_kernel_cache(tmp_path):
    """A fresh install (an empty kernel cache) and points shorter than the cold compile: the sweep compiles first,
    so every numba point is measured."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "sparse_attn", "bench", "--quick", "--lengths", "256", "512",
                           "--backends", "sparse_attn-numba", "--timeout", "20", "--no-progress", "--out",
                           str(tmp_path / "bench")], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    points = json.loads((tmp_path / "bench" / "results.json").read_text())["points"]
    assert [(p["n"], p["status"]) for p in points] == [(256, "ok"), (512, "ok")]


def test_bench_refuses_to_overwrite_results_unless_asked(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "run_point", fake_point)
    args = ["bench", "--lengths", "256", "--patterns", "longformer", "--backends", "sdpa-dense", "--no-progress",
            "--out", str(tmp_path)]
    assert call(capsys, *args)[0] == 0
    first = (tmp_path / "results.json").read_text()
    code, _, err = call(capsys, *args)
    assert code == 2 and "already holds results.json; pass --overwrite to replace it" in err
    assert "or no --out (a fresh bench-results-N folder)" in err
    assert (tmp_path / "results.json").read_text() == first
    assert call(capsys, *args, "--overwrite")[0] == 0


def test_bench_without_out_writes_a_fresh_folder_each_run(capsys, monkeypatch, tmp_path):
    """Finding 15: re-running README's main job exited 2 because bench-results/ held the first run's results.
    Without --out every run gets its own folder and the earlier runs stay."""
    monkeypatch.setattr(harness, "run_point", fake_point)
    monkeypatch.chdir(tmp_path)
    args = ["bench", "--quick", "--lengths", "256", "--no-progress"]
    for folder in ("bench-results", "bench-results-2", "bench-results-3"):
        code, stdout, err = call(capsys, *args)
        assert code == 0, err
        assert f"wrote {folder}/results.json" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-results", "bench-results-2", "bench-results-3"]
    code, stdout, _ = call(capsys, *args, "--overwrite")                 # --overwrite: the default folder, replaced
    assert code == 0 and "wrote bench-results/results.json" in stdout and not (tmp_path / "bench-results-4").exists()


def test_bench_checks_its_output_before_running_any_point(capsys, monkeypatch, tmp_path):
    def no_point(point):
        raise AssertionError("a point ran before the arguments were checked")

    monkeypatch.setattr(harness, "run_point", no_point)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, message in [(blocker, "is a file; bench writes a directory"),
                         (blocker / "sub", "cannot create the directory")]:
        code, _, err = call(capsys, "bench", "--lengths", "256", "--backends", "sdpa-dense", "--out", str(out))
        assert code == 2 and message in err and "Traceback" not in err


def test_bench_reports_unavailable_implementations_up_front(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "run_point", fake_point)
    code, out, err = call(capsys, "bench", "--lengths", "1k", "2k", "--patterns", "bigbird-itc", "--backends",
                          "sdpa-dense", "hf-longformer", "--no-progress", "--out", str(tmp_path))
    assert code == 0, err
    reason = bench.availability("hf-longformer", sa.preset("bigbird-itc"), "cpu")[1]
    assert reason and out.splitlines()[0] == f"n/a: hf-longformer on bigbird-itc: {reason}"   # before the run
    assert "| hf-longformer | n/a [1] | n/a [1] |" in out                                     # and after it
    assert f"- [1] `hf-longformer` n/a: {reason}" in out
    markdown = (tmp_path / "results.md").read_text()
    assert f"- [1] `hf-longformer` n/a: {reason}" in markdown
    assert markdown.count("Cells: time (s) / memory (MB)") == 1


def test_the_recorded_command_line_can_be_pasted_back():
    line = cli._command_line(["bench", "--patterns", "Local(1) | Dense()", "--out", "out\udcff"])
    assert line == "sparse-attn bench --patterns 'Local(1) | Dense()' --out 'out\\udcff'"
    line.encode("utf-8")                                               # results.md can be written


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_bench_device_cuda_without_a_gpu_is_refused(capsys, tmp_path):
    code, _, err = call(capsys, "bench", "--device", "cuda", "--lengths", "256", "--out", str(tmp_path / "o"))
    assert code == 2 and "--device cuda: torch" in err and "sees no CUDA GPU" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def test_sizes_take_k_and_m_suffixes_for_every_size_option():
    parser = cli.build_parser()
    assert parser.parse_args(["show", "x", "--seq-len", "1M"]).seq_len == 2 ** 20
    args = parser.parse_args(["show", "x", "--seq-len", "4k", "--zoom", "1K", "--block-size", "64",
                              "--num-heads", "16_384", "--head-dim", "1,024"])
    assert (args.seq_len, args.zoom, args.num_heads, args.head_dim) == (4096, 1024, 16384, 1024)
    args = parser.parse_args(["bench", "--lengths", "1k", "64K", "1m", "--batch", "2", "--num-heads", "4"])
    assert args.lengths == [1024, 65536, 2 ** 20]
    for text in ("1e3", "0", "-1", "", "k", "1.5k", "4G", "\u0661\u0662"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
            cli._count(text)


def test_every_option_says_what_it_does_and_its_default():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help"
            if action.option_strings and not action.required:
                assert "default" in action.help, f"{name} {action.option_strings[0]}: {action.help!r}"
    patterns_help = next(a.help for a in subparsers.choices["bench"]._actions if a.dest == "patterns")
    assert f"(default: {' '.join(bench.PATTERNS)})" in patterns_help
    for label in bench.PATTERNS:                                        # the defaults are in the list it gives
        assert label in patterns_help.split("(default")[0]


def test_help_imports_neither_torch_nor_matplotlib():
    code = ("import sys\nfrom sparse_attn.cli import main\n"
            "for argv in (['--help'], ['show', '--help'], ['bench', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib', 'numba', 'tqdm'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"
    assert run("--help", timeout=60).returncode == 0


def test_mistyped_preset_names_get_a_suggestion(capsys):
    code, _, err = call(capsys, "show", "bigbird-itx", "--seq-len", "64")
    assert code == 2
    assert "no preset named 'bigbird-itx'; did you mean bigbird-itc?" in err
    code, _, err = call(capsys, "bench", "--patterns", "longformr", "--lengths", "256")
    assert code == 2 and "no preset named 'longformr'; did you mean longformer?" in err


def test_huge_pattern_arguments_never_print_a_traceback(capsys):
    """pattern.py may clamp or reject values past int64; either way the CLI prints no traceback."""
    code, out, err = call(capsys, "show", "Local(9223372036854775808)", "--seq-len", "64")
    assert (code == 0 and "token density" in out) or (code == 2 and err.startswith("sparse-attn: error: "))


@pytest.mark.parametrize("error", [OverflowError("Python int too large to convert to C long"),
                                   MemoryError("Unable to allocate 111. PiB")])
def test_layouts_too_large_to_build_are_usage_errors(capsys, monkeypatch, error):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(sa.Pattern, "layout", fail)
    code, _, err = call(capsys, "show", "Local(4)", "--seq-len", "1M")
    assert code == 2
    assert err.startswith("sparse-attn: error: the layout of --seq-len 1,048,576 with 1 heads") and str(error) in err


def test_overflow_in_a_constructor_is_a_usage_error(capsys, monkeypatch):
    def overflow(*args):
        raise OverflowError("cannot fit 'int' into an index-sized integer")

    monkeypatch.setitem(expression.CONSTRUCTORS, "Local", overflow)
    code, _, err = call(capsys, "show", "Local(10)", "--seq-len", "64")
    assert code == 2 and "pattern expression 'Local(10)': cannot fit 'int'" in err


def test_interrupt_exits_130_without_a_traceback(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_patterns", interrupted)
    assert call(capsys, "patterns") == (130, "", "sparse-attn: interrupted\n")


def _bad_toml_files(tmp_path):
    files = {"wrong-type.toml": '[pattern]\ntype = "local"\nbefore = "x"\n',
             "missing-field.toml": '[pattern]\ntype = "local"\n',
             "no-table.toml": "pattern = 3\n",
             "members.toml": '[pattern]\ntype = "union"\npatterns = 5\n',
             "heads.toml": 'heads = "x"\n[pattern]\ntype = "local"\nbefore = 1\n',
             "zero-heads.toml": 'heads = 0\n[pattern]\ntype = "local"\nbefore = 1\n',
             "unknown.toml": '[pattern]\ntype = "axial"\n',
             "empty.toml": ""}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "directory.toml").mkdir()
    return sorted(str(p) for p in tmp_path.iterdir())


def test_bad_toml_files_are_usage_errors_that_name_the_file(capsys, tmp_path):
    for path in _bad_toml_files(tmp_path):
        code, _, err = call(capsys, "show", path, "--seq-len", "64")
        assert code == 2 and err.startswith("sparse-attn: error: ") and path in err, (path, err)


_PATTERNS_TOO_DEEP = "(" * 300 + "Local(1)" + ")" * 300


@pytest.mark.parametrize("args, message", [
    (["show", "Local(64) | __import__('os')", "--seq-len", "64"], "'__import__' is not a pattern constructor"),
    (["show", "Local(64).__class__", "--seq-len", "64"], "is not allowed"),
    (["show", "Local(", "--seq-len", "64"], "is not a preset"),
    (["show", "", "--seq-len", "64"], "is not a preset"),
    (["show", _PATTERNS_TOO_DEEP, "--seq-len", "64"], "too many nested parentheses"),
    (["show", "Local(-1)", "--seq-len", "64"], "Local before must be >= 0, got -1"),
    (["show", "Lòcal(1)", "--seq-len", "64"], "'Lòcal' is not a pattern constructor"),
    (["show", "Local(1)\udcff", "--seq-len", "64"], "is not valid UTF-8 text"),      # the byte 0xff in argv
    (["show", "bigbird", "--seq-len", "64"], "bigbird must be called"),
    (["show", "../x", "--seq-len", "64"], "no pattern file at ../x"),
    (["show", "a" * 300 + ".toml", "--seq-len", "64"], "File name too long"),
    (["show", "Local(4)", "--seq-len", "0"], "expected a positive integer"),
    (["show", "Local(4)", "--seq-len", "10**18"], "expected a positive integer"),
    (["show", "Local(4)", "--seq-len", str(10 ** 30)], "n_q must be"),
    (["show", "Local(4)", "--seq-len", "64", "--heads", "a"], "expected comma-separated head indices"),
    (["show", "Local(4)", "--seq-len", "64", "--heads", "-1"], "expected head indices >= 0"),
    (["show", "Local(4)", "--seq-len", "64", "--heads", "4", "--num-heads", "2"], "needs head indices below"),
    (["show", "dilated-longformer", "--seq-len", "64", "--heads", "12"], "below the pattern's 12 heads"),
    (["show", "dilated-longformer", "--seq-len", "64", "--head", "12"],
     "--head 12 needs a head index below the pattern's 12 heads; pass --num-heads"),
    (["show", "Local(4)", "--seq-len", "64", "--head", "0,1"],
     "argument --head: expected one head index such as 0 or 3, got '0,1' (--heads takes several, for the figure)"),
    (["show", "Local(4)", "--seq-len", "64", "--head", "-1"], "expected head indices >= 0"),
    (["show", "Local(4)", "--seq-len", "64", "--heads", ",".join(map(str, range(17))), "--out", "x.png"],
     "a figure draws at most 16 heads, got 17"),
    (["show", "missing.toml", "--seq-len", "64"], "no pattern file at missing.toml"),
    (["show", "Local(4)", "--seq-len", "64", "--out", "fig.xyz"], "expected a file name ending in a figure format"),
    (["show", "Local(4)", "--seq-len", "64", "--out", "fig"], "expected a file name ending in a figure format"),
    (["bench", "--backends", "cuda-magic"], "unknown --backends cuda-magic"),
    (["bench", "--patterns", "longformerr"], "no preset named 'longformerr'; did you mean longformer?"),
    (["bench", "--patterns", "Local(1) -"], "is not a preset"),
    (["bench", "--lengths", "-5"], "expected a positive integer"),
    (["bench", "--timeout", "inf"], "expected a finite number > 0 and <= 1,000,000"),
    (["bench", "--timeout", "nan"], "expected a finite number"),
    (["bench", "--timeout", "1e7"], "expected a finite number > 0 and <= 1,000,000"),
    (["bench", "--timeout", "0"], "expected a finite number"),
    (["bench", "--memory-limit-gb", "inf"], "expected a finite number > 0 and <= 1,000,000"),
    (["bench", "--memory-limit-gb", "-1"], "expected a finite number"),
    (["bench", "--patterns", "dilated-longformer", "--lengths", "256", "--no-progress"],
     "pattern 'dilated-longformer' does not fit --num-heads 8: PerHead has 12 patterns but heads=8"),
    (["bench", "--patterns", "dilated-longformer", "--lengths", "256", "--no-progress"], "pass --num-heads 12"),
    (["bench", "--patterns", "PerHead([Local(1), Dense()])", "--lengths", "256"], "pass --num-heads 2"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_exit_2_with_a_message(capsys, monkeypatch, tmp_path, args, message):
    monkeypatch.chdir(tmp_path)                                       # bench writes nothing where the tests run
    code, _, err = call(capsys, *args)
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_bad_arguments_print_no_traceback_end_to_end():
    proc = run("show", "bigbird-itx", "--seq-len", "64", timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("sparse-attn: error: no preset named 'bigbird-itx'") and "Traceback" not in proc.stderr
