"""triton_gpu.LAUNCH_TABLE and benchmarks/triton_tune.py without a GPU: the table's lookup against the rule,
the sweep with fake kernels and a fake clock (order, budget, error rows, wrong results, the table put back,
resume), the results and their literal, and one real sweep through Triton's interpreter."""
import doctest
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason='needs triton (its interpreter without a GPU): pip install ".[triton]"')

from sparse_attn import machine  # noqa: E402
from sparse_attn.backends import triton_gpu  # noqa: E402
from tests.helpers import release  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_tune.py"
_spec = importlib.util.spec_from_file_location("triton_tune", SCRIPT)
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)

H100 = 227 * 1024
BF16_KEY = ("forward", 64, 64, torch.bfloat16)


@pytest.fixture(autouse=True)
def table(monkeypatch):
    """An empty LAUNCH_TABLE for every test, whatever the committed one holds."""
    monkeypatch.setattr(triton_gpu, "LAUNCH_TABLE", {})
    return triton_gpu.LAUNCH_TABLE


def rule_before_the_table(head_dim, dtype, shared_memory, backward):
    """launch_settings as it was before LAUNCH_TABLE existed, copied here: an empty table must change nothing."""
    stages = 2 if backward else 3
    wide = head_dim > 64 or (dtype == torch.float32 and head_dim > 32)
    return dict(num_warps=8 if wide else 4,
                num_stages=stages - 1 if head_dim > 64 and shared_memory < 128 * 1024 else stages)


# ------------------------------------------------------------------------------------------------
# LAUNCH_TABLE in launch_settings
# ------------------------------------------------------------------------------------------------
def test_an_empty_table_launches_what_the_rule_did():
    grid = itertools.product([1, 8, 16, 24, 32, 33, 48, 64, 65, 96, 128],
                             [torch.float16, torch.bfloat16, torch.float32],
                             [99 * 1024, 128 * 1024 - 1, 128 * 1024, 164 * 1024, H100], [False, True],
                             [16, 32, 64, 128], ["ieee", "tf32"])
    for head_dim, dtype, shared, backward, block, precision in grid:
        assert triton_gpu.launch_settings(head_dim, dtype, shared, backward, block, precision) == \
            rule_before_the_table(head_dim, dtype, shared, backward), (head_dim, dtype, shared, backward, block)


def test_a_table_entry_wins_over_the_rule_for_its_key_only(table):
    table[BF16_KEY] = (8, 4)
    settings = lambda head_dim=64, dtype=torch.bfloat16, backward=False, block=64: \
        triton_gpu.launch_settings(head_dim, dtype, H100, backward, block, "tf32")  # noqa: E731
    assert settings() == settings(head_dim=48) == dict(num_warps=8, num_stages=4)  # 48 pads to BLOCK_D 64
    assert settings(backward=True) == dict(num_warps=4, num_stages=2)
    assert settings(block=128) == settings(dtype=torch.float16) == settings(head_dim=32) == \
        dict(num_warps=4, num_stages=3)


def test_small_shared_memory_takes_a_stage_off_table_entries_too(table):
    table[("forward", 64, 128, torch.bfloat16)] = (4, 4)
    table[("backward", 64, 128, torch.bfloat16)] = (8, 1)
    assert triton_gpu.launch_settings(128, torch.bfloat16, H100, False, 64, "tf32") == dict(num_warps=4, num_stages=4)
    assert triton_gpu.launch_settings(128, torch.bfloat16, 99 * 1024, False, 64, "tf32") == \
        dict(num_warps=4, num_stages=3)
    assert triton_gpu.launch_settings(128, torch.bfloat16, 99 * 1024, True, 64, "tf32") == \
        dict(num_warps=8, num_stages=1)                                  # never below one stage


def test_float32_entries_are_for_exact_matmuls_only(table):
    table[("backward", 64, 64, torch.float32)] = (4, 3)
    assert triton_gpu.launch_settings(64, torch.float32, H100, True, 64, "ieee") == dict(num_warps=4, num_stages=3)
    assert triton_gpu.launch_settings(64, torch.float32, H100, True, 64, "tf32") == dict(num_warps=8, num_stages=2)


