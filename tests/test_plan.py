"""The memory planner (utils/plan.py): parameter counts against real models, the estimate against a
hand calculation for the tiny model and against the measured H200 runs, the plan's choices, and
the scripts' --plan / --auto_memory."""
import os
import re

import pytest

import train_grpo
from utils import toy
from utils.cli import parse_args
from utils.plan import (BUDGET_RUNS, as_measured, GIB, HELD_OUT, HELD_OUT_PPO, MEASURED, PHASE_PEAKS, SHAPES, TIME_FIT,
                        TIME_HELD_OUT, TIME_SUPERSEDED, WORKLOAD_GRPO, WORKLOAD_PPO, Shape,
                        apply_flags, estimate, estimate_time, load_shape, parse_memory, plan, script_args,
                        search, time_as_measured)


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
        "--max_completion_length", "6", "--per_device_train_batch_size", "4", "--mixed_precision", "no",
        "--generation_backend", "hf"])
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
    # logits: 4 rows x 7 positions x vocab 100 x 8 bytes (the logits and, in backward, their gradient, both float32
    # here without autocast: utils/ops.py's Function), plus the hidden states at those positions in fp32; 14 bytes
    # for the runs measured before that Function (autograd's graph over a float32 copy)
    assert comp["update/logits"] == 4 * 7 * 100 * 8 + 4 * 7 * 64 * 4
    before = estimate(load_shape(None), args, "grpo", logits_fused=False)["components"]
    assert before["update/logits"] == 4 * 7 * 100 * 14 + 4 * 7 * 64 * 4
    static = params * 4 + params * 8 + params * 2
    update = static + params * 4 + comp["update/activations"] + comp["update/logits"]
    assert est["phases"]["actor_update"] == update == est["peak_allocated"]


def test_ppo_update_phases_hold_one_roles_gradients():
    """train_ppo.py steps the actor's micro-batches, then the critic's: the actor's update holds the actor's
    gradients only, the critic's the critic's (tiny model, fp32: actor 129,600 parameters, critic the same body and
    a value head of hidden = 64 weights). Before 9d89c71 both were alive in both phases (updates_apart=False, the
    PPO runs measured then); the W-PPO 1.5b 24GB row measured both ways is in PHASE_PEAKS."""
    import train_ppo

    args, explicit = parse_args(train_ppo.Args, [
        "--prompts_per_step", "4", "--max_prompt_length", "10", "--max_completion_length", "6",
        "--per_device_train_batch_size", "4", "--mixed_precision", "no", "--generation_backend", "hf"])
    train_ppo.check_args(args, 1, explicit)
    apart = estimate(load_shape(None), args, "ppo")
    together = estimate(load_shape(None), args, "ppo", updates_apart=False)
    actor_grads, critic_grads = 129_600 * 4, (129_600 + 64) * 4
    assert apart["components"]["actor/gradients"] == actor_grads
    assert apart["components"]["critic/gradients"] == critic_grads
    assert together["phases"]["actor_update"] - apart["phases"]["actor_update"] == critic_grads
    assert together["phases"]["critic_update"] - apart["phases"]["critic_update"] == actor_grads
    assert {k: v for k, v in apart["phases"].items() if not k.endswith("_update")} == {
        k: v for k, v in together["phases"].items() if not k.endswith("_update")}


def test_a_swapped_critic_leaves_the_other_phases_and_costs_its_copies():
    """--critic_device swap (W-PPO 1.5b, bf16 weights, 8-bit moments): the critic's weights and moments leave
    generate, ref, reward and the actor's update; the values phase holds its weights, the critic's update its weights
    and moments; host memory holds both. Time: its weights over the host link once for the values pass, its weights
    and moments in and out per critic update (per mini-batch and epoch). Searched for PPO in one process only."""
    from utils.plan import GPUS, _valid, search_space

    shape = load_shape("qwen2.5-1.5b")
    flags = ["--reward_model_name_or_path", "x", "--torch_dtype", "bfloat16", "--optim", "adamw_8bit",
             "--ref_device", "swap", "--reward_device", "swap", "--use_gradient_checkpointing",
             "--empty_cache_between_phases"]  # nothing kept between phases: each phase's own bytes
    placed, swapped = (script_args("ppo", WORKLOAD_PPO + flags + extra) for extra in ([], ["--critic_device", "swap"]))
    a, b = estimate(shape, placed, "ppo"), estimate(shape, swapped, "ppo")
    assert shape.tied  # the body is every parameter (the LM head is the embedding), plus a value head
    weights, moments = (shape.params + shape.hidden) * 2, b["components"]["critic/optimizer"]  # bf16 weights
    assert b["components"]["critic/weights"] == weights and 2 * weights / 2 < moments < 1.1 * weights  # 8-bit
    for phase in ("generate", "ref", "reward", "actor_update"):
        assert a["phases"][phase] - b["phases"][phase] == pytest.approx(weights + moments), phase
    # its update: the weights and gradients all there, the moments beside them for the step only (after the backward
    # has freed its activations and the value head's float32 hidden states)
    T, C = placed.max_prompt_length + placed.max_completion_length, placed.max_completion_length
    backward = b["components"]["update/activations"] + b["tokens_per_micro_batch"] // T * (C + 1) * shape.hidden * 4
    assert a["phases"]["critic_update"] - b["phases"]["critic_update"] == pytest.approx(min(moments, backward))
    # the values pass: the actor's weights and moments, the critic's weights, a layer's two bf16 MLP intermediates
    # and the float32 hidden states the value head reads, over a micro-batch's tokens
    actor = b["components"]["actor/weights"] + b["components"]["actor/optimizer"]
    assert b["phases"]["values"] == pytest.approx(actor + weights + b["tokens_per_micro_batch"] * (
        2 * shape.inter * 2 + shape.hidden * 4))
    assert b["host_bytes"] - a["host_bytes"] == pytest.approx(weights + moments)
    host = GPUS["h200"]["host"]
    ta, tb = estimate_time(shape, placed, "ppo"), estimate_time(shape, swapped, "ppo")
    assert tb["phases"]["values"] - ta["phases"]["values"] == pytest.approx(weights / host)
    mini = script_args("ppo", WORKLOAD_PPO + flags + ["--critic_device", "swap", "--num_mini_batches", "4"])
    tm = estimate_time(shape, mini, "ppo")["phases"]["critic_update"] - estimate_time(
        shape, script_args("ppo", WORKLOAD_PPO + flags + ["--num_mini_batches", "4"]), "ppo")["phases"]["critic_update"]
    assert tm == pytest.approx(4 * 2 * (weights + moments) / host)
    # --optimizer_offload: the actor's moments too, in and out per optimizer step; out of generate, in for the step
    both = script_args("ppo", WORKLOAD_PPO + flags + ["--critic_device", "swap", "--optimizer_offload"])
    c = estimate(shape, both, "ppo")
    actor_moments = c["components"]["actor/optimizer"]
    assert b["phases"]["generate"] - c["phases"]["generate"] == pytest.approx(actor_moments)
    assert estimate_time(shape, both, "ppo")["phases"]["actor_update"] - tb["phases"]["actor_update"] == pytest.approx(
        2 * actor_moments / host)
    assert c["host_bytes"] - b["host_bytes"] == pytest.approx(actor_moments)
    assert ("critic_device", [None, "swap"]) in search_space(shape, placed, "ppo", set())
    assert "critic_device" not in dict(search_space(shape, placed, "ppo", set(), num_processes=2))
    assert not _valid(apply_flags(swapped, ["--param_offload"]))
    # --optimizer_offload searched in one process and under DDP, not under DeepSpeed/FSDP (refused there), nor with
    # paged_adamw_8bit (its own paging); not where the user set it
    assert ("optimizer_offload", [False, True]) in search_space(shape, placed, "ppo", set())
    assert ("optimizer_offload", [False, True]) in search_space(shape, placed, "ppo", set(), 2, engine="ddp")
    for engine in ("zero2", "zero3", "fsdp2"):
        assert "optimizer_offload" not in dict(search_space(shape, placed, "ppo", set(), 2, engine=engine)), engine
    assert "optimizer_offload" not in dict(search_space(shape, apply_flags(placed, ["--optim", "paged_adamw_8bit"]),
                                                        "ppo", set()))
    assert "optimizer_offload" not in dict(search_space(shape, placed, "ppo", {"optimizer_offload"}))


