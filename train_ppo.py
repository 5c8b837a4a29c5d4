"""PPO for LLMs with an actor, a critic, a reward (model and/or rule functions) and a reference,
each placed where it fits, in one file, readable top to bottom.

    python train_ppo.py --debug                       # embedded tiny actor/critic + toy task, offline, CPU or 1 GPU
    python train_ppo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --reward_model_name_or_path my-org/my-reward-model --dataset_name my_prompts.jsonl
    accelerate launch --multi_gpu --num_processes 4 train_ppo.py --use_gradient_checkpointing ...
    accelerate launch --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 4 train_ppo.py ...  # or fsdp2.yaml
    # four roles on four GPUs, one process:
    python train_ppo.py --actor_device cuda:0 --critic_device cuda:1 --reward_device cuda:2 --ref_device cuda:3 ...

One step (Ouyang et al. 2022, arXiv:2203.02155; details as in Huang et al., "The N Implementation
Details of RLHF with PPO", arXiv:2403.17031):
  1. generate one completion per prompt (cut after --stop_token)
  2. score it: reward model at the last real token and/or rule rewards, weighted;
     --missing_eos_penalty for completions that never stopped
  3. old logprobs (actor), reference logprobs (no reference model when kl_coef is 0), values (critic)
  4. per-token reward: -kl_coef * KL(actor || ref) on every token, plus the score on the last
  5. GAE (--gamma, --lam) advantages, whitened; returns = advantages + values
  6. --ppo_epochs passes of --num_mini_batches mini-batches: clipped policy loss (actor) and
     clipped value loss (critic), one optimizer step each per mini-batch
  7. adaptive KL coefficient (--target_kl), log, save

Departures: the critic is a separate model with its own optimizer (so it can live on another
device), so --vf_coef scales the critic's loss alone; every completion ends at its last token
(no value bootstrap past max_completion_length); losses are token means over the whole
mini-batch on all processes, so micro-batching does not change them. As in train_grpo.py:
--delta (dual clip), --overlong_buffer_len (DAPO's overlong penalty), --rollout_importance_correction
(policy/rollout_train_logprob_diff is always logged), --log_completions.
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
    # --- critic
    critic_model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Critic: a reward-model or causal-LM checkpoint (a scalar value head is added); default: the actor's weights."})
    critic_device: Optional[str] = field(default=None, metadata={"help": "Critic placement: cpu, cuda:N, balanced or swap (pinned CPU memory, copied to --offload_execution_device for the values phase and for each critic update, the weights copied back after it, its optimizer state on the GPU for the step only; one process); default: the process's device."})
    critic_learning_rate: Optional[float] = field(default=None, metadata={"help": "Critic peak learning rate; default: --learning_rate."})
    # --- PPO
    prompts_per_step: int = field(default=64, metadata={"help": "Prompts per step (rollout batch) over all processes, one completion each."})
    num_mini_batches: int = field(default=1, metadata={"help": "Mini-batches per PPO epoch; one optimizer step each for actor and critic."})
    ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout batch."})
    cliprange: float = field(default=0.2, metadata={"help": "Policy ratio clip range: [1 - cliprange, 1 + cliprange]."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the rollout's values."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss (the critic's loss)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    kl_coef: float = field(default=0.05, metadata={"help": "Weight of the per-token KL penalty to the reference, folded into the rewards (initial value when --target_kl is set)."})
    kl_estimator: Literal["k1", "k3"] = field(default="k1", metadata={"help": "Per-token KL estimator: k1 = logp - ref_logp, k3 = exp(ref - logp) - (ref - logp) - 1."})
    target_kl: Optional[float] = field(default=None, metadata={"help": "Adapt kl_coef so the per-sequence KL tracks this target (Ziegler et al. 2019); unset: fixed kl_coef."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller, in samples."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the per-token rewards before GAE."})
    missing_eos_penalty: Optional[float] = field(default=None, metadata={"help": "Subtract this from the score of completions that end without EOS / --stop_token."})
    stop_token: str = field(default="eos", metadata={"help": "Completions end after this token: `eos`, or any text that is a single token (e.g. a newline)."})
    # --- this script's defaults for shared flags
    learning_rate: float = field(default=3e-6, metadata={"help": "Actor peak learning rate (the tiny model's preset: 1e-3)."})
    output_dir: str = field(default="outputs/ppo", metadata={"help": "Checkpoints, metrics.jsonl and the final actor (output_dir/final) go here."})
    run_name: str = field(default="lean-rl-ppo", metadata={"help": "Run name for the tracker."})


# Presets fill in only what the user did not set (see train_grpo.py).
TOY_PRESET = dict(learning_rate=1e-3, critic_learning_rate=3e-3, prompts_per_step=256, num_mini_batches=4,
                  per_device_train_batch_size=64, ppo_epochs=2, max_completion_length=8, max_prompt_length=16,
                  max_steps=200, kl_coef=0.01, save_steps=100)
DEBUG_PRESET = dict(prompts_per_step=4, num_mini_batches=1, per_device_train_batch_size=4, ppo_epochs=1,
                    max_steps=3, max_completion_length=32)


# ----------------------------------------------------------------------------------------------
# RL math (kept here, in plain sight; tests/test_ppo_math.py checks it against loop references)


def per_token_kl(logprobs, ref_logprobs, estimator):
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens: k1 = log(pi / pi_ref),
    k3 = r - log r - 1 with r = pi_ref / pi (Schulman 2020). [B, C]"""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    return torch.exp(log_ratio) - log_ratio - 1


