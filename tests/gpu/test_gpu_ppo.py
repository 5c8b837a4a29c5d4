"""GPU paths of train_ppo.py and per-role placement (skipped without CUDA). On the device machine:
    python -m pytest -q -s tests/gpu
Tests that need two GPUs skip on one."""
import re

import pytest
import torch

from gpu_fixtures import local_model, local_reward_model  # noqa: F401 (fixtures)
from helpers import metrics_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def table_and_peaks(stdout):
    return "\n".join(l for l in stdout.splitlines() if l.startswith(("role", "actor", "critic", "ref", "reward", "[rank")))


def test_ppo_debug_on_one_gpu_learns(run, tmp_path):
    result = run(["--debug", "--output_dir", str(tmp_path)], script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"reward: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+).*", result.stdout)
    print(line.group(0))
    assert float(line.group(2)) > float(line.group(1)) + 0.4
    last = metrics_of(tmp_path)[-1]
    for phase in ("generate", "old_logprobs", "ref", "values", "reward", "actor_update", "critic_update"):
        assert last[f"memory/{phase}/peak_allocated_gib"] > 0
    print({k: round(v, 4) for k, v in last.items() if k.startswith("time/")})


def ppo_args(model, out, *extra):
    return ["--model_name_or_path", model, "--max_steps", "3", "--prompts_per_step", "16", "--num_mini_batches", "2",
            "--per_device_train_batch_size", "4", "--ppo_epochs", "2", "--max_completion_length", "48",
            "--learning_rate", "1e-5", "--output_dir", str(out), *extra]