_RUNS = [("grpo", *row) for row in MEASURED + HELD_OUT] + [("ppo", *row) for row in HELD_OUT_PPO]


@pytest.mark.parametrize("algo, shape, flags, measured", _RUNS,
                         ids=[f"{a}-{s}-{i}" for i, (a, s, _, _) in enumerate(_RUNS)])
def test_estimates_within_15_percent_of_the_h200_runs(algo, shape, flags, measured):
    workload = WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO
    est = estimate(load_shape(shape), script_args(algo, workload + flags), algo,
                   **as_measured(flags))["peak_reserved"] / GIB
    assert abs(est / measured - 1) <= 0.15, (est, measured)


_TIMED = [("fit", *row) for row in TIME_FIT] + [("held out", *row) for row in TIME_HELD_OUT]


# runs of code changed since (TIME_SUPERSEDED) are skipped here and listed by --measured
@pytest.mark.parametrize("kind, shape, algo, flags, step, phases", [
    pytest.param(*row, marks=pytest.mark.skip(reason=TIME_SUPERSEDED[row[3]])) if row[3] in TIME_SUPERSEDED else row
    for row in _TIMED], ids=[f"{k}-{a}-{s}-{i}" for i, (k, s, a, _, _, _) in enumerate(_TIMED)])
def test_step_time_estimates_against_the_h200_runs(kind, shape, algo, flags, step, phases):
    """Fitted runs within 10% of their step time; held-out runs (never used for fitting) within 25%."""
    workload = WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO
    est = estimate_time(load_shape(shape), script_args(algo, workload + flags.split()), algo, **time_as_measured())
    assert abs(est["step"] / step - 1) <= (0.10 if kind == "fit" else 0.25), (est["step"], step)


# runs of code changed since (BUDGET_RUNS' `superseded`: e.g. the two float32 activation-offload runs, 11.29 s and
# 8.87 s against 6.61 estimated, before 04ef21d kept the offload out of torch.compile) measure nothing the planner
# models now: skipped here, listed by --measured
@pytest.mark.parametrize("run", [pytest.param(r, marks=pytest.mark.skip(reason=r["superseded"]))
                                 if r.get("superseded") else r for r in BUDGET_RUNS],
                         ids=[r["row"] for r in BUDGET_RUNS])
def test_budget_rows_held_out_time_and_memory(run):
    """benchmarks/budget.py's rows under the enforced cap (held out): step time within 25%, memory within
    15% (the 7B 80GB row's estimate is 13% over; see benchmarks/PLANNER.md)."""
    workload = WORKLOAD_GRPO if run["algo"] == "grpo" else WORKLOAD_PPO
    args = script_args(run["algo"], workload + run["flags"])
    shape = load_shape(run["shape"])
    assert abs(estimate_time(shape, args, run["algo"], **time_as_measured(run))["step"] / run["step_time_s"] - 1) <= 0.25
    memory = estimate(shape, args, run["algo"], **as_measured(row=run))["peak_reserved"]
    assert abs(memory / GIB / run["peak_reserved_gib"] - 1) <= 0.15


# known phase misses, kept visible; strict, so a fix shows
_PHASE_MISSES = {
    # 2026-12-05 (H100, stop 42): a bf16 --generation_copy at 7b (untied head) shares the policy's tensors by the
    # count, yet generation peaked 4.2 GiB above the same flags' estimate (42.91 GiB allocated; 38.34 without the copy
    # on an H200, 12-03), 2.1 GiB less with the input embedding in CPU memory. Found 12-06: the copy was built on the
    # GPU whole, holding a whole bf16 model until the policy's tensors replaced it; built on the meta device since
    # (476a8f6), the same flags' generation peaked 38.34 GiB (the row "built on the meta device"). These two runs
    # measured the old code
    "7b 80GB row's flags with --generation_copy (H100)": "generation 9.7% above its estimate (42.91 GiB against 38.76)",
    "input embedding in CPU memory (7b, HostStepped, H100)": "generation 7.7% above its estimate (40.86 GiB against "
                                                             "37.73)",
}


@pytest.mark.parametrize("row, shape, algo, flags, peaks",
                         [pytest.param(*p, marks=pytest.mark.xfail(strict=True, reason=_PHASE_MISSES[p[0]]))
                          if p[0] in _PHASE_MISSES else p for p in PHASE_PEAKS], ids=[p[0] for p in PHASE_PEAKS])
def test_phase_peaks_against_the_budget_rows(row, shape, algo, flags, peaks):
    """Each phase's estimated peak allocated against the budget rows' measured one: generation (with
    the prefill's MLP activations counted) and the reference pass (eager layers: four MLP intermediates, not beside the
    LM head's chunk; the QLoRA runs since the logprob Function were 10-12% under the count before) within 5%; the update within 12%
    (measured: 7b 80GB +9%, its temporaries under --torch_compile, benchmarks/PLANNER.md; the rows
    rerun later, held out: 7b LoRA 24GB -7%, 1.5b 12GB +5%, 7b QLoRA 24GB +7%; the two 1.5b 24GB float32 runs
    +10% and +11% before autocast's copies under compiled layers were counted per layer, +7% after)."""
    workload = WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO
    est = estimate(load_shape(shape), script_args(algo, workload + flags), algo,
                   **as_measured(row=next(r for r in BUDGET_RUNS if r["row"] == row)))["phases"]
    for phase, measured in peaks.items():
        bound = 0.12 if phase == "actor_update" else 0.05
        assert abs(est[phase] / GIB / measured - 1) <= bound, (phase, est[phase] / GIB, measured)


def test_int8_generation_copy_bytes_by_hand_and_chosen_only_where_a_bf16_copy_does_not_fit():
    """--generation_copy_dtype int8 at 7b: the decoder Linears and the LM head at one byte, the embedding and
    norms at two (8.2 GB against the bf16 copy's 15.2); --auto_memory for QLoRA takes it on a 24 GB card (a
    bf16 copy does not fit beside the rest) and the faster bf16 copy on an 80 GB one."""
    from utils.plan import generation_copy_bytes, search

    shape = load_shape("qwen2.5-7b")
    norms = shape.params - shape.linear_params - 2 * shape.embedding_params  # untied: embedding + LM head
    assert generation_copy_bytes(shape, "int8") == shape.linear_params + shape.embedding_params + 2 * (
        shape.embedding_params + norms)
    assert 8.1e9 < generation_copy_bytes(shape, "int8") < 8.2e9 and generation_copy_bytes(shape) == 2 * shape.params
    args = _workload(["--use_lora", "--load_in_4bit"])
    explicit = {"use_lora", "load_in_4bit"}
    small = search(shape, args, "grpo", 21 * GIB, explicit)["args"]
    large = search(shape, args, "grpo", 73 * GIB, explicit)["args"]
    assert small.generation_copy and small.generation_copy_dtype == "int8"
    assert large.generation_copy and large.generation_copy_dtype == "bfloat16"


def test_time_model_by_hand_for_one_decoding_step():
    """A compiled decoding step of the 1.5b shape: 28 layers x the per-layer time, plus the bf16 weights
    and 128 rows' KV cache at the mean context (256 + 512 / 2 positions) read at DECODE_EFF of 4.26 TB/s."""
    import utils.plan as P

    shape = load_shape("qwen2.5-1.5b")
    args = _workload(["--torch_dtype", "bfloat16", "--generation_backend", "compiled", "--share_prompt_cache", "false"])
    kv = 128 * (256 + 256) * 28 * 2 * 2 * 128 * 2
    step = 28 * P.DECODE_LAYER_S["compiled"] + (shape.params * 2 + kv) / (4.26e12 * P.DECODE_EFF)
    prefill = 2 * (shape.linear_params + shape.vocab * shape.hidden) * 128 * 256 / (7.9e14 * P.MATMUL_EFF)
    assert estimate_time(shape, args)["phases"]["generate"] == pytest.approx(512 * step + prefill, rel=1e-9)
    slow = estimate_time(shape, apply_flags(args, ["--generation_slice_size", "32"]))["phases"]["generate"]
    assert slow > 3 * (512 * step)  # 4 slices of 32 rows: 4 x 512 steps, each reading all the weights


