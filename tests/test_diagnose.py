"""python -m utils.diagnose: sampling through a fake NVML, the CSV, the imbalance hint, the plot,
and the message on a machine without NVIDIA GPUs."""
import csv
import io
import subprocess
import sys
from types import SimpleNamespace

from helpers import ROOT
from utils import diagnose

MIB = 2**20


def fake_nvml(used_mib, total_mib=81920):
    """A stand-in for pynvml with len(used_mib) GPUs."""
    class NVMLError(Exception):
        pass

    handles = list(range(len(used_mib)))
    return SimpleNamespace(
        NVMLError=NVMLError, NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetCount=lambda: len(handles),
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=used_mib[h] * MIB, total=total_mib * MIB),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(pid=100 + h, usedGpuMemory=used_mib[h] * MIB)],
        nvmlDeviceGetName=lambda h: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=90 if used_mib[h] else 0),
        nvmlDeviceGetTemperature=lambda h, sensor: 40 + h)


def test_monitor_writes_csv_and_hints_at_imbalance(tmp_path):
    log = tmp_path / "gpus.csv"
    out = io.StringIO()
    taken = diagnose.monitor(0.01, str(log), fake_nvml([80000, 1000]), count=3, out=out)
    assert taken == 3
    rows = list(csv.DictReader(open(log)))
    assert len(rows) == 6 and rows[0]["memory_used_mib"] == "80000" and rows[1]["processes"] == "101:1000MiB"
    assert out.getvalue().count("hint: GPU 0 is over 90% full while GPU 1 is under 30%") == 3
    diagnose.monitor(0.01, str(log), fake_nvml([40000, 41000]), count=1, out=out)  # appends, no second header
    assert len(list(csv.DictReader(open(log)))) == 8
    assert diagnose.imbalance_hint(diagnose.sample(fake_nvml([40000, 41000]))) is None
    png = diagnose.report(str(log))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_without_nvidia_gpus_it_says_so_and_fails():
    if diagnose.load_nvml() is not None:
        import pytest

        pytest.skip("this machine has NVIDIA GPUs")
    result = subprocess.run([sys.executable, "-m", "utils.diagnose", "--mode", "memory", "--count", "1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "no NVIDIA GPU found" in result.stderr


def test_report_mode_needs_a_log():
    result = subprocess.run([sys.executable, "-m", "utils.diagnose", "--mode", "report"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--mode report needs --log" in result.stderr