def token_rewards(scores, kl, mask, kl_coef):
    """Per-token rewards: -kl_coef * kl on every completion token, plus the sequence's score on
    its last real token. scores: [B]; kl, mask: [B, C] -> [B, C] (0 on padding)."""
    rewards = -kl_coef * kl * mask
    last = mask.sum(1).long() - 1  # index of the last non-pad token
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards


def compute_gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438), masked.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, with
    V and A zero past each completion's last token (the episode ends there).
    rewards, values, mask: [B, C]. Returns advantages, returns = advantages + values ([B, C])."""
    values = values * mask
    rewards = rewards * mask
    length = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t + 1 < length else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, mask, cliprange, num_tokens, delta=None, weights=None):
    """PPO clipped surrogate, summed over this micro-batch's tokens / num_tokens (all tokens of
    the mini-batch on all processes). delta: dual clip (Ye et al. 2020, arXiv:1912.09729; TRL's
    delta): the unclipped ratio is capped at delta, so a negative advantage's loss stops growing at
    delta |A|. weights [B, C]: constant per-token weights (rollout importance weights). Returns
    loss, clipped-token count (a clip or the cap is active), approx-KL sum."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * (ratio if delta is None else torch.clamp(ratio, max=delta))
    clipped = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    per_token = torch.max(unclipped, clipped)
    if weights is not None:
        per_token = per_token * weights
    loss = (per_token * mask).sum() / num_tokens
    is_clipped = clipped > unclipped
    if delta is not None:
        is_clipped = is_clipped | ((ratio > delta) & (advantages < 0))
    clipfrac = (is_clipped.float() * mask).sum()
    approx_kl = (0.5 * log_ratio.detach() ** 2 * mask).sum()  # the low-variance k2 estimator
    return loss, clipfrac, approx_kl


