"""The benchmark harness: settings, the peers (and that the CLI and every script run the same ones), the
implementations, running a point in a fresh process, the sweep and its tables, results files and --resume (the
command is in test_cli)."""
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch

import sparse_attn as sa
from sparse_attn import bench
from sparse_attn.bench import harness, implementations, peers, results

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    """benchmarks/NAME.py as a module (not run)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flex_has_cpu_backward() -> bool:
    """The fact the benchmark relies on, checked directly: a tiny eager call with requires_grad."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.zeros(1, 1, 16, 16, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                                 # "eager flex_attention is slow"
            flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True


def test_flex_backward_on_cpu_is_na_up_front():
    ok, reason = bench.availability("flex", sa.Local(1), "cpu", backward=True)
    if _flex_has_cpu_backward():
        assert ok
        return
    assert not ok and "does not support backward on CPU" in reason
    assert bench.availability("flex", sa.Local(1), "cpu") == (True, "")         # forward runs
    results = bench.sweep({"p": sa.Local(1)}, [128, 256], ["flex"], backward=True, progress=False)
    assert [p["status"] for p in results["points"]] == ["unavailable", "unavailable"]
    assert "wall_s" not in results["points"][0]                                # no child process ran


def test_bench_records_timeouts_and_keeps_going():
    results = bench.sweep({"p": sa.Local(1)}, [128, 256], ["sdpa-dense"], timeout=0.5, progress=False)
    statuses = {(p["implementation"], p["n"]): p["status"] for p in results["points"]}
    assert statuses[("sdpa-dense", 128)] == "timeout" and statuses[("sdpa-dense", 256)] == "skipped"


def test_dense_sdpa_runs_once_per_length_not_once_per_pattern(monkeypatch):
    """Issue 23, finding 15: the pattern-independent dense baseline ran once per pattern (~90 of 308 s)."""
    ran = []

    def fake_point(point):
        ran.append((point["pattern_label"], point["implementation"], point["n"]))
        status = "timeout" if point["implementation"] == "sdpa-dense" and point["n"] == 512 else "ok"
        return {"status": status, "time_s": point["n"] / 1e4, "memory_mb": 1.0}

    monkeypatch.setattr(harness, "run_point", fake_point)
    patterns = {"a": sa.Local(1), "b": sa.Local(2)}
    results = bench.sweep(patterns, [256, 512, 1024], ["sdpa-dense", "sdpa-masked"], progress=False)
    assert [r for r in ran if r[1] == "sdpa-dense"] == [("a", "sdpa-dense", 256), ("a", "sdpa-dense", 512)]
    assert [r for r in ran if r[1] == "sdpa-masked"] == [(p, "sdpa-masked", n) for p in "ab" for n in (256, 512, 1024)]
    dense = {(p["pattern_label"], p["n"]): p for p in results["points"] if p["implementation"] == "sdpa-dense"}
    assert dense[("b", 256)] == {**dense[("a", 256)], "pattern_label": "b", "same_as": "a"}
    assert [dense[("b", n)]["status"] for n in (256, 512, 1024)] == ["ok", "timeout", "skipped"]
    text = bench.tables(results)
    assert text.count("`sdpa-dense` does not read the pattern: its row is the one measured under a.") == 1


def test_the_sweep_compiles_the_librarys_kernels_first_without_a_time_limit(monkeypatch):
    """A --quick point's 60 s once had to hold the child's cold Numba compile: on a loaded machine numba timed out
    at 1K, the rest of its line was skipped and the table showed only SDPA. Now a warm-up point (N = 256, no time
    limit) compiles and caches the kernels before the sweep; implementations that cache nothing get none."""
    ran = []

    def fake_point(point):
        ran.append((point["implementation"], point["n"], point["timeout"]))
        return {"status": "ok", "time_s": 0.01, "memory_mb": 1.0, "wall_s": 0.1}

    monkeypatch.setattr(harness, "run_point", fake_point)
    bench.sweep({"a": sa.Local(1), "b": sa.Local(2)}, [512], ["sdpa-dense", "sparse_attn-numba"], timeout=60,
                progress=False)
    assert ran[0] == ("sparse_attn-numba", 256, None)
    assert ran[1:] == [("sdpa-dense", 512, 60), ("sparse_attn-numba", 512, 60), ("sparse_attn-numba", 512, 60)]


