"""GRPO (Group Relative Policy Optimization) in one file, readable top to bottom.

    python train_grpo.py --debug                       # embedded tiny model + toy task, offline, CPU or 1 GPU
    python train_grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name openai/gsm8k --dataset_config main --prompt_column question \\
        --reward_funcs accuracy,format --use_gradient_checkpointing
    accelerate launch --multi_gpu --num_processes 4 train_grpo.py --use_gradient_checkpointing ...
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 8 train_grpo.py ...
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 4 train_grpo.py ...  # or fsdp2.yaml
    python train_grpo.py --config my_run.yaml --learning_rate 2e-6   # YAML of flag names; the command line wins

One step (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, Algorithm 1):
  1. generate --num_generations completions for each of --prompts_per_step prompts
  2. score them with the reward functions (and/or a reward model)
  3. reference logprobs for the k3 KL penalty (--beta > 0)
  4. advantages: reward minus its group's mean, optionally divided by a std (--scale_rewards)
  5. old-policy logprobs, only when each batch is used for --num_iterations > 1 updates
  6. clipped surrogate loss over micro-batches, one optimizer step per iteration
  7. log, save

Departures from the paper, all switchable: the loss normalisation is --loss_type (the paper's
per-sequence mean is `grpo`; `dr_grpo` and `dapo` remove its length bias, arXiv:2503.20783 and
arXiv:2503.14476); the upper clip bound can differ from the lower (--epsilon_high, DAPO's
clip-higher); truncated completions can be left out of the loss (--mask_truncated_completions).
Later variants, each beside what it changes: GSPO's sequence ratio (--importance_sampling_level),
the two-sided clip (--delta), the bias-corrected KL (--use_bias_correction_kl), the loss on the
top-entropy tokens (--top_entropy_quantile), DAPO's dynamic sampling (--dynamic_sampling) and
overlong penalty (--overlong_buffer_len), and the rollout correction (--rollout_importance_correction;
policy/rollout_train_logprob_diff is always logged).
"""

import dataclasses
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Literal, Optional

# SIGTERM/SIGINT from the first second on: during setup the run stops at once (exit 1: nothing trained,
# nothing saved); once steps run, the current step finishes and is saved first (exit 128 + signal)
if __name__ == "__main__":
    from utils.checkpoint import StopSignal

    StopSignal.install()

# CUDA allocator: segments that grow in place instead of new blocks per size, so memory freed by
# one phase (KV cache, logits) is reused by the next instead of fragmenting; set before CUDA starts.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

from utils.args import SharedArgs, apply_presets, check_shared_args, divisors


@dataclass
class Args(SharedArgs):  # the shared flags (model, placement, data, rewards, ...) are in utils/args.py
    # --- GRPO
    prompts_per_step: int = field(default=16, metadata={"help": "Prompts per step over all processes; each gets --num_generations completions."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the group, G); at least 2."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps on each generated batch (GRPO's mu); old logprobs are only computed when > 1."})
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = field(default="dapo", metadata={"help": "grpo: mean over each completion's tokens, then over completions; dr_grpo: sum / (completions x max_completion_length); dapo: sum / all tokens of the step."})
    scale_rewards: Literal["group", "batch", "none"] = field(default="group", metadata={"help": "Divide the advantage (reward - group mean) by the group's std, the whole batch's std, or nothing (Dr. GRPO)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range: the ratio is clipped at 1 - epsilon."})
    epsilon_high: Optional[float] = field(default=None, metadata={"help": "Upper clip range (DAPO clip-higher, e.g. 0.28); default: epsilon."})
    beta: float = field(default=0.04, metadata={"help": "Weight of the k3 KL penalty to the reference model; 0 loads no reference model."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions that hit max_completion_length without EOS out of the loss."})
    importance_sampling_level: Literal["token", "sequence"] = field(default="token", metadata={"help": "token: one ratio pi / pi_old per token; sequence: GSPO's one ratio per completion, exp(mean of its tokens' log-ratios), clipped as a whole (arXiv:2507.18071; its objective is --loss_type grpo). Equal to token when --num_iterations is 1 (the ratio is 1)."})
    use_bias_correction_kl: bool = field(default=False, metadata={"help": "Multiply the k3 KL term by the ratio pi / pi_old, so its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2, arXiv:2512.02556); TRL's default is on."})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Policy-gradient loss on the top rho of the step's tokens by entropy only (arXiv:2506.01939 uses 0.2; the KL term keeps every token); 1.0: all tokens. The entropies come from a no-grad forward before the update (the old_logprobs pass when --num_iterations > 1)."})
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO's dynamic sampling (arXiv:2503.14476): groups whose rewards are all equal (zero advantage) are dropped and more prompts generated, until the step holds --prompts_per_step groups whose rewards differ or --max_generation_rounds is reached (then dropped groups fill the rest)."})
    max_generation_rounds: int = field(default=10, metadata={"help": "With --dynamic_sampling: most rounds of --prompts_per_step prompts generated per step (verl's max_num_gen_batches)."})
    # --- this script's defaults for shared flags
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate of the policy (the tiny model's preset: 3e-3)."})
    output_dir: str = field(default="outputs/grpo", metadata={"help": "Checkpoints, metrics.jsonl and the final model (output_dir/final) go here."})
    run_name: str = field(default="lean-rl-grpo", metadata={"help": "Run name for the tracker."})


# Presets fill in only what the user did not set. The toy task needs large groups and a large
# learning rate (a 0.1M-parameter model from random weights); --debug on a real model is a smoke test.
TOY_PRESET = dict(learning_rate=3e-3, prompts_per_step=32, num_generations=16, per_device_train_batch_size=128,
                  max_completion_length=8, max_prompt_length=16, max_steps=250, save_steps=100)
DEBUG_PRESET = dict(prompts_per_step=2, num_generations=4, per_device_train_batch_size=4, max_steps=3,
                    max_completion_length=32)


# ----------------------------------------------------------------------------------------------
# RL math (kept here, in plain sight; tests/test_grpo_math.py checks it against loop references)


def compute_advantages(rewards, num_generations, scale_rewards, eps=1e-4):
    """Group-relative advantages. rewards: [N] with each group's G completions adjacent.

    A_i = r_i - mean(group), divided by the group's std (GRPO), the whole batch's std
    (scale_rewards=batch), or nothing (Dr. GRPO). std is the sample std (Bessel-corrected)."""
    grouped = rewards.view(-1, num_generations)  # [N / G, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + eps)
    return advantages.reshape(-1)


def k3_kl(logprobs, ref_logprobs):
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman 2020): exp(d) - d - 1, d = ref - logp."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def per_token_policy_loss(logprobs, old_logprobs, advantages, epsilon_low, epsilon_high, ref_logprobs=None, beta=0.0,
                          mask=None, importance_sampling_level="token", delta=None, use_bias_correction_kl=False,
                          weights=None):
    """Clipped surrogate (PPO) per token, plus beta * k3 KL to the reference.

    logprobs, old_logprobs, ref_logprobs: [B, C]; advantages: [B] (one per completion).
    importance_sampling_level "sequence" (GSPO, Zheng et al. 2025, arXiv:2507.18071): one
    ratio per completion, s_i = (pi(o_i) / pi_old(o_i))^(1/|o_i|) = exp(mean over its `mask`
    tokens of log(pi / pi_old)), clipped as a whole and put on each of its tokens; with loss_type
    grpo the step loss is GSPO's -1/N sum_i min(s_i A_i, clip(s_i) A_i), and d/d logp_t of a
    token is s_i A_i / |o_i|.
    delta (two-sided clip, INTELLECT-2, arXiv:2505.07291, as TRL; verl's dual clip clip_ratio_c,
    Ye et al. 2020, arXiv:1912.09729): the unclipped ratio is capped at delta, so a negative
    advantage's loss stops growing at delta |A|.
    use_bias_correction_kl (DeepSeek-V3.2, arXiv:2512.02556, as TRL): k3 times the ratio, so that
    on-policy its gradient is (logp - ref) d logp, the unbiased reverse-KL gradient.
    weights [B, C]: constant weights of the surrogate term (rollout importance weights, the
    top-entropy mask); the KL term is not weighted (as TRL).
    Returns loss [B, C], kl [B, C] (zeros when beta == 0) and is_clipped [B, C] (a clip is
    active: the ratio left [1 - eps_low, 1 + eps_high] in the direction the advantage pushes, or
    passed delta with a negative advantage)."""
    log_ratio = logprobs - old_logprobs  # [B, C]
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    ratio = torch.exp(log_ratio).expand_as(logprobs)  # [B, C]
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)  # [B, 1]
    capped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(capped_ratio * adv, clipped_ratio * adv)
    if weights is not None:
        loss = loss * weights
    kl = torch.zeros_like(logprobs)
    if beta > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        if use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + beta * kl
    is_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
    if delta is not None:
        is_clipped = is_clipped | ((ratio > delta) & (adv < 0))
    return loss, kl, is_clipped


