"""benchmarks/gpu_session.py without a GPU: what each stage runs, how a stage goes on past a failed step,
the refusal without CUDA, and bench's resume file."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.py"
_spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
gs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gs)


def test_dry_run_prints_every_stage_and_runs_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    for stage in ("check", "tests", "tune", "bench", "profile"):
        assert gs.main([stage, "--dry-run", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert not out.exists()
    assert "check(out)" in printed and "profile(out)" in printed
    assert "-m pytest -n 12 -v" in printed and "gpu_pytest.log" in printed and "pytest_summary(out)" in printed
    assert f"benchmarks/triton_tune.py --resume --budget-s 480 --out {out}" in printed
    assert f"benchmarks/gpu_kernels.py --resume --budget-s 480 --out {out}" in printed


def test_the_scripts_a_stage_names_exist_and_take_its_arguments(tmp_path):
    pytest.importorskip("triton", reason="the tune stage's script imports the Triton backend: pip install '.[triton]'")
    for stage in ("tune", "bench"):
        for step in gs.stages(tmp_path)[stage]:
            script = gs.REPO / step[1]
            assert script.is_file(), step
            parsed = _parse(script, step[2:])
            assert parsed.budget_s == 480 and parsed.out == tmp_path and parsed.resume


def _parse(script: Path, argv: list[str]):
    spec = importlib.util.spec_from_file_location(script.stem, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args(argv)


def test_a_stage_runs_every_step_and_returns_the_first_failure(tmp_path, capsys):
    seen = []

    def fine(out):
        seen.append(("fine", out))

    def broken(out):
        raise RuntimeError("no GPU here")

    steps = [[sys.executable, "-c", "raise SystemExit(3)"], broken, ["no-such-program-here"], fine,
             [sys.executable, "-c", "raise SystemExit(5)"]]
    assert gs.run(steps, tmp_path, dry_run=False) == 3
    printed = capsys.readouterr().out
    assert seen == [("fine", tmp_path)]
    assert "RuntimeError: no GPU here" in printed and "FileNotFoundError" in printed
    assert printed.count("[exit ") == 5 and "[exit 5 after" in printed


def test_pytest_summary_names_what_failed_and_counts_what_ran_of_a_stopped_run(tmp_path, capsys):
    (tmp_path / "gpu_pytest.log").write_text(
        "bringing up nodes...\n"
        "[gw0] [  1%] PASSED tests/test_a.py::test_one \n"
        "[gw1] [  2%] FAILED tests/test_b.py::test_two[x-y] \n"
        "[gw1] [  3%] SKIPPED tests/test_b.py::test_three \n"
        "[gw2] node down: Not properly terminated\n"
        "[gw3] [  4%] FAILED tests/test_b.py::test_two[x-y] \n")
    gs.pytest_summary(tmp_path)
    expected = ("failed: tests/test_b.py::test_two[x-y]\nPASSED 1  FAILED 2  ERROR 0  SKIPPED 1  XFAIL 0\n"
                "workers crashed: 1\n")
    assert (tmp_path / "gpu_pytest_summary.txt").read_text() == expected == capsys.readouterr().out


def test_refuses_without_cuda_and_without_out(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)                # as on a machine without a GPU
    with pytest.raises(SystemExit, match="needs a CUDA GPU|runs on a CUDA GPU"):
        gs.main(["tests", "--out", str(tmp_path)])
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit):
        gs.main(["tests"])


@pytest.mark.parametrize("stage, rows", [("tune", "triton_tune.json"), ("bench", "gpu_kernels.json")])
def test_tune_and_bench_start_from_the_committed_rows(stage, rows, tmp_path, monkeypatch):
    import torch

    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    (results / rows).write_text('{"rows": []}\n')
    monkeypatch.setattr(gs, "RESULTS", results)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ran = []
    monkeypatch.setattr(gs, "run", lambda steps, out, dry_run: ran.append(steps) or 0)
    assert gs.main([stage, "--out", str(out)]) == 0
    assert [path.name for path in out.iterdir()] == [rows] and (out / rows).read_text() == '{"rows": []}\n'
    (out / rows).write_text('{"rows": [1]}\n')                              # a later call keeps what is there
    gs.main([stage, "--out", str(out)])
    assert (out / rows).read_text() == '{"rows": [1]}\n' and len(ran) == 2