def test_a_failed_warm_up_makes_the_implementation_unavailable_with_its_error(monkeypatch):
    monkeypatch.setattr(harness, "run_point", lambda point: {"status": "error", "error": "Segmentation fault",
                                                             "wall_s": 1.0})
    results = bench.sweep({"a": sa.Local(1)}, [512, 1024], ["sparse_attn-numba"], progress=False)
    assert [p["status"] for p in results["points"]] == ["unavailable", "unavailable"]
    assert results["points"][0]["error"] == "its warm-up before the sweep failed: Segmentation fault"
    assert bench.own_lines_missing(results) == [
        "a: sparse_attn-numba: unavailable at N=512: its warm-up before the sweep failed: Segmentation fault"]


def test_own_lines_missing_names_each_pattern_without_a_measured_library_point():
    def point(label, name, n, status):
        return {"pattern_label": label, "implementation": name, "n": n, "status": status, "error": f"{status} why"}

    points = [point("a", "sparse_attn-numba", 1024, "timeout"), point("a", "sparse_attn-numba", 2048, "skipped"),
              point("a", "sdpa-dense", 1024, "ok"), point("b", "sparse_attn-numba", 1024, "ok")]
    assert bench.own_lines_missing({"points": points}) == ["a: sparse_attn-numba: timeout at N=1024: timeout why"]
    assert bench.own_lines_missing({"points": points[2:]}) == []
    assert bench.own_lines_missing({"points": [point("a", "sdpa-dense", 1024, "timeout")]}) == []


def test_tables_show_how_memory_and_time_grow():
    """Finding 16: the table says at a glance which memory is O(N) and which O(N^2)."""
    points = [{"pattern_label": "p", "implementation": name, "n": n, "status": "ok", "time_s": n ** t / 1e6,
               "memory_mb": n ** m / 1e3} for name, m, t in (("linear", 1, 2), ("square", 2, 1)) for n in (1024, 4096)]
    points += [{"pattern_label": "p", "implementation": "once", "n": 1024, "status": "ok", "time_s": 1.0,
                "memory_mb": 1.0}, {"pattern_label": "p", "implementation": "once", "n": 4096, "status": "oom"}]
    text = bench.tables({"patterns": {"p": "Local(1)"}, "implementations": {"linear": "", "square": "", "once": ""},
                         "points": points})
    assert "| implementation | 1,024 | 4,096 | memory grows as | time grows as |" in text
    assert "| N^1.0 | N^2.0 |" in text.splitlines()[4] and "| N^2.0 | N^1.0 |" in text.splitlines()[5]
    assert text.splitlines()[6].endswith("| oom [1] |  |  |")                  # one point: no growth to show


@pytest.mark.parametrize("run", ["bench", "quick"])
def test_committed_bench_tables_are_rendered_from_the_committed_json(run):
    """README's main-job numbers come from these files; the tables (growth columns included) are the JSON's."""
    folder = BENCHMARKS / "results" / run
    assert bench.markdown(json.loads((folder / "results.json").read_text())) == (folder / "results.md").read_text()


def test_bench_availability():
    assert peers.longformer_window(sa.Local(256) | sa.Global(first=16)) == (256, sa.Global(first=16))
    assert peers.longformer_window(sa.Local(1)) == (1, None)
    assert peers.longformer_window(sa.preset("bigbird-itc")) is None
    assert peers.longformer_window(sa.Local(4, 2)) is None                           # HF windows are symmetric
    assert bench.availability("hf-longformer", sa.preset("bigbird-itc"), "cpu")[0] is False
    assert bench.availability("sparse_attn-numba", sa.Local(1), "cuda") == (False, "numba runs CPU tensors only")
    assert bench.availability("sparse_attn-triton", sa.Local(1), "cpu")[0] is False
    assert bench.availability("sdpa-dense", sa.Local(1), "cpu") == (True, "")


def test_tables_put_each_reason_once_under_its_table():
    results = {"patterns": {"a": "Local(1)", "b": "Local(2)"}, "implementations": {"x": "", "y": ""},
               "points": [{"pattern_label": label, "implementation": "x", "n": n, "status": "ok", "time_s": 0.5,
                           "memory_mb": 3.0} for label in "ab" for n in (1, 2)]
               + [{"pattern_label": "a", "implementation": "y", "n": 1, "status": "oom", "error": "no memory"},
                  {"pattern_label": "a", "implementation": "y", "n": 2, "status": "skipped", "error": "oom at N=1"},
                  {"pattern_label": "b", "implementation": "y", "n": 1, "status": "error", "error": "boom"},
                  {"pattern_label": "b", "implementation": "y", "n": 2, "status": "error", "error": "boom"}]}
    text = bench.tables(results)
    assert "| y | oom [1] | - |" in text and "- [1] `y` oom: no memory" in text
    assert "| y | error [1] | error [1] |" in text and text.count("`y` error: boom") == 1
    assert text.count("Cells: time (s)") == 1


