"""Upstream behaviour, recorded (issue 23, finding 17): on some Intel Xeons with torch 2.13's CPU build the first
float64 ``torch.exp`` call of a process is sometimes less accurate than later ones (relative error 3.3e-9 against
numpy's exp in about half of fresh processes). The tests are immune: ``tests.tolerance.warm_up_float64_exp`` spends
that first call before any float64 comparison. This test runs fresh processes and records what this CPU does: the
first call's error is printed (and a warning names it where it is off), never asserted; what is asserted is what the
warm-up relies on, that exp is accurate once it has run.
"""
import json
import subprocess
import sys
import warnings

ACCURATE = 1e-15        # relative error of a correctly rounded-ish exp: a few ulp (2.2e-16 each)
PROCESSES = 3           # it showed in about half of fresh processes: here, then, in about 7 runs of 8 (1 - 1/2**3)

_ERRORS = """
import json
import numpy as np
import torch
x = torch.linspace(-30.0, 30.0, 65_537, dtype=torch.float64)
expected = np.exp(x.numpy())
errors = []
for call in range(3):
    errors.append(float(np.max(np.abs(torch.exp(x).numpy() - expected) / expected)))
    if call == 0:
        from tests.tolerance import warm_up_float64_exp   # what every test process runs before its oracle
        warm_up_float64_exp()
print(json.dumps(errors))
"""


def test_float64_exp_is_accurate_after_the_warm_up(record_property):
    processes = [subprocess.Popen([sys.executable, "-c", _ERRORS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(PROCESSES)]
    runs = []
    for process in processes:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-2000:]
        runs.append(json.loads(out.splitlines()[-1]))
    first = max(errors[0] for errors in runs)
    record_property("first_float64_exp_relative_error", first)
    print(f"first float64 torch.exp of a process: relative error up to {first:.2e} over {PROCESSES} processes")
    if first > ACCURATE:
        warnings.warn(f"this CPU shows torch's first float64 exp off by {first:.2e} (later calls exact); the tests "
                      f"warm it up first (tests/tolerance.py)", stacklevel=1)
    later = max(max(errors[1:]) for errors in runs)
    assert later <= ACCURATE, f"float64 torch.exp is off by {later:.2e} even after the warm-up"
