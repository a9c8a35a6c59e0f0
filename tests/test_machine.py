"""Where something ran: the facts bench, info and benchmarks/ record."""
import mmap
import subprocess

import torch

from sparse_attn import machine
from tests.helpers import release


def test_versions_cpus_cpu_model_and_load_average():
    found = machine.versions(["torch", "no-such-package"])
    assert found["no-such-package"] is None and release(found["torch"]) == release(torch.__version__)
    assert 1 <= machine.cpus() and machine.cpu_model()
    assert len(machine.load_average()) == 3 and min(machine.load_average()) >= 0


def test_describe_has_what_results_json_records():
    info = machine.describe()
    assert {"platform", "machine", "processor", "cpus", "python", "versions", "torch_threads"} <= set(info)
    assert release(info["versions"]["torch"]) == release(torch.__version__) and info["cpus"] == machine.cpus()
    assert ("gpu" in info) == torch.cuda.is_available()


def test_nvidia_driver_reads_the_first_gpus_and_is_none_without_nvidia_smi(monkeypatch):
    def smi(command, **options):
        assert command == ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        return subprocess.CompletedProcess(command, 0, stdout="550.54.15\n550.54.15\n", stderr="")
    monkeypatch.setattr(subprocess, "run", smi)
    assert machine.nvidia_driver() == "550.54.15"
    for failure in (FileNotFoundError("nvidia-smi"), subprocess.CalledProcessError(9, "nvidia-smi"),
                    subprocess.TimeoutExpired("nvidia-smi", 60)):
        def broken(command, failure=failure, **options):
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


def test_peak_rss_since_a_reset_sees_a_new_allocation_and_the_process_peak_is_above_it():
    # fresh pages from the kernel: a torch tensor may come from memory glibc kept resident after an earlier
    # test freed it, which touches no new page (the CI run that reused 32 MiB grew VmHWM by 0)
    pages = mmap.mmap(-1, 2**25)                                               # 32 MiB, not yet resident
    held = torch.ones(2**24, dtype=torch.uint8)                                # a peak above now, then freed
    del held
    machine.reset_peak_rss()
    before = machine.status_bytes("VmRSS")
    assert machine.status_bytes("VmHWM") - before < 2**23                      # the reset dropped that peak
    torch.frombuffer(pages, dtype=torch.uint8).fill_(1)                        # touch every page
    assert machine.status_bytes("VmHWM") - before >= 2**25 * 0.9
    pages.close()
    assert machine.process_peak_bytes() >= machine.status_bytes("VmHWM")


def test_cpu_kind_names_family_model_and_the_flags_that_pick_kernel_paths(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n\n"
                       "processor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse\n")
    real_path = machine.Path
    monkeypatch.setattr(machine, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert machine.cpu_kind() == "family 26 model 2: avx2 avx512f avx512_bf16"
    monkeypatch.setattr(machine, "Path", lambda p: tmp_path / "missing")
    assert machine.cpu_kind() == ""