def test_settings_take_what_is_given_and_the_rest_from_quick_or_default():
    assert bench.settings() == bench.DEFAULT and bench.settings(quick=True) == bench.QUICK
    assert bench.DEFAULT.patterns == tuple(bench.PATTERNS)
    chosen = bench.settings(quick=True, patterns=["bigbird-itc"], lengths=[4096, 1024, 4096], implementations=["flex"],
                            repeats=None, timeout=5.0)
    assert chosen == bench.Settings(patterns=("bigbird-itc",), lengths=(1024, 4096), implementations=("flex",),
                                    repeats=bench.QUICK.repeats, timeout=5.0)
    assert bench.settings(repeats=7).lengths == bench.DEFAULT.lengths


# ------------------------------------------------------------------------------------------------
# The peers, and that the CLI and the scripts run the same ones
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def recompile_limit_restored():
    """Dynamo's recompile_limit as it was, after the test (cpu_kernels raises it). torch's config.patch, not
    monkeypatch: pytest 9.2's monkeypatch deletes a torch config entry on undo, and every later compile fails."""
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        yield


def test_the_cli_and_every_script_run_the_peers_of_one_module(monkeypatch, recompile_limit_restored):
    """sparse-attn bench (implementations.setup), cpu_kernels.py, gpu_kernels.py and documents.py build their
    sparse_attn, FlexAttention, dense and masked SDPA calls with sparse_attn.bench.peers, with their options."""
    cpu_kernels, gpu_kernels, documents = script("cpu_kernels"), script("gpu_kernels"), script("documents")
    built = []

    def recorder(name):
        def build(*args, **options):
            built.append((name, options))
            return lambda: None
        return build

    for name in ("sparse_attn", "flex", "sdpa", "masked_sdpa"):
        monkeypatch.setattr(peers, name, recorder(name))
    pattern = sa.Local(16) | sa.Global(first=2)
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))                    # (B, H, N, D)
    layout = pattern.layout(128, heads=2, block_size=64)

    def cli(name):
        implementations.setup(name, pattern, q, k, v, 64)

    def cpu(name):
        cpu_kernels._runner(name, 128, pattern)

    def gpu(name, causal=False):
        gpu_kernels.make_runner(name, q, k, v, layout, causal)

    for run, expected in [
            (lambda: cli("flex"), ("flex", {"fresh": False})),
            (lambda: cpu("flex-64"), ("flex", {"fresh": False})),
            (lambda: cpu("flex-128-bf16"), ("flex", {"fresh": False})),
            (lambda: gpu("flex-64"), ("flex", {"mode": None, "kernel_options": peers.FLEX_TILES[64]})),
            (lambda: gpu("flex-128-max"), ("flex", {"mode": peers.AUTOTUNE, "kernel_options": None})),
            (lambda: cli("sparse_attn-numba"), ("sparse_attn", {"backend": "numba"})),
            (lambda: cpu("numba"), ("sparse_attn", {"backend": "numba"})),
            (lambda: cpu("reference"), ("sparse_attn", {"backend": "reference"})),
            (lambda: gpu("triton"), ("sparse_attn", {"backend": "triton"})),
            (lambda: documents._calls(q, k, v, layout), ("sparse_attn", {"backend": "numba"})),
            (lambda: cli("sdpa-dense"), ("sdpa", {})),
            (lambda: cpu("sdpa-dense"), ("sdpa", {})),
            (lambda: gpu("sdpa", causal=True), ("sdpa", {"causal": True, "flash": True})),
            (lambda: cli("sdpa-masked"), ("masked_sdpa", {})),
            (lambda: gpu("masked-sdpa"), ("masked_sdpa", {}))]:
        built.clear()
        run()
        assert built == [expected]


