"""GPU paths of train_grpo.py (skipped without CUDA). Run on the device machine:
    python -m pytest -q -s tests/gpu
"""
import re

import pytest
import torch

from gpu_fixtures import local_model, local_reward_model  # noqa: F401 (fixtures)
from helpers import metrics_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_debug_on_one_gpu_learns(run, tmp_path):
    result = run(["--debug", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mixed_precision=bf16" in result.stdout and "device=cuda" in result.stdout
    line = re.search(r"reward: first \d+ steps ([\d.]+) -> last \d+ steps ([\d.]+).*", result.stdout)
    print(line.group(0))
    before, after = float(line.group(1)), float(line.group(2))
    assert after > before + 0.4
    last = metrics_of(tmp_path)[-1]
    for phase in ("generate", "ref", "reward", "actor_update"):
        assert last[f"memory/{phase}/peak_allocated_gib"] > 0
    print({k: round(v, 4) for k, v in last.items() if k.startswith(("time/", "memory/"))})


@pytest.mark.parametrize("extra", [
    ["--use_gradient_checkpointing"],
    ["--use_gradient_checkpointing", "--torch_dtype", "bfloat16", "--num_iterations", "2", "--loss_type", "grpo"],
    ["--mixed_precision", "no", "--beta", "0"],
    ["--use_lora", "--use_gradient_checkpointing", "--learning_rate", "1e-3"],
    ["--use_gradient_checkpointing", "--torch_compile", "--generation_backend", "compiled"],
])
def test_local_model_folder_on_gpu(run, tmp_path, local_model, extra):
    out = tmp_path / "out"
    result = run(["--model_name_or_path", local_model, "--max_steps", "3", "--prompts_per_step", "8",
                  "--num_generations", "4", "--per_device_train_batch_size", "8", "--max_completion_length", "64",
                  "--learning_rate", "1e-5", "--output_dir", str(out), *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(out)
    assert len(rows) == 3 and all(r["optim/skipped_steps"] == 0 for r in rows)
    print(extra, {k: round(rows[-1][k], 3) for k in ("time/step", "memory/actor_update/peak_allocated_gib",
                                                    "policy/kl", "optim/grad_norm")})
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(out / "final")


def test_grpo_roles_on_cpu_and_offload_next_to_a_gpu_policy(run, tmp_path, local_model, local_reward_model):
    out = tmp_path / "out"
    result = run(["--model_name_or_path", local_model, "--reward_model_name_or_path", local_reward_model,
                  "--reward_funcs", "accuracy", "--ref_device", "cpu", "--reward_device", "offload",
                  "--max_steps", "2", "--prompts_per_step", "4", "--num_generations", "4",
                  "--per_device_train_batch_size", "8", "--max_completion_length", "32", "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    print("\n".join(l for l in result.stdout.splitlines() if l.startswith(("actor", "ref", "reward", "role", "[rank"))))
    assert "ref     cpu " in result.stdout and "runs on cuda:0 (offload)" in result.stdout
    assert metrics_of(out)[-1]["policy/kl"] >= 0