def aggregate_loss(per_token_loss, loss_mask, loss_type, num_sequences, num_tokens, max_completion_length):
    """This micro-batch's share of the whole step's loss. Summed over all micro-batches of all
    processes it equals the loss of the full batch computed at once:
      grpo:    1/N sum_i 1/|o_i| sum_t l_it          (N: completions in the step)
      dr_grpo: 1/(N * L_max) sum_i sum_t l_it        (L_max: --max_completion_length)
      dapo:    1/(sum_i |o_i|) sum_i sum_t l_it      (all loss tokens in the step)"""
    masked = per_token_loss * loss_mask
    if loss_type == "grpo":
        return (masked.sum(1) / loss_mask.sum(1).clamp(min=1)).sum() / num_sequences
    if loss_type == "dr_grpo":
        return masked.sum() / (num_sequences * max_completion_length)
    if loss_type == "dapo":
        return masked.sum() / max(num_tokens, 1)
    raise ValueError(f"unknown loss_type {loss_type}")


def informative_groups(rewards, num_generations):
    """Groups whose rewards differ (std > 1e-6): the others have zero advantage and teach only
    through the KL term. rewards: [N], groups adjacent -> [N / G] bool."""
    return rewards.view(-1, num_generations).std(dim=1) > 1e-6


def choose_groups(informative, num_groups):
    """Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476: keep the prompts whose
    group is neither all right nor all wrong): the first `num_groups` informative groups of the
    step's rounds; short of that, the first others fill the rest. informative: [R * b] bool over
    the rounds' groups in generation order -> the chosen group indices [num_groups], in order."""
    order = torch.cat([informative.nonzero().flatten(), (~informative).nonzero().flatten()])
    return order[:num_groups].sort().values


def high_entropy_mask(entropy, mask, quantile, gather=lambda t: t):
    """Beyond the 80/20 rule (Wang et al. 2025, arXiv:2506.01939): the tokens whose entropy is
    in the top `quantile` (rho) of all the step's loss tokens on every process: entropy >= the
    (1 - rho) quantile (linear interpolation, as torch.quantile; rho 0: the highest only).
    entropy, mask: [B, C]; gather: concatenates a 1-D tensor over processes -> bool [B, C]."""
    values = gather(entropy[mask.bool()].float()).sort().values
    if values.numel() == 0:
        return torch.zeros_like(mask, dtype=torch.bool)
    position = (1 - quantile) * (values.numel() - 1)
    low = int(position)
    high = min(low + 1, values.numel() - 1)
    threshold = values[low] + (position - low) * (values[high] - values[low])
    return (entropy >= threshold) & mask.bool()