def test_the_logprob_functions_saving_comes_off_each_pass_through_the_logits_by_hand():
    """Since utils/ops.py's Function, each pass over every row's logits (128 rows x 513 positions x the vocabulary)
    costs LOGIT_PASSES_SAVED (update) or LOGIT_PASSES_SAVED_NO_GRAD (reference, old logprobs) bytes a logit less at
    the bandwidth; logits_fused=False (the runs measured before) gives the old time; generation is untouched; the
    update pays it once per epoch (--num_iterations 2 also adds an old-logprobs pass that saves it)."""
    import utils.plan as P

    shape = load_shape("qwen2.5-1.5b")
    args = _workload(["--torch_dtype", "bfloat16", "--logprob_chunk_size", "1024"])
    logits = 128 * 513 * shape.vocab / 4.26e12  # s per byte a logit, at the H200's bandwidth
    new, old = (estimate_time(shape, args, logits_fused=f)["phases"] for f in (True, False))
    assert old["actor_update"] - new["actor_update"] == pytest.approx(P.LOGIT_PASSES_SAVED * logits, rel=1e-9)
    assert old["ref"] - new["ref"] == pytest.approx(P.LOGIT_PASSES_SAVED_NO_GRAD * logits, rel=1e-9)
    assert old["generate"] == new["generate"]
    two = apply_flags(args, ["--num_iterations", "2"])
    new, old = (estimate_time(shape, two, logits_fused=f)["phases"] for f in (True, False))
    assert old["actor_update"] - new["actor_update"] == pytest.approx(2 * P.LOGIT_PASSES_SAVED * logits, rel=1e-9)
    assert old["old_logprobs"] - new["old_logprobs"] == pytest.approx(P.LOGIT_PASSES_SAVED_NO_GRAD * logits, rel=1e-9)
    assert time_as_measured()["logits_fused"] is False  # a run without a row: measured before


def test_fused_generation_copy_takes_its_per_layer_saving_off_each_decoding_step_only_where_it_fuses():
    """A bf16 copy holding its own q/k/v and gate/up (float32 full training, LoRA merged into a copy, QLoRA) decodes
    FUSED_LAYER_S x 28 layers faster per step, 512 steps a rollout; a copy sharing the policy's bf16 Linears (bf16
    full training, --generation_copy_in_place) and an int8 copy do not fuse; copy_fused=False gives the old time."""
    import utils.plan as P

    shape = load_shape("qwen2.5-1.5b")
    cases = {("--generation_copy",): True,
             ("--generation_copy", "--use_lora", "--torch_dtype", "bfloat16"): True,
             ("--generation_copy", "--use_lora", "--load_in_4bit"): True,
             ("--generation_copy", "--torch_dtype", "bfloat16"): False,
             ("--generation_copy", "--use_lora", "--torch_dtype", "bfloat16", "--generation_copy_in_place"): False,
             ("--generation_copy", "--generation_copy_dtype", "int8"): False,
             (): False}
    for flags, fuses in cases.items():
        args = _workload(["--generation_backend", "compiled", *flags])
        assert P.copy_fuses_projections(args) is fuses, flags
        fused, unfused = (estimate_time(shape, args, copy_fused=f)["phases"]["generate"] for f in (True, False))
        assert unfused - fused == pytest.approx(512 * 28 * P.FUSED_LAYER_S if fuses else 0.0, abs=1e-12), flags


def test_float32_policy_decoding_through_float32_mm_by_hand():
    """A float32 policy under autocast (no flags) decoding in a captured step: each weight costs FLOAT32_KERNEL_BYTES
    a step instead of autocast's 8 (read, cast to bf16, read again), i.e. the GPU test's measured kernel time over
    autocast's (3.59 against 5.07 ms a step's products, 1.5b, 64 rows, H100); 512 steps of one slice, nothing else
    changed. The static step (no float32_mm), bf16 weights and runs measured before the kernel keep 8."""
    import utils.plan as P

    assert P.FLOAT32_KERNEL_BYTES == pytest.approx(8 * 3.59 / 5.07)
    gpu = P.GPUS["h100"]
    shape = load_shape("qwen2.5-1.5b")
    for backend in ("compiled", "cudagraph"):
        args = _workload(["--generation_backend", backend])
        kernel, autocast = (estimate_time(shape, args, gpu=gpu, float32_kernel=k)["phases"] for k in (True, False))
        saved = 512 * shape.params * (8 - 8 * 3.59 / 5.07) / (gpu["bandwidth"] * P.DECODE_EFF)
        assert autocast["generate"] - kernel["generate"] == pytest.approx(saved, rel=1e-9), backend
        assert {k: v for k, v in kernel.items() if k != "generate"} == {
            k: v for k, v in autocast.items() if k != "generate"}
    for flags in (["--generation_backend", "static"],
                  ["--torch_dtype", "bfloat16", "--generation_backend", "compiled"]):
        args = _workload(flags)
        assert (estimate_time(shape, args, gpu=gpu, float32_kernel=True)
                == estimate_time(shape, args, gpu=gpu, float32_kernel=False)), flags


def test_runs_before_float32_mm_are_timed_through_autocast():
    """time_as_measured: a run is timed with the float32 kernel only where its row says it ran with it."""
    rows = {r["row"]: r for r in BUDGET_RUNS}
    assert time_as_measured()["float32_kernel"] is False
    assert time_as_measured(rows["1.5b_no_flags, logprob Function (H100)"])["float32_kernel"] is False
    assert time_as_measured(rows["1.5b_no_flags, shared prompt and float32_mm (H100)"])["float32_kernel"] is True


def test_unnested_4bit_statistics_against_their_measurements():
    """--use_bnb_nested_quant false, against benchmarks/decode_step.py on one H100 (2026-12-06, 64 rows, the compiled
    step): at 7b the weights 0.28 GiB more (7.03 against 6.75 GiB allocated) and each decoding step 0.90 ms less
    (17.90 against 18.80 ms); at 1.5b 0.83 ms less (6.76 against 7.59 ms), the same 196 matrices: a cost per matrix,
    not per weight (per weight, 1.5b would save a fifth of 7b's). The reference and update passes save per call too.
    The planner chooses it where it fits, and keeps the flag when the user set it."""
    import utils.plan as P

    gpu = P.GPUS["h100"]
    flags = ["--use_lora", "--load_in_4bit", "--use_gradient_checkpointing", "--generation_slice_size", "64",
             "--generation_backend", "compiled"]
    for name, saved_ms in (("qwen2.5-7b", 18.80 - 17.90), ("qwen2.5-1.5b", 7.59 - 6.76)):
        shape = load_shape(name)
        nested, unnested = _workload(flags), _workload(flags + ["--use_bnb_nested_quant", "false"])
        assert nested.use_bnb_nested_quant and not unnested.use_bnb_nested_quant
        before, after = (estimate_time(shape, a, gpu=gpu)["phases"] for a in (nested, unnested))
        per_step = (before["generate"] - after["generate"]) / (2 * 512)  # two slices of 64 rows, 512 steps each
        assert per_step == pytest.approx(saved_ms * 1e-3, rel=0.1), name
        assert after["ref"] < before["ref"] and after["actor_update"] < before["actor_update"]
        if name == "qwen2.5-7b":
            grown = (estimate(shape, unnested)["peak_reserved"] - estimate(shape, nested)["peak_reserved"]) / GIB
            assert grown == pytest.approx(7.03 - 6.75, rel=0.1)
            # --share_prompt_cache held off, as the runs behind this were planned: with it (searched since) a bf16
            # generation copy fits this budget instead, and the float32 statistics' 0.3 GiB no longer do
            found = search(shape, apply_flags(nested, ["--share_prompt_cache", "false"]), "grpo", 24 * GIB,
                           explicit={"use_lora", "load_in_4bit", "share_prompt_cache"}, gpu=gpu)
            assert not found["args"].use_bnb_nested_quant and "--use_bnb_nested_quant" in found["flags"]
            kept = search(shape, nested, "grpo", 24 * GIB, explicit={"use_lora", "load_in_4bit",
                                                                      "use_bnb_nested_quant"}, gpu=gpu)
            assert kept["args"].use_bnb_nested_quant


