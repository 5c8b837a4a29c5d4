"""The memory planner (utils/plan.py): parameter counts against real models, the estimate against a
hand calculation for the tiny model and against the measured H200 runs, the plan's choices, and
the scripts' --plan / --auto_memory."""
import os

import pytest

import train_grpo
from utils import toy
from utils.cli import UsageError, parse_args
from utils.plan import (GIB, HELD_OUT, HELD_OUT_PPO, MEASURED, SHAPES, WORKLOAD_GRPO, WORKLOAD_PPO, Shape,
                        apply_flags, estimate, load_shape, parse_memory, plan, script_args)


def test_parameter_counts_match_real_models():
    model = toy.build_model(toy.build_tokenizer())
    assert load_shape(None).params == sum(p.numel() for p in model.parameters())
    # transformers' own counts of the workload shapes (Qwen2, built on the meta device)
    expected = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}
    for name, count in expected.items():
        assert load_shape(name).params == count, name


def test_estimate_against_a_hand_calculation_for_the_tiny_model():
    """Tiny Llama (vocab 100, hidden 64, intermediate 256, 2 layers, 4 heads, 2 KV heads, tied,
    no q/k/v biases): 129,600 parameters. fp32 weights and AdamW, no autocast, GRPO with 2
    prompts x 4 completions, prompts 10 + completions 6 tokens, micro-batches of 4."""
    args, explicit = parse_args(train_grpo.Args, [
        "--prompts_per_step", "2", "--num_generations", "4", "--max_prompt_length", "10",
        "--max_completion_length", "6", "--per_device_train_batch_size", "4", "--mixed_precision", "no"])
    train_grpo.check_args(args, 1, explicit)
    est = estimate(load_shape(None), args, "grpo")
    comp = est["components"]
    params = 129_600
    assert comp["actor/weights"] == params * 4
    assert comp["actor/gradients"] == params * 4
    assert comp["actor/optimizer"] == params * 8  # two fp32 moments
    assert comp["actor/autocast_copies"] == 0  # no autocast
    assert comp["ref/weights"] == params * 2  # bf16 frozen copy
    # KV cache: 8 rows x 16 tokens x 2 layers x (K and V) x 2 heads x 16 dims x 2 bytes
    assert comp["generate/kv_cache"] == 8 * 16 * 2 * 2 * 2 * 16 * 2 == 32_768
    # activations without checkpointing: 2 layers x 64 tokens (4 rows x 16) x (34 x 64 + 8 x 256) bytes
    assert comp["update/activations"] == 2 * 64 * (34 * 64 + 8 * 256) == 540_672
    # logits: 4 rows x 7 positions x vocab 100 x 14 bytes, plus the hidden states at those positions in fp32
    assert comp["update/logits"] == 4 * 7 * 100 * 14 + 4 * 7 * 64 * 4
    static = params * 4 + params * 8 + params * 2
    update = static + params * 4 + comp["update/activations"] + comp["update/logits"]
    assert est["phases"]["actor_update"] == update == est["peak_allocated"]


_RUNS = [("grpo", *row) for row in MEASURED + HELD_OUT] + [("ppo", *row) for row in HELD_OUT_PPO]


@pytest.mark.parametrize("algo, shape, flags, measured", _RUNS,
                         ids=[f"{a}-{s}-{i}" for i, (a, s, _, _) in enumerate(_RUNS)])
def test_estimates_within_15_percent_of_the_h200_runs(algo, shape, flags, measured):
    workload = WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO
    est = estimate(load_shape(shape), script_args(algo, workload + flags), algo)["peak_reserved"] / GIB
    assert abs(est / measured - 1) <= 0.15, (est, measured)


