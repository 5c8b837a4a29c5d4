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
    ["--use_lora", "--torch_dtype", "bfloat16", "--use_gradient_checkpointing", "--learning_rate", "1e-3"],
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


@pytest.mark.parametrize("in_features,out_features", [(3584, 512), (3584, 3584), (3584, 18944), (18944, 3584),
                                                     (1536, 256), (1536, 1536), (1536, 8960), (8960, 1536)])
def test_lora_skips_the_input_cast_under_cuda_autocast(in_features, out_features):
    """A 7b- or 1.5b-shaped Linear (k/v, q/o, gate/up, down) of a bf16 base with apply_lora's r16 adapter (float32, as PEFT keeps them), 6144
    tokens under CUDA autocast: output and gradients (input, A, B) bit for bit PEFT's own layer's, which casts
    the input to float32 first; the forward + backward times of both printed (not asserted)."""
    import copy

    from triton.testing import do_bench

    from utils.modeling import _AUTOCAST_CASTS, apply_lora

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.lin = torch.nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
    ours = apply_lora(holder, r=16, alpha=32, dropout=0.0, target_modules="lin", task_type=None).base_model.model.lin
    torch.nn.init.normal_(ours.lora_B["default"].weight, std=0.02)
    peft_own = copy.deepcopy(ours)
    peft_own.__class__ = type(peft_own).__mro__[1]
    assert type(ours) in _AUTOCAST_CASTS.values() and type(peft_own) not in _AUTOCAST_CASTS.values()
    x = torch.randn(6144, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(6144, out_features, device="cuda", dtype=torch.bfloat16)

    def step(layer):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(x)
        out.backward(grad)
        return out

    results = []
    for layer in (ours, peft_own):
        x.grad = None
        layer.zero_grad(set_to_none=True)
        out = step(layer)
        results.append([out, x.grad.clone(), layer.lora_A["default"].weight.grad, layer.lora_B["default"].weight.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    times = [do_bench(lambda: step(layer), warmup=5, rep=40) * 1e3 for layer in (ours, peft_own)]
    print(f"\n[{out_features} x {in_features}] LoRA forward + backward, 6144 tokens: {times[0]:.0f} us without the "
          f"input cast, {times[1]:.0f} us with it (PEFT's)")


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