def test_launch_for_reads_the_table_at_call_time(table):
    q = torch.zeros(1, 1, 32, 16)
    assert triton_gpu.launch_for(q, 16, backward=False) == dict(num_warps=4, num_stages=3)
    table[("forward", 16, 16, torch.float32)] = (8, 1)
    assert triton_gpu.launch_for(q, 16, backward=False) == dict(num_warps=8, num_stages=1)


def test_docstring_examples():
    assert doctest.testmod(tt) == (0, 3)                                  # (failed, attempted)
    result = doctest.testmod(triton_gpu)
    assert result.failed == 0 and result.attempted > 0


def test_table_entry_puts_the_previous_entry_back_even_on_error(table):
    table[BF16_KEY] = (4, 3)
    with pytest.raises(RuntimeError, match="launch failed"):
        with tt.table_entry(BF16_KEY, (8, 2)):
            assert table[BF16_KEY] == (8, 2)
            raise RuntimeError("launch failed")
    with tt.table_entry(("backward", 64, 64, torch.float16), (8, 2)):
        assert len(table) == 2
    assert table == {BF16_KEY: (4, 3)}


# ------------------------------------------------------------------------------------------------
# The sweep with fake kernels
# ------------------------------------------------------------------------------------------------
MS = {(4, 1): 3.0, (4, 2): 2.5, (4, 3): 2.0, (8, 1): 1.0, (8, 2): 1.5}


class FakeKernels:
    """``prepare`` for the sweep: each step returns a result that depends on the setting ``LAUNCH_TABLE`` holds
    for the group, or raises; ``timer`` gives MS of the last setting run and advances the clock 1 s."""

    def __init__(self, default=(4, 3), wrong=(), not_finite=(), broken=(), unpreparable=()):
        self.default, self.wrong, self.not_finite, self.broken = default, wrong, not_finite, broken
        self.unpreparable = unpreparable
        self.launched, self.now = [], 0.0

    def prepare(self, group):
        if group in self.unpreparable:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

        def step():
            setting = triton_gpu.LAUNCH_TABLE.get(tt.table_key(group), self.default)
            self.launched.append((group.pass_name, group.dtype, *setting))
            if setting in self.broken:
                raise RuntimeError("backend='triton': out of resource: shared memory\nmore lines")
            value = 1.5 if setting in self.wrong else float("nan") if setting in self.not_finite else 1.0
            return torch.full((8,), value), torch.ones(3)
        return step, self.default

    def timer(self, step):
        step()
        self.now += 1.0
        return MS[self.launched[-1][2:]]

    def clock(self):
        return self.now


def summary_of(rows):
    return [(r["pass"], r["dtype"], r["warps"], r["stages"], r["default"], r.get("ms", r.get("error"))) for r in rows]


def test_the_sweep_runs_the_default_first_then_each_setting_in_order(table):
    fake, rows = FakeKernels(), []
    groups = tt.plan(["fp16", "bf16"], [64], [64])
    left, why = tt.sweep(groups, [(4, 1), (4, 3), (8, 1)], fake.prepare, fake.timer, 100, rows, clock=fake.clock)
    assert (left, why) == ([], "")
    expected = []
    for dtype, pass_name in itertools.product(("bf16", "fp16"), ("forward", "backward")):
        expected += [(pass_name, dtype, 4, 3, True, 2.0), (pass_name, dtype, 4, 1, False, 3.0),
                     (pass_name, dtype, 8, 1, False, 1.0)]
    assert summary_of(rows) == expected
    assert fake.launched[:6] == [("forward", "bf16", *s) for s in [(4, 3)] * 2 + [(4, 1)] * 2 + [(8, 1)] * 2]
    assert all(r["rel_error"] == 0.0 for r in rows) and table == {}


