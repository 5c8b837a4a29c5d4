"""--gpu_memory's cap and --generation_backend auto on a GPU (skipped without CUDA)."""
import json
import re

import pytest
import torch

from gpu_fixtures import local_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _args(model, out, *extra):
    return ["--model_name_or_path", model, "--max_steps", "2", "--prompts_per_step", "8", "--num_generations", "4",
            "--max_completion_length", "32", "--per_device_train_batch_size", "8", "--save_strategy", "no",
            "--output_dir", str(out), *extra]


def test_a_run_over_the_cap_fails_naming_it_and_one_under_it_completes(run, tmp_path, local_model):
    over = run(_args(local_model, tmp_path / "over", "--gpu_memory", "0.25GiB"))
    print(over.stdout[-600:], over.stderr[-1500:])
    assert over.returncode != 0
    assert "GPU memory cap: 0.2 GiB of cuda:0's" in over.stdout or "GPU memory cap: 0.3 GiB of cuda:0's" in over.stdout
    assert "The limit was the cap, not the GPU: --gpu_memory 0.25GiB" in over.stderr
    under = run(_args(local_model, tmp_path / "under", "--gpu_memory", "4GiB"))
    assert under.returncode == 0, under.stderr[-3000:]
    assert "GPU memory cap: 4.0 GiB of cuda:0's" in under.stdout
    rows = [json.loads(line) for line in open(tmp_path / "under" / "metrics.jsonl")]
    peak = max(v for r in rows for k, v in r.items() if k.endswith("peak_reserved_gib"))
    print(f"under a 4 GiB cap: peak reserved {peak:.2f} GiB")
    assert peak <= 4.0


def test_auto_backend_captures_the_decoding_step_on_a_gpu(run, tmp_path, local_model):
    result = run(_args(local_model, tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"generation: --generation_backend (\w+) \(auto: (.*)\)", result.stdout)
    print(line.group(0))
    assert line.group(1) == "cudagraph" and "too small" in line.group(2)  # 20M parameters: captured, not compiled
    moved = run(_args(local_model, tmp_path / "b", "--param_offload"))
    assert moved.returncode == 0, moved.stderr[-3000:]
    assert "generation: --generation_backend static (auto: --param_offload" in moved.stdout