def test_top_entropy_filtering_costs_the_old_logprob_pass_and_dynamic_sampling_says_what_it_leaves_out():
    """--top_entropy_quantile with one iteration runs the no-grad pass of --num_iterations 2 for the tokens'
    entropy (train_grpo.py step 5): the same seconds, under the phase name the script logs."""
    shape = load_shape("qwen2.5-1.5b")
    base = _workload(["--torch_dtype", "bfloat16", "--generation_backend", "compiled"])
    plain = estimate_time(shape, base)
    filtered = estimate_time(shape, apply_flags(base, ["--top_entropy_quantile", "0.2"]))
    twice = estimate_time(shape, apply_flags(base, ["--num_iterations", "2"]))
    assert "entropy" not in plain["phases"] and filtered["phases"]["entropy"] == twice["phases"]["old_logprobs"] > 0
    assert filtered["step"] == pytest.approx(plain["step"] + filtered["phases"]["entropy"])
    dynamic = estimate_time(shape, apply_flags(base, ["--dynamic_sampling"]))
    assert dynamic["step"] == plain["step"] and any("--dynamic_sampling" in u for u in dynamic["unmeasured"])


def test_kept_decoder_and_generation_copy_count_in_every_phase_until_emptied():
    """cudagraph/compiled keep their KV cache (length rounded up to 128) and --generation_copy its
    bf16 weights through the ref and update phases; --empty_cache_between_phases frees both."""
    shape = load_shape("qwen2.5-1.5b")
    base = estimate(shape, _workload(["--generation_backend", "static"]))
    unshared = ["--share_prompt_cache", "false"]  # one cache row per completion (the shared layout: its own tests)
    kept = estimate(shape, _workload(["--generation_backend", "compiled", "--generation_copy"] + unshared))
    freed = estimate(shape, _workload(["--generation_backend", "compiled", "--generation_copy",
                                       "--empty_cache_between_phases"] + unshared))
    kv = 128 * 768 * 28 * 2 * 2 * 128 * 2  # 256 + 512 tokens: already a multiple of 128
    copy = 1_543_714_304 * 2
    assert kept["components"]["generate/kv_cache"] == kv and kept["components"]["generate/copy"] == copy
    for phase in ("ref", "actor_update"):
        assert kept["phases"][phase] - base["phases"][phase] == kv + copy
        assert freed["phases"][phase] == base["phases"][phase]
    odd = estimate(shape, _workload(["--generation_backend", "cudagraph", "--max_completion_length", "500"] + unshared))
    assert odd["components"]["generate/kv_cache"] == 128 * 768 * 28 * 2 * 2 * 128 * 2  # 756 rounds up to 768


def test_generation_copy_counts_the_policys_own_bf16_tensors_once():
    """The copy's bytes less what it holds as the policy's own storage (utils/generation.py's sharing), by hand at
    7b: QLoRA shares the norms and the embedding (int8 copy) and the LM head too (bf16 copy); a float32 policy
    shares nothing; a --torch_dtype bfloat16 policy's bf16 copy is all shared (costs nothing); an offloaded
    embedding stays the copy's own; a run measured before sharing is estimated as it ran."""
    from utils.plan import generation_copy_bytes, generation_copy_shared_bytes

    shape = load_shape("qwen2.5-7b")
    norms = shape.params - shape.linear_params - 2 * shape.embedding_params
    qlora = ["--use_lora", "--load_in_4bit", "--generation_copy"]
    int8 = _workload(qlora + ["--generation_copy_dtype", "int8"])
    assert generation_copy_shared_bytes(shape, int8) == 2 * (norms + shape.embedding_params)
    assert generation_copy_shared_bytes(shape, _workload(qlora)) == 2 * (norms + 2 * shape.embedding_params)
    assert generation_copy_shared_bytes(shape, _workload(["--generation_copy"])) == 0  # float32 weights
    assert generation_copy_shared_bytes(shape, _workload(["--use_lora", "--generation_copy"])) == 0
    bf16 = _workload(["--generation_copy", "--torch_dtype", "bfloat16"])
    assert generation_copy_shared_bytes(shape, bf16) == generation_copy_bytes(shape) == 2 * shape.params
    assert estimate(shape, bf16)["components"]["generate/copy"] == 0
    moved = _workload(qlora + ["--generation_copy_dtype", "int8", "--param_offload", "--offload_policy", "embedding"])
    assert generation_copy_shared_bytes(shape, moved) == 2 * norms
    assert generation_copy_shared_bytes(shape, _workload(qlora[:2])) == 0  # no copy
    own = estimate(shape, int8, copy_shares=False)["components"]["generate/copy"]
    assert own == generation_copy_bytes(shape, "int8")
    assert own - estimate(shape, int8)["components"]["generate/copy"] == 2 * (norms + shape.embedding_params)


def test_in_place_copy_costs_no_gpu_bytes_only_the_host_backup_and_the_adapters_time():
    """--generation_copy_in_place (LoRA on a bf16 base) at 7b: the copy's own bytes are 0 where the usual bf16 copy
    holds the decoder's Linears (the adapted weights, 2 bytes each); the host holds those once; generation costs
    what the bf16 copy's does plus the restore over the host link (bytes / rate) and the fused projections' saving
    (the in-place copy's Linears are the base's own, so not fused), and less than decoding through
    the adapters; the search picks it for the 24 GB card, where the usual copy does not fit."""
    from utils.plan import FUSED_LAYER_S, GPUS, _set_flags

    shape = load_shape("qwen2.5-7b")
    lora = ["--use_lora", "--torch_dtype", "bfloat16", "--generation_backend", "compiled"]
    plain, usual = _workload(lora), _workload(lora + ["--generation_copy"])
    in_place = _workload(lora + ["--generation_copy", "--generation_copy_in_place"])
    assert estimate(shape, usual)["components"]["generate/copy"] == 2 * shape.linear_params
    assert estimate(shape, in_place)["components"]["generate/copy"] == 0
    assert estimate(shape, in_place)["host_bytes"] - estimate(shape, plain)["host_bytes"] == 2 * shape.linear_params
    gen = {name: estimate_time(shape, a)["phases"]["generate"] for name, a in (("plain", plain), ("usual", usual),
                                                                      ("in_place", in_place))}
    restore = 2 * shape.linear_params / GPUS["h200"]["host"]
    unfused = 512 * shape.layers * FUSED_LAYER_S  # the usual copy's projections are its own, so fused
    assert gen["in_place"] - gen["usual"] == pytest.approx(restore + unfused)
    assert gen["in_place"] < gen["plain"]
    card = parse_memory("24GB")
    found = search(shape, _workload(lora[:3]), "grpo", card, explicit=_set_flags(_workload(lora[:3]), "grpo"))
    assert found["args"].generation_copy_in_place and found["memory"]["peak_reserved"] <= 0.95 * card


def _workload(flags=()):
    return script_args("grpo", WORKLOAD_GRPO + list(flags))


def _explicit_but(*names):
    """Every Args field counted as set by the user except `names`: the search varies only those."""
    import dataclasses

    return {f.name for f in dataclasses.fields(train_grpo.Args)} - set(names)


def test_search_takes_the_faster_of_two_fitting_configurations_and_never_one_that_does_not_fit():
    """Two constructed cases where only one flag is free. The reference's placement: on the GPU, swapped
    in for its phase, or streamed (slow); the generation backend: compiled or hf."""
    shape = load_shape("qwen2.5-7b")
    args = _workload(["--use_gradient_checkpointing", "--torch_dtype", "bfloat16", "--optim", "adamw_8bit",
                      "--logprob_chunk_size", "1024", "--generation_backend", "hf"])
    options = {v: apply_flags(args, [] if v is None else ["--ref_device", v]) for v in (None, "swap", "offload")}
    peaks = {v: estimate(shape, a)["peak_reserved"] for v, a in options.items()}
    times = {v: estimate_time(shape, a)["step"] for v, a in options.items()}
    # swapped in for its phase only, the reference leaves the update's peak; streaming it is slowest
    assert peaks[None] > max(peaks["swap"], peaks["offload"]) and times[None] < times["swap"] < times["offload"]
    free = _explicit_but("ref_device")
    for budget, want in ((peaks[None] / 0.95 * 1.01, None),  # everything fits: the fastest, on the GPU
                         (peaks["swap"] / 0.95 * 1.01, "swap")):  # not on the GPU: swap, faster than offload
        found = search(shape, args, "grpo", budget, free)
        assert found["args"].ref_device == want and found["memory"]["peak_reserved"] <= 0.95 * budget
    least = min(peaks.values())
    assert search(shape, args, "grpo", least / 0.95 * 0.99, free)["flags"] is None  # none fits: none chosen

    free = _explicit_but("generation_backend")  # compiled decodes faster for a KV cache kept between phases
    hf, compiled = (apply_flags(args, ["--generation_backend", b]) for b in ("hf", "compiled"))
    assert estimate_time(shape, compiled)["step"] < estimate_time(shape, hf)["step"]
    assert estimate(shape, compiled)["peak_reserved"] > estimate(shape, hf)["peak_reserved"]
    roomy = search(shape, args, "grpo", estimate(shape, compiled)["peak_reserved"] / 0.95 * 1.01, free)
    tight = search(shape, args, "grpo", estimate(shape, hf)["peak_reserved"] / 0.95 * 1.01, free)
    assert roomy["args"].generation_backend == "compiled" and tight["args"].generation_backend == "hf"


