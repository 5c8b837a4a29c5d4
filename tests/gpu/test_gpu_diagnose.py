"""python -m utils.diagnose on a machine with NVIDIA GPUs (skipped without CUDA)."""
import csv
import subprocess
import sys

import pytest
import torch

from helpers import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_monitor_and_report_on_gpus(tmp_path):
    log = tmp_path / "gpus.csv"
    result = subprocess.run([sys.executable, "-m", "utils.diagnose", "--mode", "memory", "--interval", "0.5",
                             "--count", "2", "--log", str(log)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    print("\n" + result.stdout)
    rows = list(csv.DictReader(open(log)))
    import pynvml  # NVML sees every GPU of the machine, whatever CUDA_VISIBLE_DEVICES says

    pynvml.nvmlInit()
    assert len(rows) == 2 * pynvml.nvmlDeviceGetCount() and int(rows[0]["memory_total_mib"]) > 1000
    result = subprocess.run([sys.executable, "-m", "utils.diagnose", "--mode", "report", "--log", str(log)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and (tmp_path / "gpus.png").exists(), result.stderr[-2000:]