def test_kept_decoder_and_generation_copy_count_in_every_phase_until_emptied():
    """cudagraph/compiled keep their KV cache (length rounded up to 128) and --generation_copy its
    bf16 weights through the ref and update phases; --empty_cache_between_phases frees both."""
    shape = load_shape("qwen2.5-1.5b")
    base = estimate(shape, _workload(["--generation_backend", "static"]))
    kept = estimate(shape, _workload(["--generation_backend", "compiled", "--generation_copy"]))
    freed = estimate(shape, _workload(["--generation_backend", "compiled", "--generation_copy",
                                       "--empty_cache_between_phases"]))
    kv = 128 * 768 * 28 * 2 * 2 * 128 * 2  # 256 + 512 tokens: already a multiple of 128
    copy = 1_543_714_304 * 2
    assert kept["components"]["generate/kv_cache"] == kv and kept["components"]["generate/copy"] == copy
    for phase in ("ref", "actor_update"):
        assert kept["phases"][phase] - base["phases"][phase] == kv + copy
        assert freed["phases"][phase] == base["phases"][phase]
    odd = estimate(shape, _workload(["--generation_backend", "cudagraph", "--max_completion_length", "500"]))
    assert odd["components"]["generate/kv_cache"] == 128 * 768 * 28 * 2 * 2 * 128 * 2  # 756 rounds up to 768


def _workload(flags=()):
    return script_args("grpo", WORKLOAD_GRPO + list(flags))


def test_plan_adds_levers_until_it_fits_and_nothing_when_it_fits():
    shape, args = load_shape("qwen2.5-7b"), _workload()
    added, reasons, final = plan(shape, args, "grpo", parse_memory("48GiB"), parse=lambda f: apply_flags(args, f))
    assert final["peak_reserved"] <= 0.9 * 48 * GIB
    assert added.count("--optim") == 1  # a later optimizer choice replaces the earlier
    assert "--use_gradient_checkpointing" in added and len(reasons) >= 3
    none, reasons, _ = plan(shape, args, "grpo", parse_memory("1000GiB"), parse=lambda f: apply_flags(args, f))
    assert none == [] and reasons == []
    _, reasons, _ = plan(shape, args, "grpo", parse_memory("8GiB"), parse=lambda f: apply_flags(args, f))
    assert "use --use_lora" in reasons[-1]  # full-parameter 7B cannot fit in 8 GiB: say what would


def test_apply_flags_and_memory_sizes():
    args = _workload()
    changed = apply_flags(args, ["--optim", "adamw_4bit", "--use_gradient_checkpointing", "--ref_offload",
                                 "--max_token_len_per_gpu", "4096"])
    assert (changed.optim, changed.use_gradient_checkpointing, changed.ref_device, changed.max_token_len_per_gpu) == \
        ("adamw_4bit", True, "offload", 4096)
    assert args.optim == "adamw_torch"  # a copy

def test_gpu_memory_takes_cards_as_sold_and_budgets_in_gib():
    # GiB (or a bare number): the allocator budget itself
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("16") == 16 * GIB and parse_memory("10.5GiB") == 10.5 * GIB
    # a card as sold: its usable part (the CUDA context and workspaces take the rest)
    assert [parse_memory(f"{gb}GB") / GIB for gb in (12, 24, 40, 48, 80)] == [10.5, 21.0, 36.0, 43.0, 73.0]
    assert parse_memory("100GB") == int((100e9 / GIB - 1.5) * GIB)  # not in the table: its GiB less 1.5
    for bad in ("lots", "0GB", "-3GiB", "24 TB"):
        with pytest.raises(ValueError, match="24GB"):
            parse_memory(bad)


def test_the_planner_imports_no_runtime_module():
    """utils/plan.py reads flags and shapes: importing it loads only utils.base (and utils.cli)."""
    import subprocess
    import sys

    code = "import sys, utils.plan; print(sorted(m for m in sys.modules if m.startswith('utils')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    assert set(eval(out.strip().splitlines()[-1])) <= {"utils", "utils.base", "utils.cli", "utils.plan"}, out


def test_the_toy_shape_is_the_embedded_model():
    from utils import toy

    assert load_shape(None) == Shape.from_config(toy.build_model(toy.build_tokenizer()).config)