def test_placements_on_one_gpu(run, tmp_path, local_model, local_reward_model):
    """actor and critic on cuda:0, the reference offloaded (CPU memory, run on cuda:0), the reward
    model on the CPU: tensors cross devices without the user doing anything."""
    out = tmp_path / "out"
    result = run(ppo_args(local_model, out, "--actor_device", "cuda:0", "--critic_device", "cuda:0",
                          "--ref_device", "offload", "--reward_device", "cpu",
                          "--reward_model_name_or_path", local_reward_model, "--reward_funcs", "accuracy",
                          "--use_gradient_checkpointing"), script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    print(table_and_peaks(result.stdout))
    assert re.search(r"ref\s+cpu memory, runs on cuda:0 \(offload\)", result.stdout)
    assert re.search(r"reward\s+cpu\s", result.stdout)
    rows = metrics_of(out)
    assert len(rows) == 3 and all(r["optim/skipped_steps"] == 0 for r in rows)
    assert "reward/reward_model/mean" in rows[-1]


def test_lora_actor_and_critic_on_gpu(run, tmp_path, local_model):
    out = tmp_path / "out"
    result = run(ppo_args(local_model, out, "--use_lora", "--use_gradient_checkpointing", "--learning_rate", "1e-3"),
                 script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    print(table_and_peaks(result.stdout))
    assert "the actor with its LoRA adapter disabled" in result.stdout
    rows = metrics_of(out)
    assert all(r["optim/skipped_steps"] == 0 for r in rows) and rows[-1]["policy/kl"] > 0


def test_swapped_critic_and_offloaded_moments_on_gpu(run, tmp_path, local_model):
    """--critic_device swap: the critic in pinned CPU memory outside its values and update phases. The first step's
    value loss equals the placed critic's (bf16 autocast tolerance); the actor's update, where the placed critic's
    weights and AdamW moments sit idle, peaks lower by about their bytes (weights + 2 x weights, float32). With
    --optimizer_offload as well, the rollout runs without either role's moments (2 x weights each, float32)."""
    peaks, rows = {}, {}
    for name, extra in (("placed", []), ("swap", ["--critic_device", "swap"]),
                        ("offload", ["--critic_device", "swap", "--optimizer_offload"])):
        out = tmp_path / name
        result = run(ppo_args(local_model, out, "--save_strategy", "no", *extra), script="train_ppo.py")
        assert result.returncode == 0, result.stderr[-3000:]
        print(table_and_peaks(result.stdout))
        rows[name] = metrics_of(out)
        peaks[name] = rows[name][-1]["memory/actor_update/peak_allocated_gib"]
        peaks[name + "/generate"] = rows[name][-1]["memory/generate/peak_allocated_gib"]
        if name == "swap":
            assert re.search(r"critic\s+cpu memory, on cuda:0 for its phase \(swap\)", result.stdout)
            critic_gb = float(re.search(r"critic\s.*?([\d.]+)GB\s+trainable", result.stdout).group(1))
    assert rows["swap"][0]["loss/value"] == pytest.approx(rows["placed"][0]["loss/value"], rel=2e-2)
    assert all(r["optim/skipped_steps"] == 0 for r in rows["swap"])
    saved_gib = peaks["placed"] - peaks["swap"]
    print(f"actor_update peak allocated: placed {peaks['placed']:.3f} GiB, swapped {peaks['swap']:.3f} GiB "
          f"(critic {critic_gb:.3f} GB of weights)")
    assert saved_gib * 2**30 >= 0.8 * 3 * critic_gb * 1e9
    assert rows["offload"][0]["loss/value"] == pytest.approx(rows["placed"][0]["loss/value"], rel=2e-2)
    moments_gib = peaks["swap/generate"] - peaks["offload/generate"]
    print(f"generate peak allocated: critic swapped {peaks['swap/generate']:.3f} GiB, and the actor's moments "
          f"offloaded {peaks['offload/generate']:.3f} GiB")
    # the actor's float32 AdamW moments: twice its weights, which are at least the critic's
    assert moments_gib * 2**30 >= 0.8 * 2 * critic_gb * 1e9


def test_balanced_roles_on_one_gpu(run, tmp_path, local_model):
    out = tmp_path / "out"
    result = run(ppo_args(local_model, out, "--actor_device", "balanced", "--critic_device", "auto",
                          "--ref_device", "balanced"), script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    print(table_and_peaks(result.stdout))
    assert re.search(r"actor\s+balanced: layers on cuda:0", result.stdout)


@two_gpus
def test_actor_critic_on_gpu0_reward_ref_on_gpu1(run, tmp_path, local_model, local_reward_model):
    out = tmp_path / "out"
    result = run(ppo_args(local_model, out, "--actor_device", "cuda:0", "--critic_device", "cuda:0",
                          "--reward_device", "cuda:1", "--ref_device", "cuda:1",
                          "--reward_model_name_or_path", local_reward_model), script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    print(table_and_peaks(result.stdout))
    assert re.search(r"ref\s+cuda:1\s", result.stdout) and re.search(r"reward\s+cuda:1\s", result.stdout)
    peaks = dict(re.findall(r"(cuda:\d) ([\d.]+)GiB", result.stdout.split("peak GPU memory allocated:")[-1]))
    assert float(peaks["cuda:0"]) > 0 and float(peaks["cuda:1"]) > 0


@two_gpus
def test_actor_balanced_over_two_gpus(run, tmp_path, local_model):
    out = tmp_path / "out"
    result = run(ppo_args(local_model, out, "--actor_device", "balanced", "--critic_device", "cuda:1"),
                 script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    print(table_and_peaks(result.stdout))
    assert re.search(r"actor\s+balanced: layers on cuda:0, cuda:1", result.stdout)
    grpo = run(["--model_name_or_path", local_model, "--actor_device", "balanced", "--ref_device", "balanced",
                "--max_steps", "2", "--prompts_per_step", "4", "--num_generations", "4",
                "--per_device_train_batch_size", "8", "--max_completion_length", "32", "--output_dir", str(tmp_path / "g")])
    assert grpo.returncode == 0, grpo.stderr[-3000:]
    print(table_and_peaks(grpo.stdout))
    assert re.search(r"actor\s+balanced: layers on cuda:0, cuda:1", grpo.stdout)