def test_prefill_chunks_shrink_the_prefill_and_keep_a_tight_card_at_fewer_slices():
    """--prefill_chunk_size: the prefill's activations counted by hand (rows x positions per forward x
    (12 hidden + 6 intermediate) bytes, plus each row's float32 logits twice), and, with only the slice
    size and the chunk free, a 7b QLoRA run on a 12 GB budget decodes in two slices of 64 with chunked
    prefills rather than four slices of 32 (what fits without chunks), for a little prefill time."""
    shape = load_shape("qwen2.5-7b")
    args = _workload(["--use_lora", "--load_in_4bit", "--use_gradient_checkpointing", "--logprob_chunk_size", "256",
                      "--generation_backend", "compiled", "--empty_cache_between_phases",
                      "--generation_slice_size", "64", "--share_prompt_cache", "false"])
    per_token = 12 * 3584 + 6 * 18944
    whole, chunked = (estimate(shape, apply_flags(args, f))["components"]["generate/prefill"]
                      for f in ([], ["--prefill_chunk_size", "64"]))
    assert whole == 64 * 256 * per_token + 64 * 152064 * 8 and chunked == 64 * 64 * per_token + 64 * 152064 * 8
    t_whole, t_chunked = (estimate_time(shape, apply_flags(args, f))["phases"]["generate"]
                          for f in ([], ["--prefill_chunk_size", "64"]))
    assert t_whole < t_chunked < t_whole * 1.02
    budget = parse_memory("12GB")
    free = _explicit_but("generation_slice_size", "prefill_chunk_size")
    found = search(shape, args, "grpo", budget, free)
    assert (found["args"].generation_slice_size, found["args"].prefill_chunk_size) == (64, 64)
    unchunked = search(shape, args, "grpo", budget, free | {"prefill_chunk_size"})
    assert unchunked["args"].generation_slice_size == 32 and unchunked["time"]["step"] > found["time"]["step"]


def test_reward_pass_counted_at_its_own_batch_and_the_compiled_reference_pass_as_the_larger_of_mlp_and_head():
    """A swapped reward model's phase holds its weights and one forward over REWARD_BATCH_ROWS rows of its own
    (utils/rewards.py batches them so, whatever the micro-batch): 12 bytes per token x intermediate, the same at
    micro-batches of 4 and 64. A compiled no-grad reference pass peaks at the larger of a layer's MLP outputs (gate, up,
    their product: 6 bytes) and the LM head's chunk; an eager one (LoRA) at the larger of four such tensors (8 bytes)
    and the chunk (PHASE_PEAKS checks both against the measured runs)."""
    from utils.plan import LOGIT_COPIES_FUSED, REWARD_BATCH_ROWS

    shape = load_shape("qwen2.5-1.5b")
    T = 256 + 512
    flags = ["--reward_model_name_or_path", "x", "--reward_device", "swap", "--torch_dtype", "bfloat16",
             "--use_gradient_checkpointing", "--torch_compile", "--logprob_chunk_size", "1024"]
    small, large = (estimate(shape, script_args("ppo", WORKLOAD_PPO + flags + ["--per_device_train_batch_size", b]),
                             "ppo") for b in ("4", "64"))
    assert small["components"]["reward/pass"] == large["components"]["reward/pass"] == REWARD_BATCH_ROWS * T * shape.inter * 12
    head = 1024 * shape.vocab * LOGIT_COPIES_FUSED * 2  # bf16 logits
    assert small["components"]["ref/logits"] == max(head, 4 * T * shape.inter * 6) == head
    assert large["components"]["ref/logits"] == max(head, 64 * T * shape.inter * 6) == 64 * T * shape.inter * 6
    lora = estimate(shape, script_args("grpo", WORKLOAD_GRPO + ["--use_lora", "--logprob_chunk_size", "1024",
                                                                "--per_device_train_batch_size", "32"]), "grpo")
    assert lora["components"]["ref/logits"] == max(head, 32 * T * shape.inter * 8) == 32 * T * shape.inter * 8
    one_row = estimate(shape, script_args("grpo", WORKLOAD_GRPO + ["--use_lora", "--per_device_train_batch_size",
                                                                   "1"]), "grpo")  # the whole row's logits
    whole_row_head = 513 * shape.vocab * LOGIT_COPIES_FUSED * 2
    assert one_row["components"]["ref/logits"] == max(whole_row_head, T * shape.inter * 8) == whole_row_head
    assert lora["components"]["reward/pass"] == 0  # no reward model


def test_a_checkpointed_compiled_update_counts_an_untied_head_apart_from_a_layer_and_a_tied_one_beside_it():
    """A checkpointed update runs the LM head's chunks after the last layer's forward and before the first layer's
    recompute. For an untied head (7b) under --torch_compile, the update phase holds the weights, moments and
    gradients, the saved layer inputs and the larger of a layer's activations and the head's part, all computed here
    by hand from the shape; a tied head (1.5b) and eager layers keep the two summed."""
    from utils.plan import LAYER_ACT_HIDDEN, LAYER_ACT_INTER, LAYER_ACT_INTER_COMPILED, LOGIT_COPIES_FUSED

    T, C, rows = 256 + 512, 512, 32
    for name, compiled in (("qwen2.5-7b", True), ("qwen2.5-1.5b", True), ("qwen2.5-7b", False)):
        shape = load_shape(name)
        flags = ["--torch_dtype", "bfloat16", "--use_gradient_checkpointing", "--logprob_chunk_size", "1024",
                 "--optim", "adamw_8bit", "--per_device_train_batch_size", str(rows), "--ref_device", "swap",
                 "--empty_cache_between_phases"] + (["--torch_compile"] if compiled else [])
        est = estimate(shape, script_args("grpo", WORKLOAD_GRPO + flags), "grpo")
        weights = shape.params * 2
        moments = shape.params * 2  # two 8-bit moments a weight
        tokens = rows * T
        saved = shape.layers * tokens * shape.hidden * 2
        layer = tokens * (LAYER_ACT_HIDDEN * shape.hidden
                          + (LAYER_ACT_INTER_COMPILED if compiled else LAYER_ACT_INTER) * shape.inter)
        head = 1024 * shape.vocab * LOGIT_COPIES_FUSED * 2 + rows * (C + 1) * shape.hidden * 4 + 2 * shape.vocab * shape.hidden * 2
        apart = compiled and not shape.tied
        expected = 2 * weights + moments + saved + (max(layer, head) if apart else layer + head)
        assert est["phases"]["actor_update"] == pytest.approx(expected, rel=0.01), name
        if apart:  # at 7b, micro-batches of 32: the layer is the larger, so the head costs nothing on top
            assert layer > head


def test_fp8_kv_cache_counted_by_hand_and_not_searched_yet():
    """--kv_cache_dtype fp8 at 7b, 128 rows, a 768-position static cache: 28 layers x keys and values x 4
    heads x (128 code bytes + a 4-byte scale) per position, plus one layer's bf16 keys and values while
    attention reads them; a slower decoding step (the codes and the dequantised layer move); the search
    leaves it alone (its GPU test has not run)."""
    shape = load_shape("qwen2.5-7b")
    args = _workload(["--use_lora", "--load_in_4bit", "--generation_backend", "compiled",
                      "--share_prompt_cache", "false"])
    fp8 = apply_flags(args, ["--kv_cache_dtype", "fp8"])
    comp, plain = estimate(shape, fp8)["components"], estimate(shape, args)["components"]
    assert comp["generate/kv_cache"] == 128 * 768 * 28 * 2 * 4 * (128 + 4)
    assert plain["generate/kv_cache"] == 128 * 768 * 28 * 2 * 4 * 128 * 2 and plain["generate/kv_dequantised"] == 0
    assert comp["generate/kv_dequantised"] == 128 * 768 * 2 * 4 * 128 * 2
    assert estimate_time(shape, fp8)["phases"]["generate"] > estimate_time(shape, args)["phases"]["generate"]
    from utils.plan import search_space

    assert "kv_cache_dtype" not in [name for name, _ in search_space(shape, args, "grpo", frozenset())]


