"""Both scripts under each config of accelerate_configs/ on GPUs (skipped without CUDA): one
process per config on one GPU, and two processes where two GPUs are visible. 3 steps each, a
checkpoint at step 2, the final model loadable with from_pretrained; under DDP and ZeRO-2 the script
itself checks that the ranks end with equal weights."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

from gpu_fixtures import local_model, local_reward_model  # noqa: F401 (fixtures)
from helpers import ROOT, free_port, metrics_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIGS = ["single_gpu", "multi_gpu", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload", "fsdp2"]
SCRIPTS = {"train_grpo.py": ["--num_generations", "4"], "train_ppo.py": []}


def launch(config, script, num_processes, args, timeout=600):
    if config.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed here (requirements.txt installs it); the ZeRO configs need it")
    port = free_port()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"), "--num_processes", str(num_processes),
           "--main_process_port", str(port), os.path.join(ROOT, script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="4", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def run_args(script, model, out):
    return ["--model_name_or_path", model, "--max_steps", "3", "--prompts_per_step", "8", "--max_completion_length",
            "32", "--per_device_train_batch_size", "4", "--save_steps", "2", "--output_dir", str(out),
            *SCRIPTS[script]]


def check_run(result, out, processes):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"num_processes={processes}" in result.stdout
    assert (out / "checkpoint-2" / "trainer_state.json").exists()
    last = metrics_of(out)[-1]
    assert all(v == v for v in last.values())  # no NaN
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")
    peaks = re.findall(r"\[rank \d\] peak GPU memory allocated: .*", result.stdout)
    print("\n" + "\n".join(peaks) + f"\nstep time {last.get('time/step', float('nan')):.2f} s")
    return result.stdout


@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("config", CONFIGS)
def test_one_process_per_config(config, script, local_model, tmp_path):
    result = launch(config, script, 1, run_args(script, local_model, tmp_path))
    check_run(result, tmp_path, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("script", list(SCRIPTS))
@pytest.mark.parametrize("config", CONFIGS[1:])
def test_two_processes_per_config(config, script, local_model, tmp_path):
    result = launch(config, script, 2, run_args(script, local_model, tmp_path))
    stdout = check_run(result, tmp_path, 2)
    if config in ("multi_gpu", "deepspeed_zero2"):  # whole replicas: the script compared them, and says so
        prints = dict(re.findall(r"\[rank (\d)\] final weights fingerprint: (\([^)]*\))", stdout))
        assert set(prints) == {"0", "1"} and prints["0"] == prints["1"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_processes_place_frozen_roles_on_their_own_gpus(local_model, local_reward_model, tmp_path):
    """DDP with two processes on two GPUs, PPO's reward model on `cuda:0` and the reference on the
    CPU: `cuda:0` means each process's own first GPU, so rank 1's roles land on physical GPU 1 and
    each rank's peak is on its own GPU only."""
    args = run_args("train_ppo.py", local_model, tmp_path) + ["--reward_model_name_or_path", local_reward_model,
                                                              "--reward_device", "cuda:0", "--ref_device", "cpu"]
    result = launch("multi_gpu", "train_ppo.py", 2, args)
    check_run(result, tmp_path, 2)
    peaks = dict(re.findall(r"\[rank (\d)\] peak GPU memory allocated: (.*)", result.stdout))
    assert set(peaks) == {"0", "1"}, result.stdout[-2000:]
    assert "cuda:1" not in peaks["0"] and "cuda:0" not in peaks["1"], peaks  # no rank touched the other's GPU