def value_loss(values, old_values, returns, mask, cliprange_value, num_tokens):
    """Clipped value loss 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2), summed over this
    micro-batch's tokens / num_tokens. Returns loss and the count of tokens where the clip bit."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * (torch.max(unclipped_loss, clipped_loss) * mask).sum() / num_tokens
    clipfrac = ((clipped_loss > unclipped_loss).float() * mask).sum()
    return loss, clipfrac


def update_kl_coef(kl_coef, observed_kl, target_kl, num_samples, horizon):
    """Adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593, section 2.2)."""
    error = min(max(observed_kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + error * num_samples / horizon)


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
    micro-batch the user did not set shrinks to divide this process's mini-batch."""
    from utils.cli import UsageError, apply_trl_generation_batch_size, apply_trl_gradient_accumulation

    apply_trl_generation_batch_size(args, explicit, 1)  # TRL's name, if given: checked
    check_shared_args(args, num_processes)
    if args.critic_learning_rate is None:
        args.critic_learning_rate = args.learning_rate
    if (args.critic_device or "").strip().lower() == "swap" and args.param_offload:
        raise UsageError("--critic_device swap with --param_offload: a swapped critic moves whole, its offloaded "
                         "modules would move twice; choose one")
    for name in ("num_mini_batches", "ppo_epochs", "kl_horizon"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    for name in ("critic_learning_rate", "cliprange", "cliprange_value"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0 (got {getattr(args, name)})")
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            raise UsageError(f"--{name} must be in [0, 1] (got {getattr(args, name)})")
    for name in ("kl_coef", "vf_coef"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if args.target_kl is not None and not args.target_kl > 0:
        raise UsageError(f"--target_kl must be > 0 (got {args.target_kl})")
    if args.delta is not None and not args.delta > 1 + args.cliprange:
        raise UsageError(f"--delta {args.delta} must be > 1 + --cliprange ({1 + args.cliprange:g}): below it the cap "
                         "would also cut the upper clip")
    if args.missing_eos_penalty is not None and args.missing_eos_penalty < 0:
        raise UsageError(f"--missing_eos_penalty must be >= 0, it is subtracted (got {args.missing_eos_penalty})")
    if args.prompts_per_step % num_processes:
        raise UsageError(f"--prompts_per_step {args.prompts_per_step} does not split over {num_processes} "
                         "processes; use a multiple of the process count")
    local = args.prompts_per_step // num_processes
    if local % args.num_mini_batches:
        raise UsageError(f"--num_mini_batches {args.num_mini_batches} does not divide the {local} completions each "
                         f"process holds per step (--prompts_per_step {args.prompts_per_step} / {num_processes} processes)")
    mini = local // args.num_mini_batches
    apply_trl_gradient_accumulation(args, explicit, mini)  # TRL's name, if given: checked
    if mini % args.per_device_train_batch_size and "per_device_train_batch_size" not in explicit:
        args.per_device_train_batch_size = math.gcd(args.per_device_train_batch_size, mini)
    if mini % args.per_device_train_batch_size:
        raise UsageError(f"--per_device_train_batch_size {args.per_device_train_batch_size} does not divide the "
                         f"{mini} completions of a mini-batch on each process ({local} / --num_mini_batches "
                         f"{args.num_mini_batches}); valid: {divisors(mini)}")
    return local, mini


def stop_token_ids(stop_token, tokenizer):
    """--stop_token -> the token id(s) that end a completion (checked once the tokenizer loads)."""
    from utils.cli import UsageError

    if stop_token == "eos":
        return []
    ids = tokenizer(stop_token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise UsageError(f"--stop_token {stop_token!r} is {len(ids)} tokens for this tokenizer; it must be exactly one "
                         "(or `eos`)")
    return ids


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
                                check_same_vocabulary, compile_repeated_blocks, eos_token_ids, frozen_dtype,
                                load_causal_lm, load_tokenizer, load_value_model, lora_kwargs, quantization_of,
                                resolve_mixed_precision, check_model_paths)
    from utils.offload import OptimizerSwap, ParamOffload, enable_activation_offload, resident
    from utils.ops import (batched_completion_logprobs, completion_logprobs, completion_values, masked_sum,
                           masked_whiten, plan_micro_batches)
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
        local_size, mini_size = check_args(args, num_processes, explicit)
        engine = engine_of(accelerator)  # single, ddp, zero2, zero3, fsdp2: from the accelerate config
        check_engine_args(args, engine, trained_roles=("actor", "critic"))
        if args.plan or args.auto_memory:  # utils/plan.py: estimate memory, print the plan (--plan exits)
            extra = run_planner(args, "ppo", num_processes, accelerator.device, is_main, explicit, engine)
            args, explicit = parse_args(Args, list(sys.argv[1:] if argv is None else argv) + extra)
            apply_presets(args, explicit, TOY_PRESET, DEBUG_PRESET)
            local_size, mini_size = check_args(args, num_processes, explicit)
            check_engine_args(args, engine, trained_roles=("actor", "critic"))
        check_attn_implementation(args.attn_implementation, accelerator.device.type == "cuda")
        check_report_to(args.report_to)
        check_model_paths(args)  # a folder, or a hub id in the cache (or on the hub, online)
        specs, reward_fns, reward_weights = reward_utils.resolve_rewards(
            args.reward_funcs, args.reward_weights, args.reward_model_name_or_path)
        placements = resolve_placements({"actor": args.actor_device, "critic": args.critic_device,
                                         "ref": args.ref_device, "reward": args.reward_device},
                                        accelerator.device, args.offload_execution_device, num_processes)
        dataset = data_utils.load_task_dataset(args, accelerator, answer_required="accuracy" in specs)
        reward_utils.check_reward_signatures(reward_fns, dataset.column_names, args.prompt_column, args.answer_column)
        resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir, accelerator)  # verified
        tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code, args.tokenizer_name_or_path)
        stop_ids = stop_token_ids(args.stop_token, tokenizer)
        check_same_vocabulary(args.critic_model_name_or_path, "--critic_model_name_or_path", tokenizer,
                              args.trust_remote_code)
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
    set_seed(args.seed, device_specific=True)  # each rank samples differently

    # ---- 2. models: actor and critic (trained), reference and reward model (frozen) ------------------
    train_dtype = DTYPES.get(args.torch_dtype, "auto")
    frozen = frozen_dtype(mixed_precision, train_dtype)
    quantized = quantization_of(args, trained=True)  # QLoRA: base weights in 4/8 bits, frozen
    actor = load_causal_lm(args.model_name_or_path, tokenizer, frozen if quantized else train_dtype,
                           args.attn_implementation, args.trust_remote_code, args.disable_dropout, seed=args.seed,
                           quantization=quantized, device=placements["actor"].device)
    critic = load_value_model(args.critic_model_name_or_path or args.model_name_or_path, tokenizer,
                              frozen if quantized else train_dtype, args.attn_implementation, args.trust_remote_code,
                              args.disable_dropout, seed=args.seed, lora=lora_kwargs(args), quantization=quantized,
                              device=placements["critic"].device)
    if args.use_gradient_checkpointing:
        for model in (actor, critic):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if args.activation_offload:
                enable_activation_offload(model)
    if args.use_lora:
        actor = apply_lora(actor, **lora_kwargs(args))
    # train mode: from_pretrained returns eval mode, where transformers skips gradient checkpointing
    actor = place_model(actor, placements["actor"]).train()
    critic = place_model(critic, placements["critic"]).train()
    if args.torch_compile:
        for model in (actor, critic):
            compile_repeated_blocks(model)
    if args.param_offload:
        ParamOffload(actor, args.offload_policy, placements["actor"].device)
        ParamOffload(critic, args.offload_policy, placements["critic"].device, strict=False)
    # --generation_backend auto: the compiled, captured decoding step where the weights stay put on a GPU
    args.generation_backend, backend_reason = resolve_generation_backend(
        args.generation_backend, placements["actor"].device.type, placements["actor"].kind, engine, args.param_offload,
        args.generation_copy, sum(p.numel() for p in actor.parameters()), args.kv_cache_dtype, args.share_prompt_cache)
    # --share_prompt_cache unset: off (each prompt has one completion: nothing to share)
    args.share_prompt_cache, share_reason = resolve_share_prompt_cache(
        args.share_prompt_cache, args.generation_backend, placements["actor"].device.type, 1, args.kv_cache_dtype,
        placements["actor"].kind, actor.config._attn_implementation, unshareable_attention(actor.config),
        getattr(actor, "_supports_attention_backend", False))
    home = placements["actor"].device  # rollout tensors live with the actor's inputs
    table = [("actor", placements["actor"], True), ("critic", placements["critic"], True)]
    use_ref = args.kl_coef > 0 or args.target_kl is not None
    ref_model = None  # the frozen initial policy, for the KL penalty; with LoRA: the actor, adapter off
    if use_ref and args.use_lora:
        table.append(("ref", Placement("ref", "adapter", home), False))
    elif use_ref:
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
    optimizer_steps = args.max_steps * args.ppo_epochs * args.num_mini_batches
    warmup = args.warmup_steps or int(args.warmup_ratio * optimizer_steps)
    master = engine.startswith("zero")  # DeepSpeed keeps fp32 master weights itself
    actor_optimizer = build_optimizer(actor, args.learning_rate, args.weight_decay, args.optim, engine_master_weights=master)
    critic_optimizer = build_optimizer(critic, args.critic_learning_rate, args.weight_decay, args.optim,
                                       engine_master_weights=master)
    actor_scheduler = build_scheduler(actor_optimizer, args.lr_scheduler_type, optimizer_steps, warmup)
    critic_scheduler = build_scheduler(critic_optimizer, args.lr_scheduler_type, optimizer_steps, warmup)
    configure_engine(accelerator, args, engine)  # DeepSpeed: micro-batch size, clipping
    actor, actor_optimizer = prepare_trained(accelerator, actor, actor_optimizer, placements["actor"])
    critic, critic_optimizer = prepare_trained(accelerator, critic, critic_optimizer, placements["critic"])
    ref_model = prepare_frozen(accelerator, ref_model, engine, mb)  # ZeRO-3: sharded too; else as placed
    if reward_model is not None:
        reward_model.model = prepare_frozen(accelerator, reward_model.model, engine, mb)
    accelerator.register_for_checkpointing(actor_scheduler, critic_scheduler)
    unwrapped_actor, unwrapped_critic = accelerator.unwrap_model(actor), accelerator.unwrap_model(critic)
    critic_swap = getattr(unwrapped_critic, "lean_rl_swap", None)  # --critic_device swap: utils/offload.py PhaseSwap
    eos_ids = sorted(set(eos_token_ids(tokenizer, unwrapped_actor) + stop_ids))
    generation_config = build_generation_config(args.max_completion_length, args.temperature, args.top_p,
                                                args.top_k, tokenizer.pad_token_id, eos_ids)
    encode_prompts = data_utils.PromptEncoder(tokenizer, args.max_prompt_length, args.use_chat_template,
                                            args.system_prompt)
    checkpointer = Checkpointer(accelerator, args.output_dir, args.save_steps, args.save_total_limit,
                                enabled=args.save_strategy != "no", save_on_error=args.save_on_error)
    state = checkpointer.start(resume_path, {"total_skipped": 0, "skipped_in_a_row": 0, "kl_coef": args.kl_coef},
                               data_position={"seed": args.seed, "prompts_per_step": args.prompts_per_step,
                                              "dataset_rows": len(dataset)})
    start_step, kl_coef = state.get("step", 0), state.get("kl_coef", args.kl_coef)
    # --optimizer_offload (and a swapped critic's): the moments on the GPU for each optimizer step only
    actor_state = OptimizerSwap(actor_optimizer, enabled=args.optimizer_offload)
    critic_state = OptimizerSwap(critic_optimizer, enabled=args.optimizer_offload or critic_swap is not None)
    actor_state.to_host()  # a resumed state was loaded onto the parameters' devices
    critic_state.to_host()
    guard = NonFiniteGuard(args.max_skipped_steps, total=state.get("total_skipped", 0))
    guard.in_a_row = state["skipped_in_a_row"]
    logger = MetricsLogger(accelerator, args.output_dir, args.report_to, args.run_name, dataclasses.asdict(args),
                           start_step=start_step)
    completion_logger = CompletionLogger(accelerator, args.output_dir, args.report_to, args.num_completions_to_print,
                                         resumed_step=start_step if resume_path else None) if args.log_completions else None
    timer = PhaseTimer(home, empty_cache=args.empty_cache_between_phases)
    roles = {"actor": (actor, actor_optimizer), "critic": (critic, critic_optimizer), "ref": (ref_model, None),
             "reward": (reward_model and reward_model.model, None)}
    tracker = MemoryTracker(roles, args.log_memory_every, args.memory_report, is_main)  # where each role's bytes are
    snapshot = StepSnapshot(args.memory_snapshot, args.memory_snapshot_step)  # the allocator's history over one step
    profile = StepProfile(args.profile_step, args.output_dir, rank, num_processes, is_main)  # --profile_step: its kernels
    oom = OOMReport(args, "ppo", timer, tracker, num_processes, engine)  # explains an out-of-memory error, if one ends the run
    shrink = MicroBatchShrinker(args, args.auto_reduce_micro_batch, local_size)  # OOM: halve and redo a pass
    chunk = args.logprob_chunk_size
    entropy_mode = ("checkpointed" if args.entropy_checkpointing else "grad") if args.entropy_coef > 0 else "metric"
    most_micro_batches = lambda n: int(accelerator.gather(torch.tensor([n], device=home)).max())  # noqa: E731
    token_budget = args.max_token_len_per_gpu if args.use_dynamic_bsz else None
    sum_over_processes = lambda t: accelerator.reduce(t, reduction="sum")  # noqa: E731
    if is_main:
        print(f"actor {args.model_name_or_path or 'embedded tiny model (toy task)'} ({args.torch_dtype}"
              f"{', LoRA r=%d' % args.lora_r if args.use_lora else ''}), critic "
              f"{args.critic_model_name_or_path or 'actor weights + value head'}, rewards: "
              f"{', '.join(n for n, _ in reward_fns)}\n{placement_table(table)}")
        print(f"generation: --generation_backend {args.generation_backend}"
              + (f" (auto: {backend_reason})" if backend_reason else "")
              + f"; --share_prompt_cache {'on' if args.share_prompt_cache else 'off'}"
              + (f" (auto: {share_reason})" if share_reason else ""))
        print(f"num_processes={num_processes} device={accelerator.device} mixed_precision={mixed_precision} | "
              f"{args.prompts_per_step} prompts per step; per process {local_size} completions, "
              f"{args.ppo_epochs} epochs x {args.num_mini_batches} mini-batches of {mini_size} in micro-batches of "
              + (f"<= {token_budget} tokens" if token_budget else f"{mb}") + f" | steps {start_step}->{args.max_steps}"
              + f" | optim {args.optim}", flush=True)

    # ---- 3. training loop --------------------------------------------------------------------------
    score_history = []
    progress = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
                    disable=not is_main, desc="ppo", dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 30)
    for step in progress:
        checkpointer.begin_step(step)  # the RNG states a save after a failure in this step must hold
        timer.reset()
        snapshot.begin(step + 1)
        profile.begin(step + 1)
        oom.step = step + 1
        step_start = time.perf_counter()
        raw_prompts, prompts, columns = data_utils.process_batch(
            dataset, step, args.prompts_per_step, args.seed, rank, num_processes, args.prompt_column,
            args.answer_column)

        # 1. rollout: one completion per prompt, ending at EOS or --stop_token
        with timer.phase("generate"):
            prompt_ids, prompt_mask = encode_prompts(raw_prompts, home)  # [B, P]
            with gathered_for_generation(engine, actor, args.gather_for_generation):  # ZeRO-3, FSDP2
                # sampling_logprobs: each token's logprob under the numerics that sampled it
                completion_ids, completion_mask, is_truncated, sampling_logprobs = shrink.retry(
                    lambda: generate_completions(
                        unwrapped_actor, prompt_ids, prompt_mask, generation_config, eos_ids,
                        args.generation_slice_size, args.generation_backend,
                        keep_decoder=not args.empty_cache_between_phases, from_copy=args.generation_copy,
                        return_logprobs=True, prefill_chunk_size=args.prefill_chunk_size,
                        kv_cache_dtype=args.kv_cache_dtype, copy_dtype=args.generation_copy_dtype,
                        copy_in_place=args.generation_copy_in_place, share_prompt_cache=args.share_prompt_cache),
                    "generate", kind="generation")  # [B, C] x2, [B], [B, C]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + C]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        C = completion_ids.shape[1]
        mask = completion_mask.float()  # [B, C]

        # 2. old logprobs (the rollout policy), reference logprobs, values; micro-batches of
        # --per_device_train_batch_size rows or a token budget, cut to the columns their rows use. A
        # plan is made per pass: --auto_reduce_micro_batch may shrink the sizes after an out-of-memory error
        def make_plan(rows=None):
            return plan_micro_batches(attention_mask, C, rows=rows, batch_size=args.per_device_train_batch_size,
                                      max_tokens=args.max_token_len_per_gpu if args.use_dynamic_bsz else None,
                                      num_batches_at_least=most_micro_batches)

        def critic_values():  # [B, C]
            values = torch.zeros(input_ids.shape[0], C, device=home)
            for micro in make_plan():
                values[micro.rows] = micro.pad(completion_values(unwrapped_critic, micro.window(input_ids),
                                                                 micro.window(attention_mask), micro.c))
            return values

        with timer.phase("old_logprobs"), resident(unwrapped_actor):
            old_logprobs = shrink.retry(lambda: batched_completion_logprobs(  # [B, C]
                unwrapped_actor, input_ids, attention_mask, make_plan(), args.temperature, chunk), "old_logprobs")
        ref_logprobs = old_logprobs  # no KL penalty: no reference model
        if use_ref:
            ref_policy = unwrapped_actor if ref_model is None else ref_model  # LoRA: the actor, adapter disabled
            with timer.phase("ref"), resident(ref_policy), \
                    unwrapped_actor.disable_adapter() if ref_model is None else nullcontext():
                ref_logprobs = shrink.retry(lambda: batched_completion_logprobs(
                    ref_policy, input_ids, attention_mask, make_plan(), args.temperature, chunk), "ref")
        with timer.phase("values"), torch.no_grad(), resident(unwrapped_critic):
            old_values = shrink.retry(critic_values, "values")
        # the rollout's numerics (pi_rollout) against the training forward's (pi_old), on the same tokens;
        # --rollout_importance_correction weights the policy loss by rho = pi_old / pi_rollout
        rollout_diff = (old_logprobs - sampling_logprobs).abs() * mask  # [B, C]
        is_weights, is_cut = None, torch.zeros_like(mask, dtype=torch.bool)
        if args.rollout_importance_correction != "none":
            is_weights, is_cut = rollout_importance_weights(old_logprobs, sampling_logprobs, mask,
                                                            args.rollout_importance_correction,
                                                            args.rollout_importance_clip)

        # 3. scores: rule rewards and/or the reward model, weighted; penalty for no EOS
        with timer.phase("reward"), resident(reward_model and reward_model.model):
            completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            with checkpointer.user_code():  # the user's code: fails -> one block, the last finished step saved, exit 1
                rewards_per_func = reward_utils.score_completions(
                    reward_fns, completions, prompts, columns, home, completion_ids, completion_mask, step=step,
                    max_steps=args.max_steps, epoch=step * args.prompts_per_step / len(dataset))
            if args.overlong_buffer_len:  # DAPO's soft overlong punishment, one more reward column
                penalty = overlong_penalty(completion_mask.sum(1), args.max_completion_length,
                                           args.overlong_buffer_len, args.overlong_penalty_factor)  # [B]
                rewards_per_func = torch.cat([rewards_per_func, penalty[:, None]], dim=1)  # [B, F]
            scores = (rewards_per_func * reward_weights).nansum(dim=1)  # [B]
            if args.missing_eos_penalty is not None:
                scores = scores - args.missing_eos_penalty * is_truncated.float()

        # 4. per-token rewards: KL penalty on every token, score on the last one
        kl = per_token_kl(old_logprobs, ref_logprobs, args.kl_estimator) * mask  # [B, C]
        rewards = token_rewards(scores, kl, mask, kl_coef)  # [B, C]
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, all_reduce=sum_over_processes)

        # 5. GAE advantages (whitened over the whole batch) and returns
        advantages, returns = compute_gae(rewards, old_values, mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, mask, all_reduce=sum_over_processes)

        # 6. PPO epochs over shuffled mini-batches; actor and critic step once per mini-batch
        orders = [torch.randperm(local_size, device=home) for _ in range(args.ppo_epochs)]
        mini_tokens = torch.stack([mask.sum(1)[order].view(args.num_mini_batches, mini_size).sum(1) for order in orders])
        mini_tokens = sum_over_processes(mini_tokens).clamp(min=1).tolist()  # [epochs, mini-batches], one sync
        sums = torch.zeros(6, device=home)  # actor: clipped, approx_kl, entropy, tokens; critic: value clipped, value loss
        norms, policy_losses = [], []
        for epoch, order in enumerate(orders):
            for m in range(args.num_mini_batches):
                mini = order[m * mini_size:(m + 1) * mini_size]
                num_tokens = mini_tokens[epoch][m]

                # the actor's pass and step, then the critic's: neither loss depends on the other model, so the
                # order changes no number, and only one role's gradients are alive at a time
                def actor_pass():  # this mini-batch's actor gradients -> (loss sum, metric sums)
                    loss_sum, mini_sums = torch.zeros((), device=home), torch.zeros(4, device=home)
                    micro_plan = make_plan(mini)
                    for i, micro in enumerate(micro_plan):
                        last = i == len(micro_plan) - 1  # all-reduce gradients on the last micro-batch only
                        m_mask = micro.completion(mask)  # [b, c]
                        with micro_batch_sync(accelerator, actor, last):
                            logprobs, entropy = completion_logprobs(actor, micro.window(input_ids),
                                                                    micro.window(attention_mask), micro.c,
                                                                    args.temperature, entropy=entropy_mode,
                                                                    chunk_size=chunk)
                            loss, clipped, approx_kl = policy_loss(
                                logprobs, micro.completion(old_logprobs), micro.completion(advantages), m_mask,
                                args.cliprange, num_tokens, delta=args.delta,
                                weights=micro.completion(is_weights) if is_weights is not None else None)
                            if args.entropy_coef > 0:  # entropy bonus over the mini-batch's tokens
                                loss = loss - args.entropy_coef * masked_sum(entropy, m_mask) / num_tokens
                            # DDP averages; the loss is a global share. DeepSpeed: the engine steps after the last
                            backward(accelerator, actor, loss * num_processes, last)
                        loss_sum += loss.detach()
                        mini_sums += torch.stack([clipped, approx_kl, (entropy.detach() * m_mask).sum(), m_mask.sum()])
                    return loss_sum, mini_sums

                def critic_pass():  # this mini-batch's critic gradients -> (loss sum, metric sums)
                    loss_sum, mini_sums = torch.zeros((), device=home), torch.zeros(2, device=home)
                    micro_plan = make_plan(mini)
                    for i, micro in enumerate(micro_plan):
                        last = i == len(micro_plan) - 1
                        m_mask = micro.completion(mask)  # [b, c]
                        with micro_batch_sync(accelerator, critic, last):
                            values = completion_values(critic, micro.window(input_ids), micro.window(attention_mask),
                                                       micro.c)
                            v_loss, v_clipped = value_loss(values, micro.completion(old_values),
                                                           micro.completion(returns), m_mask, args.cliprange_value,
                                                           num_tokens)
                            backward(accelerator, critic, args.vf_coef * v_loss * num_processes, last)
                        loss_sum += v_loss.detach()
                        mini_sums += torch.stack([v_clipped, v_loss.detach() * num_tokens])
                    return loss_sum, mini_sums

                # out of memory: that role's gradients zeroed, micro-batches halved, its pass redone (exact)
                with timer.phase("actor_update"):
                    actor_loss_sum, actor_sums = shrink.retry(actor_pass, "actor update", optimizers=[actor_optimizer])
                    with actor_state.resident():
                        actor_norm, actor_ok = clip_and_step(accelerator, actor, actor_optimizer, actor_scheduler,
                                                             args.max_grad_norm, actor_loss_sum)
                # --critic_device swap: the critic's weights on the GPU for this update only (its moments for the step)
                critic_resident = critic_swap.resident(write_back=True) if critic_swap else nullcontext()
                with timer.phase("critic_update"), critic_resident:
                    critic_loss_sum, critic_sums = shrink.retry(critic_pass, "critic update",
                                                                optimizers=[critic_optimizer])
                    with critic_state.resident():
                        critic_norm, critic_ok = clip_and_step(accelerator, critic, critic_optimizer,
                                                               critic_scheduler, args.max_grad_norm, critic_loss_sum)
                sums += torch.cat([actor_sums, critic_sums])
                guard.record(actor_ok and critic_ok, step, "actor/critic update")
                norms.append(torch.stack([actor_norm.to(home), critic_norm.to(home)]))  # the critic may be elsewhere
                policy_losses.append(actor_loss_sum)

        # 7. adaptive KL coefficient, metrics
        all_scores = accelerator.gather(scores)
        kl_per_sequence = accelerator.gather(kl.sum(1))  # [N]
        observed_kl = kl_per_sequence.mean().item()
        if args.target_kl is not None:
            kl_coef = update_kl_coef(kl_coef, observed_kl, args.target_kl, args.prompts_per_step, args.kl_horizon)
        score_history.append(all_scores.mean().item())
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            global_sums = sum_over_processes(sums)
            tokens = max(global_sums[3].item(), 1.0)
            all_rewards_per_func = accelerator.gather(rewards_per_func)
            stats = sum_over_processes(torch.stack([
                (returns * mask).sum(), (returns ** 2 * mask).sum(), ((returns - old_values) * mask).sum(),
                ((returns - old_values) ** 2 * mask).sum(), (old_values * mask).sum(), mask.sum(), rollout_diff.sum(),
                ((is_weights if is_weights is not None else 1.0) * mask).sum(), (is_cut * mask).sum()]))
            n = stats[5].clamp(min=2)
            var_returns = stats[1] / n - (stats[0] / n) ** 2
            var_residual = stats[3] / n - (stats[2] / n) ** 2
            norms_mean = torch.stack(norms).mean(0)
            metrics = {
                "reward/mean": all_scores.mean().item(),
                "reward/std": all_scores.std().item() if len(all_scores) > 1 else 0.0,
                "reward/rlhf_mean": (all_scores - kl_coef * kl_per_sequence).mean().item(),
                "loss/policy": sum_over_processes(torch.stack(policy_losses).mean()).item(),
                "loss/value": global_sums[5].item() / tokens,
                "policy/kl": observed_kl,
                "policy/kl_coef": kl_coef,
                "policy/approx_kl": global_sums[1].item() / tokens,
                "policy/clipfrac": global_sums[0].item() / tokens,
                "policy/entropy": global_sums[2].item() / tokens,
                "value/clipfrac": global_sums[4].item() / tokens,
                "value/mean": (stats[4] / n).item(),
                "value/returns_mean": (stats[0] / n).item(),
                "value/explained_variance": (1 - var_residual / var_returns.clamp(min=1e-8)).item(),
                # pi_rollout vs the training forward on the sampled tokens: what --rollout_importance_correction corrects
                "policy/rollout_train_logprob_diff/mean": (stats[6] / n).item(),
                "policy/rollout_train_logprob_diff/max": accelerator.gather(rollout_diff.max()[None]).max().item(),
                "optim/lr": actor_scheduler.get_last_lr()[0],
                "optim/critic_lr": critic_scheduler.get_last_lr()[0],
                "optim/grad_norm": norms_mean[0].item(),
                "optim/critic_grad_norm": norms_mean[1].item(),
                "optim/skipped_steps": guard.total,
                "memory/host_peak_rss_gib": host_peak_rss_gib(),
                "memory/auto_reductions": shrink.reductions,
            }
            if is_weights is not None:
                metrics["policy/rollout_is_weight_mean"] = (stats[7] / n).item()
                metrics["policy/rollout_is_cut_frac"] = (stats[8] / n).item()
            metrics |= rollout_metrics(accelerator, completion_mask, is_truncated, all_rewards_per_func, reward_names)
            logger.log_step(metrics, step + 1, timer, step_start, verbose=args.debug)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{observed_kl:.3g}")
            if completion_logger is not None:  # --log_completions; the advantage: the completion's token mean
                completion_logger.log(step + 1, prompts, completions, rewards_per_func, reward_names, scores,
                                      masked_sum(advantages, mask, dim=1) / mask.sum(1).clamp(min=1))
            if args.debug and is_main and step % 25 == 0:
                tqdm.write(f"  sample: {str(prompts[0])!r} -> {completions[0]!r} (score {scores[0].item():.3f})")

        snapshot.end()
        profile.end()
        tracker.after_step(step + 1, timer.metrics)  # --log_memory_every: the per-role table

        # 8. save: every --save_steps, and on SIGTERM/SIGINT (then exit)
        trainer_state = {"total_skipped": guard.total, "skipped_in_a_row": guard.in_a_row, "kl_coef": kl_coef}
        signum = checkpointer.after_step(step + 1, args.max_steps, trainer_state)
        if signum:
            logger.close()
            sys.exit(128 + signum)

    # ---- 4. the end: last checkpoint, final actor, replicas checked -----------------------------------
    progress.close()
    checkpointer.save(args.max_steps, {"total_skipped": guard.total, "skipped_in_a_row": guard.in_a_row,
                                       "kl_coef": kl_coef})
    final_dir = checkpointer.save_model(actor, tokenizer)  # None with --save_strategy no
    if replicas_comparable(engine):  # every rank holds the whole model: all must be equal
        check_replicas_in_sync(accelerator, actor)
    if is_main and score_history:
        print(first_last_line(score_history, final_dir), flush=True)
    if torch.cuda.is_available():
        print(f"[rank {rank}] peak GPU memory allocated: {gpu_peaks_line(timer)}", flush=True)
    tracker.finish()  # the last table, and --memory_report's files
    logger.close()


if __name__ == "__main__":
    main()