def rollout_importance_weights(train_logprobs, rollout_logprobs, mask, mode, clip):
    """Rollout correction: the tokens were sampled under the generating numerics (pi_rollout: the
    decoding loop, a bf16 --generation_copy, a compiled step), the loss assumes the training
    forward's (pi_old). Per-token weight rho = pi_old / pi_rollout (token_*), or the product over
    the completion's tokens (sequence_*), truncated at `clip` (*_truncate: TIS, Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training") or zeroed above it
    (*_mask: masked IS, Liu, Li et al. 2025, "When speed kills stability"), as TRL's
    vllm_importance_sampling_mode and verl's rollout_correction. A constant (no gradient).
    train_logprobs, rollout_logprobs, mask: [B, C] -> weights [B, C], and whether each was cut."""
    log_rho = (train_logprobs.detach() - rollout_logprobs) * mask  # [B, C]
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True).expand_as(mask)
    rho = torch.exp(log_rho)
    cut = rho > clip
    weights = rho.clamp(max=clip) if mode.endswith("truncate") else torch.where(cut, torch.zeros_like(rho), rho)
    return weights, cut


def overlong_penalty(lengths, max_completion_length, buffer_len, factor):
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, overlong reward shaping),
    times `factor`: 0 up to L_max - L_cache tokens, then linear down to -factor at L_max
    (= max_completion_length; no completion is longer). lengths: [B] tokens (EOS included) -> [B]."""
    return -factor * ((lengths.float() - (max_completion_length - buffer_len)) / buffer_len).clamp(min=0, max=1) + 0.0


# ----------------------------------------------------------------------------------------------
# Arguments: presets, derived sizes, validation (everything here runs before a model loads)


def check_args(args, num_processes, explicit=frozenset()):
    """Validate flags and derive per-process sizes; raises UsageError naming the flag. A
    micro-batch the user did not set shrinks to divide this process's completions."""
    from utils.cli import UsageError, apply_trl_generation_batch_size, apply_trl_gradient_accumulation

    apply_trl_generation_batch_size(args, explicit, args.num_generations)  # TRL's name, if given: checked
    check_shared_args(args, num_processes)
    if args.num_iterations < 1:
        raise UsageError(f"--num_iterations must be at least 1 (got {args.num_iterations})")
    if args.num_generations < 2:
        raise UsageError(
            f"--num_generations {args.num_generations}: GRPO's advantage is the reward minus its group's mean, "
            "so each prompt needs at least 2 completions"
        )
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    for name in ("epsilon", "epsilon_high"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0 (got {getattr(args, name)})")
    if args.beta < 0:
        raise UsageError(f"--beta must be >= 0 (got {args.beta})")
    if args.delta is not None and not args.delta > 1 + args.epsilon_high:
        raise UsageError(f"--delta {args.delta} must be > 1 + --epsilon_high ({1 + args.epsilon_high:g}): below it the "
                         "cap would also cut the upper clip")
    if not 0 <= args.top_entropy_quantile <= 1:
        raise UsageError(f"--top_entropy_quantile must be in [0, 1] (got {args.top_entropy_quantile})")
    if args.max_generation_rounds < 1:
        raise UsageError(f"--max_generation_rounds must be at least 1 (got {args.max_generation_rounds})")
    if args.importance_sampling_level == "sequence" and args.loss_type != "grpo":
        warnings.warn(f"--importance_sampling_level sequence with --loss_type {args.loss_type}: each completion's loss "
                      "is weighted by its length; GSPO's objective (a mean over completions) is --loss_type grpo")
    if args.prompts_per_step % num_processes:
        raise UsageError(
            f"--prompts_per_step {args.prompts_per_step} does not split over {num_processes} processes "
            "(every process generates whole groups); use a multiple of the process count"
        )
    local_completions = args.prompts_per_step // num_processes * args.num_generations
    apply_trl_gradient_accumulation(args, explicit, local_completions)  # TRL's name, if given: checked
    if local_completions % args.per_device_train_batch_size and "per_device_train_batch_size" not in explicit:
        args.per_device_train_batch_size = math.gcd(args.per_device_train_batch_size, local_completions)
    if local_completions % args.per_device_train_batch_size:
        raise UsageError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size} does not divide the {local_completions} "
            f"completions each process trains on per step (--prompts_per_step {args.prompts_per_step} x "
            f"--num_generations {args.num_generations} / {num_processes} processes); valid: {divisors(local_completions)}"
        )
    return local_completions


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from utils import data as data_utils
    from utils import rewards as reward_utils
    from utils.base import resolve_generation_backend, resolve_share_prompt_cache, unshareable_attention
    from utils.checkpoint import Checkpointer, resolve_resume
    from utils.cli import UsageError, fail, parse_args, quiet_library_warnings, set_cpu_threads
    from utils.completions import CompletionLogger
    from utils.engines import (backward, check_engine_args, configure_engine, engine_of, gathered_for_generation,
                               micro_batch_sync, prepare_frozen, replicas_comparable)
    from utils.generation import build_generation_config, generate_completions
    from utils.logger import MetricsLogger, check_report_to, first_last_line, rollout_metrics
    from utils.memory import (MemoryTracker, MicroBatchShrinker, OOMReport, PhaseTimer, StepProfile, StepSnapshot,
                              apply_memory_cap, gpu_peaks_line, host_peak_rss_gib)
    from utils.modeling import (DTYPES, apply_lora, check_attn_implementation, check_replicas_in_sync,
                                compile_repeated_blocks, eos_token_ids, frozen_dtype, load_causal_lm, load_tokenizer,
                                lora_kwargs, quantization_of, resolve_mixed_precision, check_model_paths)
    from utils.offload import OptimizerSwap, ParamOffload, enable_activation_offload, resident
    from utils.ops import batched_completion_logprobs, completion_logprobs, pad_cat, plan_micro_batches
    from utils.optim import NonFiniteGuard, build_optimizer, build_scheduler, clip_and_step
    from utils.placement import (Placement, devices_used, place_model, placement_table, prepare_trained,
                                 resolve_placements)
    from utils.plan import run_planner

    quiet_library_warnings()  # other libraries' start-up warnings that say nothing here (utils/cli.py)

    # ---- 1. arguments, checked before any model loads -------------------------------------------
    try:
        args, explicit = parse_args(Args, argv)
    except UsageError as e:
        fail(str(e))
    apply_presets(args, explicit, TOY_PRESET, DEBUG_PRESET)
    mixed_precision = resolve_mixed_precision(args.mixed_precision)
    accelerator = Accelerator(mixed_precision=mixed_precision, project_dir=args.output_dir,
                              log_with=None if args.report_to == "none" else args.report_to)
    is_main, num_processes, rank = accelerator.is_main_process, accelerator.num_processes, accelerator.process_index
    try:
        local_completions = check_args(args, num_processes, explicit)
        engine = engine_of(accelerator)  # single, ddp, zero2, zero3, fsdp2: from the accelerate config
        check_engine_args(args, engine)
        if args.plan or args.auto_memory:  # utils/plan.py: estimate memory, print the plan (--plan exits)
            extra = run_planner(args, "grpo", num_processes, accelerator.device, is_main, explicit, engine)
            args, explicit = parse_args(Args, list(sys.argv[1:] if argv is None else argv) + extra)
            apply_presets(args, explicit, TOY_PRESET, DEBUG_PRESET)
            local_completions = check_args(args, num_processes, explicit)
            check_engine_args(args, engine)
        check_attn_implementation(args.attn_implementation, accelerator.device.type == "cuda")
        check_report_to(args.report_to)
        check_model_paths(args)  # a folder, or a hub id in the cache (or on the hub, online)
        specs, reward_fns, reward_weights = reward_utils.resolve_rewards(
            args.reward_funcs, args.reward_weights, args.reward_model_name_or_path)
        placements = resolve_placements({"actor": args.actor_device, "ref": args.ref_device,
                                         "reward": args.reward_device}, accelerator.device,
                                        args.offload_execution_device, num_processes)
        dataset = data_utils.load_task_dataset(args, accelerator, answer_required="accuracy" in specs)
        reward_utils.check_reward_signatures(reward_fns, dataset.column_names, args.prompt_column, args.answer_column)
        resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir, accelerator)  # verified
    except UsageError as e:
        fail(str(e))
    # --gpu_memory: the allocator of every GPU this process uses held to that budget (a smaller card's)
    for line in apply_memory_cap(args.gpu_memory, devices_used(accelerator.device, placements)):
        if is_main:
            print(line, flush=True)
    set_cpu_threads(accelerator.device, toy_model=args.model_name_or_path is None, verbose=is_main)  # CPU: printed
    if args.debug and num_processes > 1:
        warnings.warn("--debug is meant for a single process")
    if args.max_steps < 0:
        args.max_steps = math.ceil(len(dataset) * args.num_train_epochs / args.prompts_per_step)
    mb = args.per_device_train_batch_size
    G = args.num_generations
    set_seed(args.seed, device_specific=True)  # each rank samples differently

    # ---- 2. models: policy (trained), reference and reward model (frozen), each where it is placed --
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code, args.tokenizer_name_or_path)
    train_dtype = DTYPES.get(args.torch_dtype, "auto")
    frozen = frozen_dtype(mixed_precision, train_dtype)
    home = placements["actor"].device  # rollout tensors live with the policy's inputs
    quantized = quantization_of(args, trained=True)  # QLoRA: the base weights in 4/8 bits, frozen
    model = load_causal_lm(args.model_name_or_path, tokenizer, frozen if quantized else train_dtype,
                           args.attn_implementation, args.trust_remote_code, args.disable_dropout, seed=args.seed,
                           quantization=quantized, device=home)
    if args.use_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.activation_offload:
            enable_activation_offload(model)
    if args.use_lora:
        model = apply_lora(model, **lora_kwargs(args))
    # train mode: from_pretrained returns eval mode, where transformers skips gradient checkpointing
    model = place_model(model, placements["actor"]).train()
    if args.torch_compile:
        compile_repeated_blocks(model)
    if args.param_offload:
        ParamOffload(model, args.offload_policy, home)
    # --generation_backend auto: the compiled, captured decoding step where the weights stay put on a GPU
    args.generation_backend, backend_reason = resolve_generation_backend(
        args.generation_backend, home.type, placements["actor"].kind, engine, args.param_offload, args.generation_copy,
        sum(p.numel() for p in model.parameters()), args.kv_cache_dtype, args.share_prompt_cache)
    # --share_prompt_cache unset: on where a group's completions decode in a captured step (one copy of the prompt's
    # keys and values per group)
    args.share_prompt_cache, share_reason = resolve_share_prompt_cache(
        args.share_prompt_cache, args.generation_backend, home.type, args.num_generations, args.kv_cache_dtype,
        placements["actor"].kind, model.config._attn_implementation, unshareable_attention(model.config),
        getattr(model, "_supports_attention_backend", False))
    table = [("actor", placements["actor"], True)]
    ref_model = None  # the frozen initial policy, for the KL penalty; with LoRA: the policy, adapter off
    if args.beta > 0 and args.use_lora:
        table.append(("ref", Placement("ref", "adapter", home), False))
    elif args.beta > 0:
        ref_model = load_causal_lm(args.model_name_or_path, tokenizer, frozen, args.attn_implementation,
                                   args.trust_remote_code, True, seed=args.seed, quantization=quantization_of(args),
                                   device=placements["ref"].device)
        ref_model = place_model(ref_model.requires_grad_(False).eval(), placements["ref"])
        if args.torch_compile:
            compile_repeated_blocks(ref_model)
        table.append(("ref", placements["ref"], False))
    reward_model = None
    if args.reward_model_name_or_path:
        reward_model = reward_utils.RewardModel(args.reward_model_name_or_path, placements["reward"], frozen,
                                                fallback_tokenizer=tokenizer, trust_remote_code=args.trust_remote_code,
                                                quantization=quantization_of(args))
        reward_fns.append((reward_model.name, reward_model))
        table.append(("reward", placements["reward"], False))
    reward_names = [name for name, _ in reward_fns] + (["overlong_penalty"] if args.overlong_buffer_len else [])
    reward_weights = torch.tensor(reward_weights + [1.0] * bool(args.overlong_buffer_len), device=home)  # [F]
    optimizer = build_optimizer(model, args.learning_rate, args.weight_decay, args.optim,
                                engine_master_weights=engine.startswith("zero"))
    optimizer_steps = args.max_steps * args.num_iterations
    scheduler = build_scheduler(optimizer, args.lr_scheduler_type, optimizer_steps,
                                args.warmup_steps or int(args.warmup_ratio * optimizer_steps))
    configure_engine(accelerator, args, engine)  # DeepSpeed: micro-batch size, clipping
    model, optimizer = prepare_trained(accelerator, model, optimizer, placements["actor"])
    ref_model = prepare_frozen(accelerator, ref_model, engine, mb)  # ZeRO-3: sharded too; else as placed
    if reward_model is not None:
        reward_model.model = prepare_frozen(accelerator, reward_model.model, engine, mb)
    accelerator.register_for_checkpointing(scheduler)  # not prepared: it steps once per optimizer step
    unwrapped = accelerator.unwrap_model(model)
    eos_ids = eos_token_ids(tokenizer, unwrapped)
    generation_config = build_generation_config(args.max_completion_length, args.temperature, args.top_p,
                                                args.top_k, tokenizer.pad_token_id, eos_ids)
    encode_prompts = data_utils.PromptEncoder(tokenizer, args.max_prompt_length, args.use_chat_template,
                                            args.system_prompt)
    checkpointer = Checkpointer(accelerator, args.output_dir, args.save_steps, args.save_total_limit,
                                enabled=args.save_strategy != "no", save_on_error=args.save_on_error)
    state = checkpointer.start(resume_path, {"total_skipped": 0, "skipped_in_a_row": 0},
                               data_position={"seed": args.seed, "prompts_per_step": args.prompts_per_step,
                                              "dataset_rows": len(dataset)})
    start_step = state.get("step", 0)
    optimizer_state = OptimizerSwap(optimizer, enabled=args.optimizer_offload)  # on the GPU for each step only
    optimizer_state.to_host()  # a resumed state was loaded onto the parameters' devices
    guard = NonFiniteGuard(args.max_skipped_steps, total=state.get("total_skipped", 0))
    guard.in_a_row = state["skipped_in_a_row"]
    logger = MetricsLogger(accelerator, args.output_dir, args.report_to, args.run_name, dataclasses.asdict(args),
                           start_step=start_step)
    completion_logger = CompletionLogger(accelerator, args.output_dir, args.report_to, args.num_completions_to_print,
                                         resumed_step=start_step if resume_path else None) if args.log_completions else None
    timer = PhaseTimer(home, empty_cache=args.empty_cache_between_phases)
    roles = {"actor": (model, optimizer), "ref": (ref_model, None),
             "reward": (reward_model and reward_model.model, None)}
    tracker = MemoryTracker(roles, args.log_memory_every, args.memory_report, is_main)  # where each role's bytes are
    snapshot = StepSnapshot(args.memory_snapshot, args.memory_snapshot_step)  # the allocator's history over one step
    profile = StepProfile(args.profile_step, args.output_dir, rank, num_processes, is_main)  # --profile_step: its kernels
    oom = OOMReport(args, "grpo", timer, tracker, num_processes, engine)  # explains an out-of-memory error, if one ends the run
    shrink = MicroBatchShrinker(args, args.auto_reduce_micro_batch, local_completions)  # OOM: halve and redo a pass
    chunk = args.logprob_chunk_size
    entropy_mode = ("checkpointed" if args.entropy_checkpointing else "grad") if args.entropy_coef > 0 else "metric"
    most_micro_batches = lambda n: int(accelerator.gather(torch.tensor([n], device=home)).max())  # noqa: E731
    if is_main:
        print(f"model {args.model_name_or_path or 'embedded tiny model (toy task)'} ({args.torch_dtype}"
              f"{', LoRA r=%d' % args.lora_r if args.use_lora else ''}{', base in ' + quantized if quantized else ''}"
              f"{', ' + unwrapped.lean_rl_param_offload.describe() if args.param_offload else ''}), optim {args.optim}, "
              f"rewards: {', '.join(n for n, _ in reward_fns)}\n{placement_table(table)}")
        print(f"generation: --generation_backend {args.generation_backend}"
              + (f" (auto: {backend_reason})" if backend_reason else "")
              + f"; --share_prompt_cache {'on' if args.share_prompt_cache else 'off'}"
              + (f" (auto: {share_reason})" if share_reason else ""))
        print(f"num_processes={num_processes} device={accelerator.device} mixed_precision={mixed_precision} | "
              f"{args.prompts_per_step} prompts x {G} generations per step; per process {local_completions} "
              f"completions in " + (f"micro-batches of <= {args.max_token_len_per_gpu} tokens" if args.use_dynamic_bsz
                                    else f"{local_completions // mb} micro-batches of {mb}")
              + f" | steps {start_step}->{args.max_steps}", flush=True)

    # ---- 3. training loop --------------------------------------------------------------------------
    reward_history = []
    local_prompts = args.prompts_per_step // num_processes  # groups each process trains on per step
    generation_rounds = state.get("generation_rounds", start_step)  # the data position: rounds of prompts drawn
    pad = tokenizer.pad_token_id

    def gather_tokens(values):  # a 1-D tensor of any length on each process -> all of them, concatenated
        padded = accelerator.gather(accelerator.pad_across_processes(values, dim=0, pad_index=-math.inf))
        return padded[padded > -math.inf]

    progress = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
                    disable=not is_main, desc="grpo", dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 30)
    for step in progress:
        checkpointer.begin_step(step)  # the RNG states a save after a failure in this step must hold
        timer.reset()
        snapshot.begin(step + 1)
        profile.begin(step + 1)
        oom.step = step + 1
        step_start = time.perf_counter()

        # 1-2. rounds of --prompts_per_step prompts: generate, score. One round without
        # --dynamic_sampling; with it (DAPO), rounds until every process holds its share of groups
        # whose rewards differ, or --max_generation_rounds
        rounds = []
        while True:
            raw_prompts, prompts, columns = data_utils.process_batch(
                dataset, generation_rounds, args.prompts_per_step, args.seed, rank, num_processes, args.prompt_column,
                args.answer_column, repeat=G)  # G copies of each prompt, adjacent
            generation_rounds += 1

            # 1. generate G completions per prompt
            with timer.phase("generate"):
                prompt_ids, prompt_mask = encode_prompts(raw_prompts, home)  # [b, P]
                prompt_ids = prompt_ids.repeat_interleave(G, 0)  # [B, P], B = b * G
                prompt_mask = prompt_mask.repeat_interleave(G, 0)
                with gathered_for_generation(engine, model, args.gather_for_generation):  # ZeRO-3, FSDP2
                    # sampling_logprobs: each token's logprob under the numerics that sampled it
                    completion_ids, completion_mask, is_truncated, sampling_logprobs = shrink.retry(
                        lambda: generate_completions(
                            unwrapped, prompt_ids, prompt_mask, generation_config, eos_ids, args.generation_slice_size,
                            args.generation_backend, keep_decoder=not args.empty_cache_between_phases,
                            from_copy=args.generation_copy, return_logprobs=True,
                            prefill_chunk_size=args.prefill_chunk_size, kv_cache_dtype=args.kv_cache_dtype,
                            copy_dtype=args.generation_copy_dtype,
                            copy_in_place=args.generation_copy_in_place, share_prompt_cache=args.share_prompt_cache),
                        "generate", kind="generation")  # [B, C] x2, [B], [B, C]

            # 2. rewards: every function on every completion (then DAPO's overlong penalty, --overlong_buffer_len)
            with timer.phase("reward"), resident(reward_model and reward_model.model):
                completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
                with checkpointer.user_code():  # the user's code: fails -> one block, the last finished step saved
                    rewards_per_func = reward_utils.score_completions(
                        reward_fns, completions, prompts, columns, home, completion_ids, completion_mask, step=step,
                        max_steps=args.max_steps, epoch=(generation_rounds - 1) * args.prompts_per_step / len(dataset))
                if args.overlong_buffer_len:
                    penalty = overlong_penalty(completion_mask.sum(1), args.max_completion_length,
                                               args.overlong_buffer_len, args.overlong_penalty_factor)  # [B]
                    rewards_per_func = torch.cat([rewards_per_func, penalty[:, None]], dim=1)  # [B, F]
            rounds.append(dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                               completion_mask=completion_mask, is_truncated=is_truncated,
                               sampling_logprobs=sampling_logprobs, rewards_per_func=rewards_per_func,
                               prompts=prompts, completions=completions))
            if not args.dynamic_sampling:
                break
            informative = torch.cat([informative_groups((r["rewards_per_func"] * reward_weights).nansum(dim=1), G)
                                     for r in rounds])  # [rounds * b], this process's groups in order
            ready = accelerator.reduce(informative.sum().clamp(max=local_prompts), reduction="sum").item()
            if ready == args.prompts_per_step or len(rounds) == args.max_generation_rounds:
                break

        # the step's batch: this process's share of groups, the rounds padded to common widths
        if args.dynamic_sampling:
            generated_rewards_per_func = torch.cat([r["rewards_per_func"] for r in rounds])  # [rounds * B, F]
            chosen = choose_groups(informative, local_prompts)  # [b]
            rows = (chosen[:, None] * G + torch.arange(G, device=chosen.device)).flatten()  # [B]
        else:
            rows = torch.arange(local_completions, device=home)
        batch = lambda key, **padding: pad_cat([r[key] for r in rounds], **padding)[rows]  # noqa: E731
        prompt_ids, prompt_mask = batch("prompt_ids", value=pad, left=True), batch("prompt_mask", left=True)
        completion_ids, completion_mask = batch("completion_ids", value=pad), batch("completion_mask")
        is_truncated, sampling_logprobs = batch("is_truncated"), batch("sampling_logprobs")
        rewards_per_func = batch("rewards_per_func")  # [B, F]
        prompts = [p for r in rounds for p in r["prompts"]]
        completions = [c for r in rounds for c in r["completions"]]
        prompts, completions = [prompts[i] for i in rows.tolist()], [completions[i] for i in rows.tolist()]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + C]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        C = completion_ids.shape[1]
        loss_mask = completion_mask.float()  # [B, C]
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~is_truncated).float().unsqueeze(1)
        # micro-batches: --per_device_train_batch_size rows, or a token budget (--use_dynamic_bsz);
        # each cut to the columns its rows use (no all-padding prompt or completion columns). A plan
        # is made per pass: --auto_reduce_micro_batch may shrink the sizes after an out-of-memory error
        make_plan = lambda: plan_micro_batches(  # noqa: E731
            attention_mask, C, batch_size=args.per_device_train_batch_size, num_batches_at_least=most_micro_batches,
            max_tokens=args.max_token_len_per_gpu if args.use_dynamic_bsz else None)

        # 3. reference logprobs (frozen initial policy) for the KL penalty
        ref_logprobs = None
        if args.beta > 0:
            ref_policy = unwrapped if ref_model is None else ref_model  # LoRA: the policy, adapter disabled
            with timer.phase("ref"), resident(ref_policy), \
                    unwrapped.disable_adapter() if ref_model is None else nullcontext():
                ref_logprobs = shrink.retry(lambda: batched_completion_logprobs(  # [B, C]
                    ref_policy, input_ids, attention_mask, make_plan(), args.temperature, chunk), "ref")

        # 4. group-relative advantages over the whole batch (rewards gathered), then this process's slice
        all_rewards_per_func = accelerator.gather(rewards_per_func)  # [N, F], groups adjacent
        all_rewards = (all_rewards_per_func * reward_weights).nansum(dim=1)  # [N]
        all_advantages = compute_advantages(all_rewards, G, args.scale_rewards)  # [N]
        advantages = all_advantages[rank * local_completions:(rank + 1) * local_completions]  # [B]

        # 5. old-policy logprobs: needed only when the batch serves several updates; the same no-grad
        # forward gives every token's entropy for --top_entropy_quantile (then run for it alone if need be)
        old_logprobs, entropy_mask = None, None
        if args.num_iterations > 1 or args.top_entropy_quantile < 1:
            want_entropy = args.top_entropy_quantile < 1
            phase = "old_logprobs" if args.num_iterations > 1 else "entropy"
            with timer.phase(phase), resident(unwrapped):
                out = shrink.retry(lambda: batched_completion_logprobs(
                    unwrapped, input_ids, attention_mask, make_plan(), args.temperature, chunk,
                    entropy=want_entropy), phase)
            old_logprobs, token_entropy = out if want_entropy else (out, None)
            if args.num_iterations == 1:
                old_logprobs = None  # one update: the ratio's denominator is the update's own logprob, detached
            if want_entropy:  # the policy-gradient term on the step's top-rho tokens by entropy
                entropy_mask = high_entropy_mask(token_entropy, loss_mask, args.top_entropy_quantile, gather_tokens)

        # 6. policy update: clipped surrogate over micro-batches, one optimizer step per iteration
        num_loss_tokens = accelerator.reduce(loss_mask.sum(), reduction="sum").item()
        num_sequences = args.prompts_per_step * G
        correct_rollout = args.rollout_importance_correction != "none"
        # token sums for logging: kl, clipped, entropy, loss tokens; |logp_train - logp_rollout| and its
        # tokens; rollout importance weights and the cut ones; high-entropy tokens
        sums = torch.zeros(9, device=home)
        largest_diff = torch.zeros((), device=home)  # max |logp_train - logp_rollout|
        grad_norms, losses = [], []
        with timer.phase("actor_update"):
            for iteration in range(args.num_iterations):

                def accumulate():  # this iteration's gradients over the micro-batches -> (loss, metric sums, max)
                    step_loss, step_sums = torch.zeros((), device=home), torch.zeros(9, device=home)
                    step_max = torch.zeros((), device=home)
                    plan = make_plan()
                    for i, micro in enumerate(plan):
                        last = i == len(plan) - 1  # all-reduce gradients on the last micro-batch only
                        with micro_batch_sync(accelerator, model, last):
                            logprobs, entropy = completion_logprobs(  # [b, c]
                                model, micro.window(input_ids), micro.window(attention_mask), micro.c,
                                args.temperature, entropy=entropy_mode, chunk_size=chunk)
                            old = micro.completion(old_logprobs) if old_logprobs is not None else logprobs.detach()
                            ref = micro.completion(ref_logprobs) if ref_logprobs is not None else None
                            mask = micro.completion(loss_mask)
                            # the rollout's numerics against the training forward's, on the same tokens
                            rollout = micro.completion(sampling_logprobs)
                            tokens = micro.completion(completion_mask).float()
                            diff = (old - rollout).abs() * tokens
                            is_weights, cut = torch.ones_like(mask), torch.zeros_like(mask, dtype=torch.bool)
                            if correct_rollout:  # --rollout_importance_correction: rho = pi_old / pi_rollout
                                is_weights, cut = rollout_importance_weights(old, rollout, mask,
                                                                             args.rollout_importance_correction,
                                                                             args.rollout_importance_clip)
                            high_entropy = torch.ones_like(mask)
                            if entropy_mask is not None:  # --top_entropy_quantile
                                high_entropy = micro.completion(entropy_mask).float()
                            weights = is_weights * high_entropy if correct_rollout or entropy_mask is not None else None
                            per_token, kl, is_clipped = per_token_policy_loss(
                                logprobs, old, micro.take(advantages), args.epsilon, args.epsilon_high, ref, args.beta,
                                mask=mask, importance_sampling_level=args.importance_sampling_level,
                                delta=args.delta, use_bias_correction_kl=args.use_bias_correction_kl, weights=weights)
                            if args.entropy_coef > 0:  # entropy bonus, normalised like the policy loss
                                per_token = per_token - args.entropy_coef * entropy
                            loss = aggregate_loss(per_token, mask, args.loss_type, num_sequences, num_loss_tokens,
                                                  args.max_completion_length)
                            # DDP averages gradients over processes; the loss above is already a global share
                            backward(accelerator, model, loss * num_processes, last)  # DeepSpeed: steps if last
                        step_loss += loss.detach()
                        step_sums += torch.stack([
                            (kl * mask).sum().detach(), (is_clipped * mask).sum(), (entropy.detach() * mask).sum(),
                            mask.sum(), diff.sum(), tokens.sum(), (is_weights * mask).sum(), (cut * mask).sum(),
                            (high_entropy * mask).sum()])
                        step_max = torch.maximum(step_max, diff.max())
                    return step_loss, step_sums, step_max

                # out of memory: gradients zeroed, micro-batches halved, the iteration redone (exact)
                step_loss, step_sums, step_max = shrink.retry(accumulate, "actor_update", optimizers=[optimizer])
                sums += step_sums
                largest_diff = torch.maximum(largest_diff, step_max)
                with optimizer_state.resident():  # --optimizer_offload: the moments in for the step, then out
                    grad_norm, finite = clip_and_step(accelerator, model, optimizer, scheduler, args.max_grad_norm,
                                                      step_loss)
                guard.record(finite, step)
                grad_norms.append(grad_norm)
                losses.append(step_loss)

        # 7. metrics: one reduction for the update sums, gathered tensors for the rest. The rewards are
        # those of every completion generated (all rounds): the policy's, not the chosen batch's
        global_sums = accelerator.reduce(sums, reduction="sum")
        if args.dynamic_sampling:  # every round's completions; with one round they are the batch, gathered above
            generated_rewards_per_func = accelerator.gather(generated_rewards_per_func)  # [rounds * N, F]
            generated_rewards = (generated_rewards_per_func * reward_weights).nansum(dim=1)
        else:
            generated_rewards_per_func, generated_rewards = all_rewards_per_func, all_rewards
        reward_history.append(generated_rewards.mean().item())
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            tokens = max(global_sums[3].item(), 1.0)
            metrics = {
                "reward/mean": generated_rewards.mean().item(),
                "reward/std": generated_rewards.std().item(),
                "reward/frac_zero_std": (~informative_groups(generated_rewards, G)).float().mean().item(),
                "advantage/std": all_advantages.std().item(),
                "advantage/min": all_advantages.min().item(),
                "advantage/max": all_advantages.max().item(),
                "loss/policy": accelerator.reduce(losses[-1], reduction="sum").item(),
                "policy/kl": global_sums[0].item() / tokens,
                "policy/clipfrac": global_sums[1].item() / tokens,
                "policy/entropy": global_sums[2].item() / tokens,
                # pi_rollout vs the training forward on the sampled tokens: what --rollout_importance_correction corrects
                "policy/rollout_train_logprob_diff/mean": global_sums[4].item() / max(global_sums[5].item(), 1.0),
                "policy/rollout_train_logprob_diff/max": accelerator.gather(largest_diff[None]).max().item(),
                "optim/lr": scheduler.get_last_lr()[0],
                "optim/grad_norm": torch.stack(grad_norms).mean().item(),
                "optim/skipped_steps": guard.total,
                "memory/host_peak_rss_gib": host_peak_rss_gib(),
                "memory/auto_reductions": shrink.reductions,
            }
            if correct_rollout:
                metrics["policy/rollout_is_weight_mean"] = global_sums[6].item() / tokens
                metrics["policy/rollout_is_cut_frac"] = global_sums[7].item() / tokens
            if entropy_mask is not None:
                metrics["policy/high_entropy_frac"] = global_sums[8].item() / tokens
            if args.dynamic_sampling:  # groups (prompts) of this step's rounds, over all processes
                counts = accelerator.reduce(torch.stack([informative.sum(), informative[chosen].sum()]), reduction="sum")
                informative_total, used = counts.tolist()
                generated = len(rounds) * args.prompts_per_step
                metrics |= {"dynamic_sampling/rounds": len(rounds), "dynamic_sampling/prompts_generated": generated,
                            "dynamic_sampling/prompts_used": used,  # rewards differ, trained on
                            "dynamic_sampling/prompts_dropped": generated - informative_total - (args.prompts_per_step - used),
                            "dynamic_sampling/prompts_filler": args.prompts_per_step - used,  # equal rewards, trained on
                            "dynamic_sampling/prompts_unused": informative_total - used,  # rewards differ, batch full
                            "dynamic_sampling/prompts_drawn_total": generation_rounds * args.prompts_per_step}
            metrics |= rollout_metrics(accelerator, completion_mask, is_truncated, generated_rewards_per_func,
                                       reward_names)
            logger.log_step(metrics, step + 1, timer, step_start, verbose=args.debug)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['policy/kl']:.3g}")
            if completion_logger is not None:  # --log_completions
                completion_logger.log(step + 1, prompts, completions, rewards_per_func, reward_names,
                                      all_rewards[rank * local_completions:(rank + 1) * local_completions], advantages)
            if args.debug and is_main and step % 25 == 0:
                tqdm.write(f"  sample: {str(prompts[0])!r} -> {completions[0]!r} "
                           f"(reward {rewards_per_func[0].tolist()})")

        snapshot.end()
        profile.end()
        tracker.after_step(step + 1, timer.metrics)  # --log_memory_every: the per-role table

        # 8. save: every --save_steps, and on SIGTERM/SIGINT (then exit); the data position goes with it
        trainer_state = {"total_skipped": guard.total, "skipped_in_a_row": guard.in_a_row,
                         "generation_rounds": generation_rounds}
        signum = checkpointer.after_step(step + 1, args.max_steps, trainer_state)
        if signum:
            logger.close()
            sys.exit(128 + signum)

    # ---- 4. the end: last checkpoint, final model, replicas checked -----------------------------------
    progress.close()
    checkpointer.save(args.max_steps, {"total_skipped": guard.total, "skipped_in_a_row": guard.in_a_row,
                                       "generation_rounds": generation_rounds})
    final_dir = checkpointer.save_model(model, tokenizer)  # None with --save_strategy no
    if replicas_comparable(engine):  # every rank holds the whole model: all must be equal
        check_replicas_in_sync(accelerator, model)
    if is_main and reward_history:
        print(first_last_line(reward_history, final_dir), flush=True)
    if torch.cuda.is_available():
        print(f"[rank {rank}] peak GPU memory allocated: {gpu_peaks_line(timer)}", flush=True)
    tracker.finish()  # the last table, and --memory_report's files
    logger.close()


if __name__ == "__main__":
    main()
