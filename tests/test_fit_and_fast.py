"""--gpu_memory as an enforced allocator cap, and --generation_backend auto (CPU: the GPU calls are
stood in for; tests/gpu/test_gpu_budget.py runs them on a GPU)."""
import types

import pytest
import torch

from utils import memory
from utils.base import GIB, resolve_generation_backend, resolve_share_prompt_cache, unshareable_attention


class FakeCuda:
    """torch.cuda's calls that apply_memory_cap makes, on a pretend 139 GiB GPU."""

    def __init__(self, monkeypatch, total=139 * GIB):
        self.fractions = {}
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=total))
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, device: self.fractions.__setitem__(torch.device(device).index, fraction))
        monkeypatch.setattr(memory, "_CAPS", {})


def test_the_cap_is_set_on_every_gpu_used_and_said_first(monkeypatch):
    fake = FakeCuda(monkeypatch)
    lines = memory.apply_memory_cap("24GB", ["cuda:0", torch.device("cuda", 1), "cpu", "cuda:0"])
    assert fake.fractions == {0: pytest.approx(21 / 139), 1: pytest.approx(21 / 139)}
    assert lines == [f"GPU memory cap: 21.0 GiB of cuda:{i}'s 139.0 GiB for this process's allocator (--gpu_memory "
                     "24GB)" for i in (0, 1)]
    assert memory.memory_cap_of("cuda:1") == 21 * GIB and memory.memory_cap_of("cpu") is None
    # a budget at least the GPU's own: said, not capped
    fake.fractions.clear()
    assert "not capped" in memory.apply_memory_cap("200GiB", ["cuda:0"])[0] and fake.fractions == {}


def test_no_cap_without_the_flag_or_a_gpu(monkeypatch):
    FakeCuda(monkeypatch)
    assert memory.apply_memory_cap("24GB", ["cpu"]) == []
    assert memory.apply_memory_cap(None, ["cuda:0"]) == []


def test_an_out_of_memory_error_under_the_cap_says_the_cap_was_the_limit(monkeypatch):
    FakeCuda(monkeypatch)
    memory.apply_memory_cap("12GB", ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (1 * GIB, 139 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: int(9.8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: int(10.4 * GIB))
    monkeypatch.setattr(memory, "biggest_allocations", lambda d: [])
    monkeypatch.setattr(memory, "best_levers", lambda *a: ["--use_gradient_checkpointing: ..."])
    timer = types.SimpleNamespace(current="actor_update", cuda=True, device=torch.device("cuda", 0))
    tracker = types.SimpleNamespace(table=lambda: "(roles)")
    report = memory.OOMReport.__new__(memory.OOMReport)
    report.args, report.algo, report.timer, report.tracker, report.num_processes, report.engine, report.step = (
        types.SimpleNamespace(gpu_memory="12GB"), "grpo", timer, tracker, 1, "single", 3)
    text = report.describe(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert "The limit was the cap, not the GPU: --gpu_memory 12GB holds this process's allocator to 10.5 GiB" in text
    assert "OUT OF MEMORY in phase 'actor_update' of step 3" in text


@pytest.mark.parametrize("where, want, reason", [
    (dict(device_type="cpu"), "hf", "not a CUDA GPU"),
    (dict(device_type="cuda", engine="zero3"), "hf", "under zero3"),
    (dict(device_type="cuda", engine="fsdp2"), "hf", "under fsdp2"),
    (dict(device_type="cuda", actor_kind="balanced"), "static", "several GPUs"),
    (dict(device_type="cuda", param_offload=True), "static", "--param_offload"),
    (dict(device_type="cuda", param_offload=True, generation_copy=True, num_params=10**9), "compiled", "stay"),
    (dict(device_type="cuda", num_params=20_000_000), "cudagraph", "too small"),
    (dict(device_type="cuda", engine="ddp", num_params=1_500_000_000), "compiled", "compiled and captured"),
    (dict(device_type="cpu", kv_cache_dtype="fp8"), "static", "--kv_cache_dtype fp8 needs this project's static cache"),
    (dict(device_type="cuda", engine="zero3", kv_cache_dtype="fp8"), "static", "under zero3"),
    (dict(device_type="cpu", share_prompt_cache=True), "static", "--share_prompt_cache needs this project's static"),
])
def test_auto_backend_rule(where, want, reason):
    backend, why = resolve_generation_backend("auto", **where)
    assert backend == want and reason in why
    assert resolve_generation_backend("hf", **where) == ("hf", None)  # a backend the user named stays


def test_share_prompt_cache_unset_is_on_only_where_a_captured_step_reads_a_plain_attention():
    """--share_prompt_cache unset: on for GRPO groups decoding in a captured step on one GPU, over transformers'
    own configs: a Qwen2 or Llama model; off for one completion per prompt, the static or hf step, a CPU, fp8 keys and
    values, a balanced policy, flash-attn, a model computing attention in its own code, and models whose attention
    the shared step refuses (a sliding window: Qwen2 with use_sliding_window, Mistral; softcapping and windows: Gemma
    2). A value the user set stays."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    on = dict(backend="compiled", device_type="cuda", group=8)
    for config in (Qwen2Config(), LlamaConfig(), None):
        assert resolve_share_prompt_cache(None, unshareable=unshareable_attention(config), **on)[0], config
    assert resolve_share_prompt_cache(None, backend="cudagraph", device_type="cuda", group=2)[0]
    for change, why in ((dict(group=1), "one completion"), (dict(backend="static"), "not captured"),
                        (dict(backend="hf"), "not captured"), (dict(device_type="cpu"), "not captured"),
                        (dict(kv_cache_dtype="fp8"), "fp8"), (dict(actor_kind="balanced"), "several GPUs"),
                        (dict(attn_implementation="flash_attention_2"), "flash_attention_2 attention"),
                        (dict(unshareable=unshareable_attention(Qwen2Config(use_sliding_window=True,
                                                                            max_window_layers=0))), "sliding-window"),
                        (dict(unshareable=unshareable_attention(MistralConfig())), "sliding-window"),
                        (dict(unshareable=unshareable_attention(Gemma2Config())), "sliding-window"),
                        (dict(attention_interface=False), "outside transformers' attention interface")):
        shared, reason = resolve_share_prompt_cache(None, **dict(on, **change))
        assert not shared and why in reason, change
    gemma = Gemma2Config(sliding_window=None, layer_types=["full_attention"] * 26)
    assert resolve_share_prompt_cache(None, unshareable=unshareable_attention(gemma), **on) == (
        False, "the model softcaps its attention")
    assert resolve_share_prompt_cache(False, **on) == (False, None)
    assert resolve_share_prompt_cache(True, backend="static", device_type="cpu", group=1) == (True, None)


def test_scripts_print_the_backend_auto_chose(run, tmp_path):
    result = run(["--max_steps", "1", "--save_strategy", "no", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("generation: --generation_backend hf (auto: the policy is on cpu, not a CUDA GPU (captured steps need "
            "CUDA graphs)); --share_prompt_cache off (auto: the hf backend's decoding step is not captured)\n"
            ) in result.stdout
    named = run(["--max_steps", "1", "--save_strategy", "no", "--generation_backend", "static", "--output_dir",
                 str(tmp_path / "b")], script="train_ppo.py")
    assert named.returncode == 0, named.stderr[-2000:]
    assert ("generation: --generation_backend static; --share_prompt_cache off (auto: each prompt has one "
            "completion)\n") in named.stdout
