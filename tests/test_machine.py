"""Where something ran: the facts bench, info and benchmarks/ record."""
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