def test_the_scripts_run_the_harness_of_one_module():
    """One subprocess runner, one writer, one --resume: the scripts take them from sparse_attn.bench."""
    cpu_kernels, documents, decode = script("cpu_kernels"), script("documents"), script("decode")
    layout_build, gpu_kernels = script("layout_build"), script("gpu_kernels")
    for module in (cpu_kernels, documents, decode, layout_build):
        assert module.run_json is harness.run_json and module.write_results is results.write_results
    assert gpu_kernels.write_results is results.write_results and gpu_kernels.resumed_rows is results.resumed_rows
    assert gpu_kernels.cuda_usable is harness.cuda_usable


COMMITTED_TABLES = [path.relative_to(BENCHMARKS / "results") for name in ("cpu_kernels", "layout_build", "cpu_matmuls")
                    for path in sorted((BENCHMARKS / "results").rglob(f"{name}.json"))]


@pytest.mark.parametrize("path", COMMITTED_TABLES, ids=str)
def test_committed_table_is_rendered_from_the_committed_json(path):
    """Every committed run of these scripts, in results/ and the folders of other machines and patterns."""
    record = json.loads((BENCHMARKS / "results" / path).read_text())
    assert script(path.stem).markdown(record) == (BENCHMARKS / "results" / path.with_suffix(".md")).read_text()


def test_every_kind_of_committed_table_is_checked():
    assert {path.stem for path in COMMITTED_TABLES} == {"cpu_kernels", "layout_build", "cpu_matmuls"}
    assert len(COMMITTED_TABLES) > 3


def test_cpu_matmuls_times_every_route_on_every_shape_and_checks_its_products():
    """OpenBLAS, MKL and torch's float32 brgemm each compute S = Q K^T and O += P V right, and OpenBLAS and MKL
    the backward's dQ += dS K (measure asserts it against numpy before timing), at every panel width; brgemm's S
    also at the padded leading dimension."""
    cpu_matmuls = script("cpu_matmuls")
    rows = cpu_matmuls.measure(repeats=1)
    routes = {(r["route"], r["product"], r["width"], r["ld_b"]) for r in rows}
    assert len(rows) == len(routes) == 3 * 2 * 3 + 3 + 2 * 3 and all(r["gflops"] > 0 for r in rows)
    assert ("mkl", "dQ += dS K", 1024, None) in routes
    assert ("brgemm", "S = Q K^T", 576, cpu_matmuls.N + 16) in routes


