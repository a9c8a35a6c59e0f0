"""Where something ran: the facts bench, info and benchmarks/ record, and how benchmarks write and resume results."""
import json
import subprocess

import pytest
import torch

from sparse_attn import machine


def test_versions_cpus_cpu_model_and_load_average():
    assert machine.versions(["torch", "no-such-package"]) == {"torch": torch.__version__, "no-such-package": None}
    assert 1 <= machine.cpus() and machine.cpu_model()
    assert len(machine.load_average()) == 3 and min(machine.load_average()) >= 0


def test_describe_has_what_results_json_records():
    info = machine.describe()
    assert {"platform", "machine", "processor", "cpus", "python", "versions", "torch_threads"} <= set(info)
    assert info["versions"]["torch"] == torch.__version__ and info["cpus"] == machine.cpus()
    assert ("gpu" in info) == torch.cuda.is_available()


def test_nvidia_driver_reads_the_first_gpus_and_is_none_without_nvidia_smi(monkeypatch):
    def smi(command, **options):
        assert command == ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.CompletedProcess(command, 0, stdout="550.54.15\n550.54.15\n", stderr="")
    monkeypatch.setattr(subprocess, "run", smi)
    assert machine.nvidia_driver() == "550.54.15"
    for failure in (FileNotFoundError("nvidia-smi"), subprocess.CalledProcessError(9, "nvidia-smi"),
                    subprocess.TimeoutExpired("nvidia-smi", 60)):
        def broken(command, **options):
            raise failure
        monkeypatch.setattr(subprocess, "run", broken)
        assert machine.nvidia_driver() is None


def test_gpu_records_the_current_devices_name_memory_driver_and_cuda(monkeypatch):
    class Properties:
        name, total_memory = "NVIDIA H100 80GB HBM3", 85_031_714_816          # an H100's 79.19 GiB

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties() if index == 1 else None)
    monkeypatch.setattr(machine, "nvidia_driver", lambda: None)                # no nvidia-smi
    assert machine.gpu() == {"gpu": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": 79.2, "driver": None,
                             "cuda": torch.version.cuda}


def test_cuda_usable_is_false_once_an_error_broke_the_context(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch, "ones", lambda size, device: torch.full((size,), 1.0))
    assert machine.cuda_usable()

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    assert not machine.cuda_usable()


def test_write_results_replaces_each_file_whole(tmp_path):
    def markdown(record):
        return f"{len(record['rows'])} rows\n"

    def figure(record, path):
        path.write_bytes(b"png")

    assert machine.write_results(tmp_path / "out", "demo", {"rows": [1]}, markdown, figure) == "1 rows\n"
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["demo.json", "demo.md", "demo.png"]

    def killed(record, path):
        path.write_bytes(b"half a p")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        machine.write_results(out, "demo", {"rows": [1, 2]}, markdown, killed)
    assert json.loads((out / "demo.json").read_text()) == {"rows": [1, 2]} and (out / "demo.md").read_text() == "2 rows\n"
    assert (out / "demo.png").read_bytes() == b"png"                          # the previous figure, whole
    assert machine.write_results(out, "demo", {"rows": []}, markdown) == "0 rows\n"      # no figure: the png stays
    assert sorted(p.name for p in out.iterdir()) == [".demo.partial.png", "demo.json", "demo.md", "demo.png"]
    assert (out / "demo.png").read_bytes() == b"png"


def test_resumed_rows_keeps_rows_of_the_same_setup_and_refuses_others(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.54.15", "n": 4096},
                                "rows": [{"ms": 1.5}]}))
    assert machine.resumed_rows(path, {"gpu": "NVIDIA H100 80GB HBM3", "n": 4096}) == [{"ms": 1.5}]
    assert machine.resumed_rows(path, {}) == [{"ms": 1.5}]
    with pytest.raises(SystemExit, match=r"^--resume: .*results.json was measured on another set-up \(gpu: 'NVIDIA "
                                         r"H100 80GB HBM3' there, 'NVIDIA A100' here; n: 4096 there, 8192 here\)\. "):
        machine.resumed_rows(path, {"gpu": "NVIDIA A100", "driver": "550.54.15", "n": 8192})
