"""The benchmark library: settings, implementations, the sweep and its tables (the command is in test_cli)."""
import warnings

import sparse_attn as sa
from sparse_attn import bench
from sparse_attn.bench import implementations


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


def test_bench_availability():
    assert implementations._longformer_window(sa.Local(256) | sa.Global(first=16)) == (256, sa.Global(first=16))
    assert implementations._longformer_window(sa.Local(1)) == (1, None)
    assert implementations._longformer_window(sa.preset("bigbird-itc")) is None
    assert implementations._longformer_window(sa.Local(4, 2)) is None                 # HF windows are symmetric
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
