"""``benchmarks/gpu_check.py`` (the one-GPU bf16 check) runs its whole path on the CPU with gloo,
so the script a GPU session runs in one command cannot rot unnoticed; without a GPU and without
``--device cpu`` it says it did not run."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.mark.slow  # a subprocess that imports everything and plans: the same path the parity tests run
def test_gpu_check_runs_its_steps_on_cpu_and_reports_parity_speed_and_mfu():
    small = ["--device", "cpu", "--layers", "2", "--hidden", "128", "--vocab", "256", "--seq", "32",
             "--batch", "2", "--steps", "3"]
    done = subprocess.run([sys.executable, str(SCRIPT), *small], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "worst gradient error" in out and "ratio" in out and "MFU: partita" in out, out


def test_gpu_check_without_a_gpu_says_it_did_not_run():
    import torch

    if torch.cuda.is_available():   # on a GPU machine the default run measures instead
        return
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "not run" in done.stdout, done.stdout + done.stderr