def test_settings_that_raise_or_compute_wrongly_are_error_rows_never_chosen(table):
    table[("backward", 64, 64, torch.bfloat16)] = (8, 2)                  # a pasted entry of another key stays
    fake, rows = FakeKernels(wrong=[(8, 1)], not_finite=[(8, 2)], broken=[(4, 1)]), []
    tt.sweep(tt.plan(["bf16"], [64], [64])[:1], [(4, 1), (8, 1), (8, 2)], fake.prepare, fake.timer, 100, rows,
             clock=fake.clock)
    by_setting = {(r["warps"], r["stages"]): r for r in rows}
    assert by_setting[(4, 1)]["error"] == "RuntimeError: backend='triton': out of resource: shared memory"
    assert by_setting[(8, 1)]["error"] == "wrong result: relative error 5.00e-01 > 0.02 against the default setting"
    assert by_setting[(8, 1)]["rel_error"] == 0.5 and "ms" not in by_setting[(8, 1)]
    assert by_setting[(8, 2)]["error"].startswith("wrong result: relative error nan")
    assert fake.launched == [("forward", "bf16", *s) for s in [(4, 3), (4, 3), (4, 1), (8, 1), (8, 2)]]
    assert tt.launch_table(rows) == {BF16_KEY: (4, 3)}                   # the fastest is wrong: the default wins
    assert table == {("backward", 64, 64, torch.bfloat16): (8, 2)}


def test_no_config_starts_after_the_budget(table):
    fake, rows, saved = FakeKernels(), [], []
    groups = tt.plan(["bf16"], [64, 128], [64])
    settings = [(4, 3), (8, 1), (8, 2)]
    left, why = tt.sweep(groups, settings, fake.prepare, fake.timer, 3.5, rows, clock=fake.clock,
                         save=lambda rows, pending: saved.append((len(rows), pending)))
    assert why == "time budget spent" and len(rows) == 4 and fake.now == 4.0     # the 4th started at 3.0 s
    assert [(r["pass"], r["head_dim"], r["warps"], r["stages"]) for r in rows] == \
        [("forward", 64, 4, 3), ("forward", 64, 8, 1), ("forward", 64, 8, 2), ("backward", 64, 4, 3)]
    assert [(c["pass"], c["head_dim"], c["warps"], c["stages"]) for c in left] == \
        [("backward", 64, 8, 1), ("backward", 64, 8, 2)] + \
        [(p, 128, *s) for p in ("forward", "backward") for s in settings]
    assert saved[-1] == (4, left) and [n for n, _ in saved] == [1, 2, 3, 4]
    assert table == {}


def test_resume_measures_only_what_is_left():
    first, rows = FakeKernels(), []
    groups, settings = tt.plan(["bf16"], [64], [64]), [(4, 3), (8, 1), (8, 2)]
    tt.sweep(groups, settings, first.prepare, first.timer, 3.5, rows, clock=first.clock)
    assert len(rows) == 4
    again = FakeKernels()
    left, why = tt.sweep(groups, settings, again.prepare, again.timer, 100, rows, clock=again.clock)
    assert (left, why) == ([], "")
    assert sorted(tt.config_key(r) for r in rows) == sorted({tt.config_key(r) for r in rows})      # no duplicates
    assert again.launched == [("backward", "bf16", *s) for s in [(4, 3), (8, 1), (8, 1), (8, 2), (8, 2)]]
    assert tt.sweep(groups, settings, again.prepare, again.timer, 100, rows, clock=again.clock) == ([], "")
    assert len(again.launched) == 5                                      # nothing was left: nothing ran


def test_an_unusable_gpu_stops_the_run():
    fake, rows = FakeKernels(broken=[(8, 1)]), []
    usable = iter([True, False])
    left, why = tt.sweep(tt.plan(["bf16"], [64], [64]), [(8, 1), (8, 2)], fake.prepare, fake.timer, 100, rows,
                         clock=fake.clock, usable=lambda: next(usable))
    assert why == "the CUDA context is unusable after RuntimeError: backend='triton': out of resource: shared memory"
    assert len(rows) == 2 and len(left) == 3