def test_peers_compute_the_patterns_attention():
    pattern = sa.Local(8) | sa.Global(first=2)
    q, k, v = (torch.randn(1, 2, 96, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))  # (B, H, N, D)
    layout = pattern.layout(96, heads=2, block_size=32)
    expected = sa.sparse_attention(q, k, v, layout, backend="reference")
    shared, expanded = peers.token_mask(layout, "cpu"), peers.token_mask(layout, "cpu", expand_heads=True)
    assert shared.shape == (1, 1, 96, 96) and expanded.shape == (1, 2, 96, 96)
    for mask in (shared, expanded):
        torch.testing.assert_close(peers.masked_sdpa(q, k, v, mask)(), expected)
    torch.testing.assert_close(peers.sdpa(q, k, v, causal=True)(), torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    forward, forward_backward = peers.passes(peers.sparse_attn(q, k, v, layout, backend="reference"), q, k, v)
    assert forward() is None and q.grad is None
    forward_backward()
    assert q.grad is k.grad is v.grad is None                                    # dropped: the next call starts alike


def test_flex_peer_compiles_static_and_whole_and_resets_only_when_fresh(monkeypatch):
    resets, options = [], []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    monkeypatch.setattr(torch, "compile", lambda fn, **given: options.append(given) or fn)
    peers.compiled_flex()
    peers.compiled_flex(peers.AUTOTUNE, fresh=False)
    assert resets == [True]
    assert options == [{"dynamic": False, "fullgraph": True, "mode": None},
                       {"dynamic": False, "fullgraph": True, "mode": peers.AUTOTUNE}]


def test_flex_peer_refuses_a_hand_built_layout():
    layout = sa.Local(8).layout(64, block_size=32)
    by_hand = sa.BlockLayout(pattern=layout.pattern, n_q=64, n_k=64, heads=1, block_size=32, causal=False,
                             **layout.index._asdict())
    q = torch.randn(1, 1, 64, 16)                                                # (B, H, N, D)
    with pytest.raises(ValueError, match="built by hand"):
        peers.flex(q, q, q, by_hand)


def test_hf_longformer_peer_runs_the_patterns_window():
    pytest.importorskip("transformers")
    q = torch.randn(1, 2, 128, 16)                                               # (B, H, N, D)
    out = peers.hf_longformer(sa.Local(16) | sa.Global(first=2), q)()
    assert out.shape == (1, 128, 32) and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------------------
# Running a point in a fresh process
# ------------------------------------------------------------------------------------------------
def test_run_json_sets_the_environment_and_limits_memory():
    code = "import os, json; print(json.dumps({'threads': os.environ['OMP_NUM_THREADS']}))"
    assert harness.run_json([sys.executable, "-c", code], 60, env={"OMP_NUM_THREADS": "1"}) == {"threads": "1"}
    grab = "import json; block = bytearray(3 * 2**30); print(json.dumps({'ok': True}))"
    result = harness.run_json([sys.executable, "-c", grab], 60, memory_gib=1)
    assert result["status"] == "oom" and result["error"].startswith("out of memory under the 1 GiB limit: ")
    crash = "import json, os; print(json.dumps({'ms': 1.0}), flush=True); os.abort()"
    assert harness.run_json([sys.executable, "-c", crash], 60) == {"ms": 1.0}   # died after its result: kept


def test_cuda_usable_is_false_once_an_error_broke_the_context(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "ones", lambda size, device: torch.full((size,), 1.0))
    assert harness.cuda_usable()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    assert not harness.cuda_usable()


# ------------------------------------------------------------------------------------------------
# Results files and --resume
# ------------------------------------------------------------------------------------------------
def test_write_results_replaces_each_file_whole(tmp_path):
    def markdown(record):
        return f"{len(record['rows'])} rows\n"

    def figure(record, path):
        path.write_bytes(b"png")

    assert results.write_results(tmp_path / "out", "demo", {"rows": [1]}, markdown, {"demo.png": figure}) == "1 rows\n"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["demo.json", "demo.md", "demo.png"]

    def killed(record, path):
        path.write_bytes(b"half a p")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        results.write_results(out, "demo", {"rows": [1, 2]}, markdown, {"demo.png": killed})
    assert json.loads((out / "demo.json").read_text()) == {"rows": [1, 2]} and (out / "demo.md").read_text() == "2 rows\n"
    assert (out / "demo.png").read_bytes() == b"png"                          # the previous figure, whole
    assert results.write_results(out, "demo", {"rows": []}, markdown) == "0 rows\n"      # no figure: the png stays
    assert sorted(p.name for p in out.iterdir()) == [".demo.partial.png", "demo.json", "demo.md", "demo.png"]
    assert (out / "demo.png").read_bytes() == b"png"


def test_resumed_rows_keeps_rows_of_the_same_setup_and_refuses_others(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "n": 4096},
                                "rows": [{"ms": 1.5}]}))
    assert results.resumed_rows(path, {"gpu": "NVIDIA H100 80GB HBM3", "n": 4096}) == [{"ms": 1.5}]
    assert results.resumed_rows(path, {}) == [{"ms": 1.5}]
    with pytest.raises(SystemExit, match=r"^--resume: .*results.json was measured on another set-up \(gpu: 'NVIDIA "
                                         r"H100 80GB HBM3' there, 'NVIDIA A100' here; n: 4096 there, 8192 here\)\. "):
        results.resumed_rows(path, {"gpu": "NVIDIA A100", "driver": "550.54.15", "n": 8192})


def test_cpu_kernels_reports_each_modifier_against_plain_numba_at_its_n():
    """numba-softcap / numba-alibi (issue 27) are listed as x the time of numba at the same N, forward and
    forward+backward, only where both ran; nothing is listed without them."""
    cpu_kernels = script("cpu_kernels")
    at = {(4096, "numba"): {"forward_s": 0.1, "forward_backward_s": 0.3},
          (4096, "numba-softcap"): {"forward_s": 0.125, "forward_backward_s": 0.33},
          (4096, "numba-alibi"): {"forward_s": 0.105, "forward_backward_s": 0.36},
          (16384, "numba-alibi"): {"forward_s": 0.5, "forward_backward_s": 1.5}}           # no plain numba there
    lines = cpu_kernels._modifier_lines(at)
    assert lines[-1] == ("- N=4096: softcap forward x1.25, forward+backward x1.10; alibi forward x1.05, "
                         "forward+backward x1.20")
    assert not any("16384" in line for line in lines)
    assert cpu_kernels._modifier_lines({(4096, "numba"): at[4096, "numba"]}) == []