def test_shared_prompt_cache_counted_by_hand():
    """--share_prompt_cache at W-GRPO (16 prompts x 8 completions, prompts of 256 tokens, 512 new) for the 1.5b shape,
    counted here from its config: a prompt cache of the 16 distinct prompts (256 positions) and a completion cache of
    the 128 rows (512 positions), 544 positions a row against 768; the prefill's activations over the 16 prompts,
    their float32 logits beside the rows' two copies. Slices keep whole groups (32 rows: 4 prompts; 4 rows: one); a
    slice size that cuts groups holds parts of one more; PPO's prompts are all distinct."""
    from utils.plan import prompts_per_slice

    config = SHAPES["qwen2.5-1.5b"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_position = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2  # K and V, bf16
    per_prompt_token = 12 * config["hidden_size"] + 6 * config["intermediate_size"]
    vocab = config["vocab_size"]
    shape = load_shape("qwen2.5-1.5b")
    args = _workload(["--generation_backend", "compiled", "--share_prompt_cache", "false"])
    shared = apply_flags(args, ["--share_prompt_cache"])
    plain, comp = estimate(shape, args)["components"], estimate(shape, shared)["components"]
    assert plain["generate/kv_cache"] == 128 * 768 * per_position
    assert comp["generate/kv_cache"] == (16 * 256 + 128 * 512) * per_position == 128 * 544 * per_position
    assert plain["generate/prefill"] == 128 * 256 * per_prompt_token + 128 * vocab * 8
    assert comp["generate/prefill"] == 16 * 256 * per_prompt_token + 128 * vocab * 8 + 16 * vocab * 4
    for slice_rows, prompts in ((32, 4), (4, 1)):
        sliced = estimate(shape, apply_flags(shared, ["--generation_slice_size", str(slice_rows)]))["components"]
        assert sliced["generate/kv_cache"] == (prompts * 256 + slice_rows * 512) * per_position, slice_rows
    assert prompts_per_slice(args, "grpo", 128, 64) == [8, 8]
    assert max(prompts_per_slice(args, "grpo", 128, 11)) == 3  # rows 55-65: the ends of groups 6 and 8, all of 7
    assert sum(prompts_per_slice(args, "grpo", 128, 11)) > 16
    assert prompts_per_slice(script_args("ppo", WORKLOAD_PPO), "ppo", 128, 64) == [64, 64]


def test_shared_prompt_cache_changes_nothing_where_off_or_where_no_prompt_is_shared():
    """Off (every GRPO run measured before it became the default says false; PPO's unset resolves off), each budget
    row's estimate is that of its flags with the flag said false (GRPO runs since, unset, shared: skipped). PPO (one
    completion per prompt) gains nothing when set: the same cache and time, the prefill's logits one copy more. hf
    (the scripts refuse the pair; set here past that check) keeps its own cache: the flag changes nothing."""
    for run in BUDGET_RUNS:
        workload = WORKLOAD_GRPO if run["algo"] == "grpo" else WORKLOAD_PPO
        shape, algo = load_shape(run["shape"]), run["algo"]
        if algo == "grpo" and "--share_prompt_cache" not in run["flags"]:
            continue
        default, off = (script_args(algo, workload + run["flags"] + extra)
                        for extra in ([], ["--share_prompt_cache", "false"]))
        assert not default.share_prompt_cache and not off.share_prompt_cache
        for a in (default, off):  # peaks and phases to the byte, times to the float
            assert estimate(shape, a, algo, **as_measured(row=run)) == estimate(shape, default, algo,
                                                                                **as_measured(row=run)), run["row"]
            assert estimate_time(shape, a, algo, **time_as_measured(run)) == estimate_time(
                shape, default, algo, **time_as_measured(run)), run["row"]
    shape = load_shape("qwen2.5-1.5b")
    ppo = script_args("ppo", WORKLOAD_PPO + ["--generation_backend", "compiled"])
    ppo_shared = apply_flags(ppo, ["--share_prompt_cache"])
    before, after = estimate(shape, ppo, "ppo")["components"], estimate(shape, ppo_shared, "ppo")["components"]
    assert after["generate/kv_cache"] == before["generate/kv_cache"]  # 256 + 512 positions either way
    assert after["generate/prefill"] == before["generate/prefill"] + 128 * shape.vocab * 4
    assert estimate_time(shape, ppo_shared, "ppo")["phases"] == estimate_time(shape, ppo, "ppo")["phases"]
    hf = _workload(["--generation_backend", "hf"])
    hf_shared = apply_flags(hf, ["--share_prompt_cache"])
    assert estimate(shape, hf_shared) == estimate(shape, hf)
    assert estimate_time(shape, hf_shared) == estimate_time(shape, hf)


def test_shared_prompt_cache_takes_the_prefill_and_the_repeated_prompt_reads_off_generation():
    """The time --share_prompt_cache saves, by hand (7b, W-GRPO, the compiled step on an H100): the prefill's matrix
    products over 112 of the 128 prompts, and in each decoding step the 112 repeated prompts' 256 positions of keys
    and values (read once per group: L2 assumed, and said so). In one slice and in slices of 32, and with chunked
    prefills: never slower."""
    import utils.plan as P

    gpu = P.GPUS["h100"]
    shape = load_shape("qwen2.5-7b")
    per_position = shape.layers * 2 * shape.kv_heads * shape.head_dim * 2
    matmul_rate = gpu["matmul"] * P.MATMUL_EFF
    for extra, slices in (([], 1), (["--generation_slice_size", "32"], 4)):
        args = _workload(["--use_lora", "--torch_dtype", "bfloat16", "--generation_backend", "compiled",
                          "--share_prompt_cache", "false"] + extra)
        shared = apply_flags(args, ["--share_prompt_cache"])
        before, after = estimate_time(shape, args, gpu=gpu), estimate_time(shape, shared, gpu=gpu)
        prefill_saved = 2 * (shape.linear_params + shape.vocab * shape.hidden) * (128 - 16) * 256 / matmul_rate
        reads_saved = 512 * (128 - 16) * 256 * per_position / (gpu["bandwidth"] * P.DECODE_EFF)  # over all slices
        saved = before["phases"]["generate"] - after["phases"]["generate"]
        assert saved == pytest.approx(prefill_saved + reads_saved, rel=1e-9), slices
        assert {k: v for k, v in after["phases"].items() if k != "generate"} == {
            k: v for k, v in before["phases"].items() if k != "generate"}
        assert any("--share_prompt_cache" in u for u in after["unmeasured"])
        chunked = [estimate_time(shape, apply_flags(a, ["--prefill_chunk_size", "64"]), gpu=gpu)["phases"]["generate"]
                   for a in (args, shared)]
        assert chunked[1] < chunked[0]


def test_the_search_shares_the_prompt_cache_of_grpo_groups_on_static_caches_only():
    """--auto_memory's plan for the 7b LoRA 24GB row shares the prompt cache (unset, the flag is on for its compiled
    step: nothing to add) and, one slice of 128 rows then holding a 1.5 GiB smaller cache (3.7 GiB) and a prefill
    4.2 GiB smaller (0.75), decodes all 128 rows at once with whole-prompt prefills, where without it (said false by
    the user) it takes two slices of 64 with chunked prefills: faster. Where the step is not captured (the static
    step of --param_offload) the search may add the flag. Not searched for PPO (no prompt shared), nor beside
    --generation_backend hf or --kv_cache_dtype fp8 (the scripts refuse either pair), nor where auto resolves to hf
    (ZeRO-3: the flag would make it static, unmeasured on a GPU); hf trials drop it (_valid); the user's flag stays
    as set."""
    from utils.plan import _valid, search_space

    shape = load_shape("qwen2.5-7b")
    lora = ["--use_lora", "--torch_dtype", "bfloat16"]

    def planned(flags):
        args, explicit = script_args("grpo", WORKLOAD_GRPO + lora + flags, with_explicit=True)
        added, _, final = plan(shape, args, "grpo", parse_memory("24GB"), explicit=explicit)
        return added, final["time"]["step"]

    (chosen, step), (without, step_without) = planned([]), planned(["--share_prompt_cache", "false"])
    assert "--share_prompt_cache" not in chosen and "--share_prompt_cache" not in without
    assert "--generation_slice_size" not in chosen and "--prefill_chunk_size" not in chosen
    assert without[without.index("--generation_slice_size") + 1] == "64" and "--prefill_chunk_size" in without
    assert step < step_without
    assert "--share_prompt_cache" not in planned(["--share_prompt_cache"])[0]  # set already: nothing to add

    def searched(algo, flags, engine="single"):
        args = script_args(algo, (WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO) + flags)
        return "share_prompt_cache" in [name for name, _ in search_space(shape, args, algo, frozenset(),
                                                                         engine=engine)]

    assert searched("grpo", []) and not searched("ppo", [])
    assert not searched("grpo", ["--generation_backend", "hf"]) and not searched("grpo", ["--kv_cache_dtype", "fp8"])
    assert not searched("grpo", [], engine="zero3") and searched("grpo", ["--generation_backend", "static"], "zero3")
    shared = _workload(["--share_prompt_cache"])
    assert _valid(shared) and not _valid(apply_flags(shared, ["--generation_backend", "hf"]))
    assert not _valid(apply_flags(shared, ["--kv_cache_dtype", "fp8"]))
    # only the flag free: the static step (--param_offload's) gains from setting it; the compiled step shares unset,
    # so true is not tried there (the same run)
    for flags, added, considered in ((["--param_offload", "--generation_backend", "static"], ["--share_prompt_cache"],
                                      2), (["--generation_backend", "compiled"], [], 1)):
        found = search(load_shape("qwen2.5-1.5b"), _workload(flags), "grpo", 140 * GIB,
                       _explicit_but("share_prompt_cache"))
        assert found["flags"] == added and found["considered"] == considered, flags


def test_a_sliding_window_model_is_planned_unshared_as_its_run_resolves_it():
    """A model whose config has sliding windows or softcapping (read from its config, as a config.json's dict or
    transformers' config object) is planned as its run resolves --share_prompt_cache unset: off, the whole prompt
    in every row's cache; the search does not try true (the shared step refuses the window at run time) and the
    memory advice does not suggest it. Qwen2's own config (use_sliding_window false) stays shareable. A user's true
    is estimated as set."""
    from transformers import Gemma2Config, MistralConfig, Qwen2Config

    from utils.plan import LEVERS, planned_share, search_space

    assert Shape.from_config(Qwen2Config()).unshareable is None
    assert Shape.from_config(Qwen2Config().to_dict()).unshareable is None
    for config in (MistralConfig(), MistralConfig().to_dict(), Gemma2Config(), dict(SHAPES["qwen2.5-1.5b"],
                                                                                   sliding_window=4096)):
        assert "sliding-window" in Shape.from_config(config).unshareable, config
    softcapped = Gemma2Config(sliding_window=None, layer_types=["full_attention"] * 26)
    assert Shape.from_config(softcapped).unshareable == "the model softcaps its attention"
    plain = load_shape("qwen2.5-1.5b")
    windowed = Shape.from_config(dict(SHAPES["qwen2.5-1.5b"], sliding_window=4096))
    assert {f: getattr(plain, f) for f in ("vocab", "hidden", "params")} == {
        f: getattr(windowed, f) for f in ("vocab", "hidden", "params")}
    args = _workload(["--generation_backend", "compiled"])
    assert planned_share(plain, args, "grpo", "compiled") and not planned_share(windowed, args, "grpo", "compiled")
    explicit = apply_flags(args, ["--share_prompt_cache"])
    assert planned_share(windowed, explicit, "grpo", "compiled")
    unshared = apply_flags(args, ["--share_prompt_cache", "false"])
    for a, b in ((estimate(windowed, args), estimate(plain, unshared)),
                 (estimate_time(windowed, args), estimate_time(plain, unshared)),
                 (estimate(windowed, explicit), estimate(plain, args))):
        assert a == b
    static = _workload(["--param_offload", "--generation_backend", "static"])
    names = lambda shape: [name for name, _ in search_space(shape, static, "grpo", frozenset())]  # noqa: E731
    assert "share_prompt_cache" in names(plain) and "share_prompt_cache" not in names(windowed)
    share_lever = next(applies for flags, _, applies in LEVERS if flags == ["--share_prompt_cache"])
    assert share_lever(static, plain) and not share_lever(static, windowed)


def test_plan_fits_every_budget_and_keeps_the_numerics_where_they_fit():
    shape = load_shape("qwen2.5-1.5b")
    args, explicit = script_args("grpo", WORKLOAD_GRPO, with_explicit=True)
    for gib in (12, 16, 24, 40, 80):
        added, reasons, final = plan(shape, args, "grpo", gib * GIB, explicit=explicit)
        assert final["peak_reserved"] <= 0.95 * gib * GIB, gib  # never one that does not fit
        changed = "--torch_dtype" in added or "--optim" in added
        assert changed == (gib < 40), (gib, added)  # float32 + AdamW (16 bytes a weight) fits from 40 GiB up
        assert any("numerics changed" in r for r in reasons) == changed
    _, reasons, _ = plan(load_shape("qwen2.5-7b"), args, "grpo", 8 * GIB, explicit=explicit)
    assert reasons[0].startswith("nothing fits") and any(r.startswith("QLoRA r16 fits") for r in reasons), reasons


def test_apply_flags_and_memory_sizes():
    args = _workload()
    changed = apply_flags(args, ["--optim", "adamw_4bit", "--use_gradient_checkpointing", "--ref_offload",
                                 "--max_token_len_per_gpu", "4096"])
    assert (changed.optim, changed.use_gradient_checkpointing, changed.ref_device, changed.max_token_len_per_gpu) == \
        ("adamw_4bit", True, "offload", 4096)
    assert args.optim == "adamw_torch"  # a copy

def test_gpu_memory_takes_cards_as_sold_and_budgets_in_gib():
    # GiB (or a bare number): the allocator budget itself
    assert parse_memory("80GiB") == 80 * GIB and parse_memory("16") == 16 * GIB
    assert parse_memory("10.5GiB") == 10.5 * GIB
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
    assert "plan: " in result.stdout and "estimated with the plan: peak reserved" in result.stdout
    assert re.search(r"actor_update\s+[\d.]+\s+[\d.]+", result.stdout)  # each phase's GiB and seconds
    assert "actor/weights" in result.stdout and not (tmp_path / "metrics.jsonl").exists()
    result = run(["--plan", "--output_dir", str(tmp_path)], script="train_ppo.py")  # CPU, no --gpu_memory
    assert result.returncode == 2 and "give --gpu_memory" in result.stderr


def test_auto_memory_applies_the_plan(run, tmp_path):
    result = run(["--auto_memory", "--gpu_memory", "0.01GiB", "--max_steps", "1", "--save_strategy", "no",
                  "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-2000:]
    plan_line = next(line for line in result.stdout.splitlines() if line.startswith("plan: "))
    assert "--auto_reduce_micro_batch" in plan_line and "--torch_compile" not in plan_line  # on a CPU: no compiling,
    assert "--share_prompt_cache" not in plan_line  # and the CPU's decoding (hf; the flag would make it static)
    assert "step time (estimated" in result.stdout and "estimated with the plan: peak reserved" in result.stdout


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
    assert final["peak_reserved"] <= 0.95 * 80 * GIB
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


def test_planner_cli_answers_an_unknown_shape_in_one_line_and_lists_the_shapes(capsys):
    from utils.plan import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", "qwen2.5-70b", "--gpu_memory", "24GB"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and err.startswith("error: model 'qwen2.5-70b': not a "
                                                                         "workload shape (tiny, qwen2.5-0.5b"), err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "qwen2.5-7b" in capsys.readouterr().out


def test_planner_cli_refuses_non_positive_counts(capsys):
    from utils.plan import main

    for flags in (["--gpus_per_process", "0"], ["--num_processes", "0"]):
        with pytest.raises(SystemExit):
            main(["--model", "qwen2.5-1.5b", "--gpu_memory", "80GiB", *flags])
        assert "must be at least 1" in capsys.readouterr().err


def test_the_time_model_orders_the_measured_7b_80gb_runs_as_they_ran():
    """The three 7b full-parameter configurations under the 80GB cap (BUDGET_RUNS, one H200; the latest run of
    each): checkpointed at micro-batches of 32 ran 20.51 s (2026-12-01) and 16.50 s (2026-12-04, today's code),
    without checkpointing 15.97 s at 2 and 15.18 s at 4. The estimates must rank them the same way (before the
    2026-12-03 refit they ranked the checkpointed one first, and --auto_memory chose it)."""
    latest = {tuple(r["flags"]): r for r in BUDGET_RUNS  # later rows win; H200 runs only (estimated for one)
              if r["row"].startswith("7b_full_80gb") and r.get("gpu") is None}
    runs = {r["row"]: r for r in latest.values()}
    shape = load_shape("qwen2.5-7b")
    est = {row: estimate_time(shape, script_args("grpo", WORKLOAD_GRPO + r["flags"]))["step"] for row, r in runs.items()}
    measured_order = sorted(runs, key=lambda row: runs[row]["step_time_s"])
    assert len(runs) == 3 and sorted(est, key=est.get) == measured_order, est


def test_param_offload_memory_of_a_critic_is_its_embedding_only():
    """PPO's critic has no LM head (train_ppo.py offloads it with strict=False: lm_head names nothing there), so
    --param_offload takes its embedding when `embedding` is named and nothing for `lm_head` alone."""
    for name in ("qwen2.5-7b", "qwen2.5-1.5b"):  # untied and tied
        shape = load_shape(name)

        def critic(flags):
            return estimate(shape, script_args("ppo", WORKLOAD_PPO + flags), "ppo")["components"]["critic/weights"]

        none = critic([])
        got = {policy: none - critic(["--param_offload", "--offload_policy", policy])
               for policy in ("embedding", "lm_head", "embedding,lm_head")}
        embedding = shape.embedding_params * 4  # float32 weights: the workload's default
        assert got == {"embedding": embedding, "lm_head": 0, "embedding,lm_head": embedding}, name


def test_param_offload_memory_of_a_tied_weight_named_either_way_is_one_matrix_off_the_gpu():
    """--param_offload with tied weights (Qwen2.5-1.5B): one matrix for both modules, so naming either moves it
    (utils/offload.py moves every module that uses a moved weight) and the estimate is the same for the three
    policies: the weights, the generation copy's shared tensors, the 4-bit step's largest parameter. Untied (7b):
    each name moves its own matrix."""
    def est(name, flags, policy=None):
        offload = ["--param_offload", "--offload_policy", policy] if policy else []
        return estimate(load_shape(name), script_args("grpo", WORKLOAD_GRPO + flags + offload), "grpo")

    policies = ("embedding", "lm_head", "embedding,lm_head")
    shape = load_shape("qwen2.5-1.5b")
    assert shape.tied
    bf16_copy = ["--torch_dtype", "bfloat16", "--generation_copy", "--optim", "adamw_4bit"]
    for flags, weight_bytes in (([], 4), (bf16_copy, 2)):  # float32 weights: the workload's default
        none, got = est("qwen2.5-1.5b", flags), {policy: est("qwen2.5-1.5b", flags, policy) for policy in policies}
        assert got["lm_head"]["components"] == got["embedding"]["components"] == got["embedding,lm_head"]["components"]
        assert got["lm_head"]["peak_reserved"] == got["embedding"]["peak_reserved"] == got["embedding,lm_head"][
            "peak_reserved"] < none["peak_reserved"]
        assert got["lm_head"]["host_bytes"] == got["embedding"]["host_bytes"] > none["host_bytes"]
        moved = none["components"]["actor/weights"] - got["lm_head"]["components"]["actor/weights"]
        assert moved == shape.embedding_params * weight_bytes, flags

    shape = load_shape("qwen2.5-7b")
    assert not shape.tied
    weights = {policy: est("qwen2.5-7b", [], policy)["components"]["actor/weights"] for policy in (None,) + policies}
    matrix = shape.embedding_params * 4  # float32 weights: the workload's default
    assert weights[None] - weights["embedding"] == weights[None] - weights["lm_head"] == matrix
    assert weights[None] - weights["embedding,lm_head"] == 2 * matrix


def test_param_offload_time_charges_the_input_embedding_its_rows_and_a_head_the_whole_matrix():
    """--param_offload (utils/offload.py): an LM head crosses the host link whole three times a micro-batch, the
    input embedding only the distinct rows a micro-batch uses, there and back; a tied weight leaves with either name.
    Each offloaded matrix's optimizer step runs on the CPU (HOST_STEP_S a parameter, once per update). Generation (ParamOffload.resident) copies each offloaded matrix to the GPU once: one for a tied weight or one
    name, two for an untied embedding and head."""
    from utils.plan import GPUS, HOST_STEP_S, PARAM_OFFLOAD, embedding_rows

    host = GPUS["h200"]["host"] * PARAM_OFFLOAD

    def update(name, flags):
        args = script_args("grpo", WORKLOAD_GRPO + ["--per_device_train_batch_size", "16"] + flags)
        return estimate_time(load_shape(name), args, "grpo")["phases"]["actor_update"]

    for name in ("qwen2.5-7b", "qwen2.5-1.5b"):
        shape = load_shape(name)
        base = update(name, [])
        args = script_args("grpo", WORKLOAD_GRPO)
        T, rows = args.max_prompt_length + args.max_completion_length, args.prompts_per_step * args.num_generations
        n_mb = -(-rows // 16)
        step = shape.embedding_params * HOST_STEP_S  # one matrix's optimizer step on the CPU
        whole = 3 * n_mb * shape.embedding_params * 4 / host + step  # float32 weights: the workload's default
        used = 2 * n_mb * embedding_rows(shape.vocab, 16 * T) * shape.hidden * 4 / host + step
        got = {policy: update(name, ["--param_offload", "--offload_policy", policy]) - base
               for policy in ("embedding", "lm_head", "embedding,lm_head")}
        if shape.tied:
            assert got["embedding"] == got["lm_head"] == got["embedding,lm_head"] == pytest.approx(whole + used - step)
        else:
            assert got["embedding"] == pytest.approx(used) and got["lm_head"] == pytest.approx(whole)
            assert got["embedding,lm_head"] == pytest.approx(whole + used)
            assert used - step < (whole - step) / 10  # 16 x 768 tokens touch under a tenth of 152k rows
        generate = {policy: estimate_time(shape, script_args("grpo", WORKLOAD_GRPO + ["--generation_backend", "hf"] + (
            ["--param_offload", "--offload_policy", policy] if policy else [])), "grpo")["phases"]["generate"]
            for policy in ("", "embedding", "lm_head", "embedding,lm_head")}
        matrix = shape.embedding_params * 4 / host
        assert [generate[p] - generate[""] for p in ("embedding", "lm_head", "embedding,lm_head")] == pytest.approx(
            [matrix, matrix, matrix] if shape.tied else [matrix, matrix, 2 * matrix])
    assert embedding_rows(1000, 10) == pytest.approx(10, rel=0.01) and embedding_rows(1000, 10**6) == pytest.approx(1000)


def test_measured_summary_counts_held_out_runs_of_todays_code_only(capsys):
    """`python -m utils.plan --measured` ends with how many held-out runs are within the bounds (memory 10%, time
    25%); runs whose code path changed since (BUDGET_RUNS' `superseded`) are listed as `old code`, not counted; runs
    a memory term was fitted to count for time only."""
    import re

    from utils.plan import BUDGET_RUNS, HEAD_APART_FIT, main, measured_rows

    rows = measured_rows()
    assert [r for r in BUDGET_RUNS if r.get("superseded")]
    assert sum(kind == "old code" for kind, *_ in rows) == sum(bool(r.get("superseded")) for r in BUDGET_RUNS) + sum(
        flags in TIME_SUPERSEDED for _, _, flags, _, _ in TIME_FIT + TIME_HELD_OUT)
    main(["--measured"])
    out = capsys.readouterr().out
    assert out.count("  old code ") == sum(kind == "old code" for kind, *_ in rows)
    summary = re.search(r"memory within 10% in (\d+) of (\d+) runs, step time within 25% in (\d+) of (\d+)", out)
    held = [r for r in rows if r[0] == "held out"]
    time_only = [r for r in rows if r[0] == "time out"]  # memory fitted to them (HEAD_APART_FIT), time held out
    assert len(time_only) == len(HEAD_APART_FIT)
    assert int(summary[2]) == sum(bool(r[4]) for r in held)
    assert int(summary[4]) == sum(bool(r[5]) for r in held + time_only)
    outside = (int(summary[2]) - int(summary[1])) + (int(summary[4]) - int(summary[3]))
    assert len(re.findall(r"^  outside: ", out, re.M)) <= outside  # a run outside both bounds is listed once