def test_a_group_whose_default_fails_is_one_error_row_and_its_settings_are_left():
    groups = tt.plan(["bf16"], [64], [64])
    fake, rows = FakeKernels(unpreparable=[groups[0]]), []
    left, why = tt.sweep(groups, [(8, 1)], fake.prepare, fake.timer, 100, rows, clock=fake.clock)
    assert summary_of(rows) == [("forward", "bf16", None, None, True, "OutOfMemoryError: CUDA out of memory"),
                                ("backward", "bf16", 4, 3, True, 2.0), ("backward", "bf16", 8, 1, False, 1.0)]
    assert why == "the default setting of their group failed" and left == [
        {"pass": "forward", "dtype": "bf16", "head_dim": 64, "block": 64, "warps": 8, "stages": 1}]


# ------------------------------------------------------------------------------------------------
# Results
# ------------------------------------------------------------------------------------------------
META = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "torch": "2.11.0", "triton": "3.6.0", "n": 32768,
        "batch": 1, "heads": 16, "pattern": tt.PATTERN_TEXT, "error_bounds": tt.ERROR_BOUNDS}


def row(pass_name, dtype, head_dim, block, warps, stages, default=False, **result):
    return dict(zip(tt.CONFIG, (pass_name, dtype, head_dim, block, warps, stages)), default=default, **result)


ROWS = [row("forward", "bf16", 64, 64, 4, 3, True, ms=2.0), row("forward", "bf16", 64, 64, 8, 2, ms=1.0),
        row("forward", "bf16", 64, 64, 4, 1, error="RuntimeError: out of resource"),
        row("forward", "bf16", 64, 128, 4, 3, True, ms=3.0), row("forward", "bf16", 64, 128, 8, 3, ms=2.5),
        row("backward", "fp32", 128, 64, 8, 2, True, ms=9.0), row("backward", "fp32", 128, 64, 8, 1, ms=12.0)]


def test_markdown_best_settings_block_sizes_and_the_literal_that_evals_back():
    md = tt.to_markdown({"meta": META, "rows": ROWS, "not_measured": [{"pass": "forward"}]})
    assert md.startswith("# Triton launch settings on NVIDIA H100 80GB HBM3\n")
    lines = md.splitlines()
    assert "| forward | bf16 | 64 | 64 | 8 x 2 | 1.000 | 4 x 3 | 2.000 | 2.00x |" in lines
    assert "| forward | bf16 | 64 | 128 | 8 x 3 | 2.500 | 4 x 3 | 3.000 | 1.20x |" in lines
    assert "| backward | fp32 | 128 | 64 | 8 x 2 | 9.000 | 8 x 2 | 9.000 | 1.00x |" in lines
    assert "| forward | bf16 | 64 | 1.000 | 2.500 | block 64, 2.50x faster than block 128 |" in lines
    assert "| backward | fp32 | 128 | 9.000 | — | — |" in lines
    assert "- forward bf16 64 64, 4 x 1: RuntimeError: out of resource" in lines
    assert "**Incomplete:** 1 configs not measured yet" in md
    literal = md.split("```python\n")[1]
    assert md.endswith("}\n```\n") and literal.startswith("LAUNCH_TABLE = {\n")
    table = eval(literal.split("```")[0].removeprefix("LAUNCH_TABLE = "), {"torch": torch})
    assert table == tt.launch_table(ROWS) == {BF16_KEY: (8, 2), ("forward", 128, 64, torch.bfloat16): (8, 3),
                                              ("backward", 64, 128, torch.float32): (8, 2)}


def test_write_then_resume_refuses_rows_of_another_gpu(tmp_path):
    text = tt.write(tmp_path, META, ROWS, [])
    assert (tmp_path / "triton_tune.md").read_text() == text
    assert tt.load_rows(tmp_path / "triton_tune.json", META) == ROWS
    assert tt.load_rows(tmp_path / "triton_tune.json", {**META, "driver": None}) == ROWS   # only RESUME_META must agree
    with pytest.raises(SystemExit, match="another set-up.*gpu: 'NVIDIA H100 80GB HBM3' there, 'NVIDIA A100' here"):
        tt.load_rows(tmp_path / "triton_tune.json", {**META, "gpu": "NVIDIA A100"})