def test_shapes_cover_the_workloads():
    assert set(SHAPES) >= {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}
    assert Shape.from_config(SHAPES["qwen2.5-7b"]).tied is False


def test_scripts_plan_and_exit_before_loading(run, tmp_path):
    result = run(["--model_name_or_path", "qwen2.5-7b", "--plan", "--gpu_memory", "48GiB", "--max_prompt_length",
                  "256", "--max_completion_length", "512", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plan: " in result.stdout and "estimated peak reserved with the plan" in result.stdout
    assert "actor/weights" in result.stdout and not (tmp_path / "metrics.jsonl").exists()
    result = run(["--plan", "--output_dir", str(tmp_path)], script="train_ppo.py")  # CPU, no --gpu_memory
    assert result.returncode == 2 and "give --gpu_memory" in result.stderr


def test_auto_memory_applies_the_plan(run, tmp_path):
    result = run(["--auto_memory", "--gpu_memory", "0.0001GiB", "--max_steps", "1", "--save_strategy", "no",
                  "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "plan: --logprob_chunk_size 1024 --use_gradient_checkpointing" in result.stdout


def test_placement_moves_frozen_roles_and_the_critic_to_other_gpus_first():
    shape = load_shape("qwen2.5-7b")
    args = _workload()
    # by hand: the bf16 reference (7.62B x 2 bytes) leaves the first GPU's every phase
    moved = apply_flags(args, ["--ref_device", "cuda:1"])
    before, after = estimate(shape, args), estimate(shape, moved)
    assert before["phases"]["actor_update"] - after["phases"]["actor_update"] == shape.params * 2
    assert after["other_gpus"]["cuda:1"] > shape.params * 2 and before["other_gpus"] == {}
    added, reasons, final = plan(shape, args, "grpo", parse_memory("80GiB"), parse=lambda f: apply_flags(args, f),
                                 gpus_per_process=2)
    assert added[:2] == ["--ref_device", "cuda:1"] and "GPU of their own" in reasons[0]
    assert final["peak_reserved"] <= 0.9 * 80 * GIB
    alone, _, _ = plan(shape, args, "grpo", parse_memory("80GiB"), parse=lambda f: apply_flags(args, f))
    assert not any(f.startswith("cuda:") for f in alone)  # one GPU: nowhere to put it
    lora = _workload(["--use_lora"])
    added, _, _ = plan(shape, lora, "grpo", parse_memory("16GiB"), parse=lambda f: apply_flags(lora, f),
                       gpus_per_process=2)
    assert "--ref_device" not in added  # with LoRA the reference is the policy itself

    # PPO with a reward model: the critic first, then the reference, then the reward model
    ppo = script_args("ppo", ["--prompts_per_step", "16", "--max_prompt_length", "256", "--max_completion_length",
                              "512", "--model_name_or_path", "x", "--reward_model_name_or_path", "r"])
    base = estimate(shape, ppo, "ppo")
    no_reward = estimate(shape, apply_flags(ppo, ["--reward_model_name_or_path", ""]), "ppo")
    # by hand: the reward model is the policy's body in bf16 (untied 7b: without the LM head)
    assert base["phases"]["generate"] - no_reward["phases"]["generate"] == (shape.params - shape.embedding_params) * 2
    added, reasons, final = plan(shape, ppo, "ppo", parse_memory("40GiB"), parse=lambda f: apply_flags(ppo, f),
                                 gpus_per_process=4)
    assert added[:6] == ["--critic_device", "cuda:1", "--ref_device", "cuda:2", "--reward_device", "cuda:3"]
    assert set(final["other_gpus"]) == {"cuda:1", "cuda:2", "cuda:3"} and "critic_update" not in final["phases"]


def test_planner_cli_refuses_non_positive_counts(capsys):
    from utils.plan import main

    for flags in (["--gpus_per_process", "0"], ["--num_processes", "0"]):
        with pytest.raises(SystemExit):
            main(["--model", "qwen2.5-1.5b", "--gpu_memory", "80GiB", *flags])
        assert "must be at least 1" in capsys.readouterr().err