def test_machine_records_the_gpu_its_shared_memory_and_the_sweep(monkeypatch):
    class Properties:
        name, total_memory, shared_memory_per_block_optin = "NVIDIA H100 80GB HBM3", 85_031_714_816, H100

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties())
    monkeypatch.setattr(machine, "nvidia_driver", lambda: "550.54.15")
    meta = tt.machine(tt.parse_args(["--n", "4096"]))
    assert {key: meta[key] for key in ("gpu", "gpu_memory_gib", "driver", "cuda", "shared_memory_per_block", "n")} == {
        "gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "driver": "550.54.15", "cuda": torch.version.cuda,
        "shared_memory_per_block": H100, "n": 4096}
    assert set(tt.RESUME_META) <= set(meta) and release(meta["torch"]) == release(torch.__version__)


def test_refuses_without_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tt.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------------------
# A real sweep in Triton's interpreter
# ------------------------------------------------------------------------------------------------
class LaunchSpy:
    """Stands in for a kernel: records (num_warps, num_stages) of each launch; with ``corrupt_warps``, adds 1 to
    output argument ``output`` after launches with that many warps (a setting that computes wrongly)."""

    def __init__(self, kernel, output=None, corrupt_warps=None):
        self.kernel, self.output, self.corrupt_warps, self.launches = kernel, output, corrupt_warps, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((kwargs["num_warps"], kwargs["num_stages"]))
            self.kernel[grid](*args, **kwargs)
            if kwargs["num_warps"] == self.corrupt_warps:
                args[self.output].add_(1.0)
        return launch


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs CPU tensors; on CUDA run the script")
def test_a_real_sweep_in_the_interpreter_launches_each_setting_and_checks_its_results(monkeypatch, table):
    forward = LaunchSpy(triton_gpu._fwd_kernel, output=3, corrupt_warps=8)       # Out: the kernel's 4th argument
    dk_dv, dq = LaunchSpy(triton_gpu._bwd_kv_kernel), LaunchSpy(triton_gpu._bwd_q_kernel)
    monkeypatch.setattr(triton_gpu, "_fwd_kernel", forward)
    monkeypatch.setattr(triton_gpu, "_bwd_kv_kernel", dk_dv)
    monkeypatch.setattr(triton_gpu, "_bwd_q_kernel", dq)
    monkeypatch.setattr(tt, "HEADS", 2)
    rows = []
    prepare = lambda group: tt.prepare(group, n=64, device="cpu")  # noqa: E731
    left, why = tt.sweep(tt.plan(["fp32"], [16], [16]), [(4, 1), (8, 1)], prepare, lambda step: (step(), 1.0)[1],
                         float("inf"), rows)
    assert (left, why) == ([], "")
    assert [(r["pass"], r["warps"], r["stages"], r.get("ms"), r.get("rel_error")) for r in rows] == [
        ("forward", 4, 3, 1.0, 0.0), ("forward", 4, 1, 1.0, 0.0), ("forward", 8, 1, None, rows[2]["rel_error"]),
        ("backward", 4, 2, 1.0, 0.0), ("backward", 4, 1, 1.0, 0.0), ("backward", 8, 1, 1.0, 0.0)]
    assert rows[2]["error"].startswith("wrong result") and rows[2]["rel_error"] > 0.1
    # forward: reference, its timing, (4, 1) checked and timed, (8, 1) checked only; then the backward's forward
    assert forward.launches == [(4, 3), (4, 3), (4, 1), (4, 1), (8, 1), (4, 3)]
    assert dk_dv.launches == dq.launches == [(4, 2), (4, 2), (4, 1), (4, 1), (8, 1), (8, 1)]
    assert tt.launch_table(rows) == {("forward", 16, 16, torch.float32): (4, 3),
                                     ("backward", 16, 16, torch.float32): (4, 2)}
    assert table == {}
