"""GRPO (Group Relative Policy Optimization) in one file, readable top to bottom.

    python train_grpo.py --debug                       # embedded tiny model + toy task, offline, CPU or 1 GPU
    python train_grpo.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct \\
        --dataset_name openai/gsm8k --dataset_config main --prompt_column question \\
        --reward_funcs accuracy,format --use_gradient_checkpointing
    accelerate launch --multi_gpu --num_processes 4 train_grpo.py --use_gradient_checkpointing ...
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml --num_processes 8 train_grpo.py ...
    python train_grpo.py --config my_run.yaml --learning_rate 2e-6   # YAML of flag names; the command line wins

One step (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300, Algorithm 1):
  1. generate --num_generations completions for each of --prompts_per_step prompts
  2. score them with the reward functions (and/or a reward model)
  3. advantages: reward minus its group's mean, optionally divided by a std (--scale_rewards)
  4. reference logprobs for the k3 KL penalty (--beta > 0)
  5. old-policy logprobs, only when each batch is used for --num_iterations > 1 updates
  6. clipped surrogate loss over micro-batches, one optimizer step per iteration
  7. log, save

Departures from the paper, all switchable: the loss normalisation is --loss_type (the paper's
per-sequence mean is `grpo`; `dr_grpo` and `dapo` remove its length bias, arXiv:2503.20783 and
arXiv:2503.14476); the upper clip bound can differ from the lower (--epsilon_high, DAPO's
clip-higher); truncated completions can be left out of the loss (--mask_truncated_completions).
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

import torch


@dataclass
class Args:
    # --- model
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Hub id or local folder of a causal LM; unset: the embedded tiny model and toy task."})
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(default="float32", metadata={"help": "Dtype of the trained weights. float32 by default: with bf16 weights, AdamW updates at RL learning rates round to nothing. Frozen models (reference, reward) load in the mixed-precision dtype."})
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = field(default="auto", metadata={"help": "Autocast dtype for forward passes; auto: bf16 on a GPU that supports it, else no. Overrides accelerate's config."})
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = field(default="sdpa", metadata={"help": "Attention kernel; flash_attention_2 needs the optional flash-attn package and a GPU."})
    use_gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward (non-reentrant) instead of storing them."})
    use_chat_template: Optional[bool] = field(default=None, metadata={"help": "Wrap prompts in the tokenizer's chat template; default: when the tokenizer has one."})
    system_prompt: Optional[str] = field(default=None, metadata={"help": "System message put before each prompt (chat template) or a line before it (raw)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub (from_pretrained's trust_remote_code)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Set dropout to 0 in the policy so old and new logprobs agree; --no_disable_dropout keeps it."})
    # --- data
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Hub id, local folder, or local .json/.jsonl/.parquet/.csv file; unset: the toy task."})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Hub dataset configuration (e.g. `main` for openai/gsm8k)."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    prompt_column: str = field(default="prompt", metadata={"help": "Column holding the prompt: text, or a list of chat messages."})
    answer_column: str = field(default="answer", metadata={"help": "Column holding the reference answer, passed to reward functions as `answer`."})
    max_prompt_length: int = field(default=512, metadata={"help": "Prompts longer than this many tokens are cut from the left, with a warning."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per completion."})
    # --- rewards
    reward_funcs: Optional[str] = field(default=None, metadata={"help": "Comma list of built-ins (accuracy, format), path/file.py:function or module:function, or none; default: accuracy, or none when a reward model is given."})
    reward_weights: Optional[str] = field(default=None, metadata={"help": "Comma list of weights, one per reward function then the reward model; default all 1."})
    reward_model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Sequence-classification model (num_labels=1) scoring prompt + completion."})
    # --- GRPO
    prompts_per_step: int = field(default=16, metadata={"help": "Prompts per step over all processes; each gets --num_generations completions."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt (the group, G); at least 2."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Completions per forward/backward micro-batch on each process; gradients accumulate over the rest of the step."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps on each generated batch (GRPO's mu); old logprobs are only computed when > 1."})
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = field(default="dapo", metadata={"help": "grpo: mean over each completion's tokens, then over completions; dr_grpo: sum / (completions x max_completion_length); dapo: sum / all tokens of the step."})
    scale_rewards: Literal["group", "batch", "none"] = field(default="group", metadata={"help": "Divide the advantage (reward - group mean) by the group's std, the whole batch's std, or nothing (Dr. GRPO)."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range: the ratio is clipped at 1 - epsilon."})
    epsilon_high: Optional[float] = field(default=None, metadata={"help": "Upper clip range (DAPO clip-higher, e.g. 0.28); default: epsilon."})
    beta: float = field(default=0.04, metadata={"help": "Weight of the k3 KL penalty to the reference model; 0 loads no reference model."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions that hit max_completion_length without EOS out of the loss."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (logprobs are computed at the same temperature)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold; 1.0 disables."})
    top_k: int = field(default=0, metadata={"help": "Sample from the k most likely tokens; 0 disables."})
    # --- optimisation
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate (the tiny model's preset: 3e-3)."})
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = field(default="constant", metadata={"help": "Learning-rate schedule after warmup."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of optimizer steps for linear warmup."})
    warmup_steps: int = field(default=0, metadata={"help": "Warmup optimizer steps; overrides --warmup_ratio when > 0."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not applied to biases and norms)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."})
    max_steps: int = field(default=-1, metadata={"help": "Steps (generate + update) to run; -1: --num_train_epochs over the dataset."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the prompts when --max_steps is -1."})
    seed: int = field(default=42, metadata={"help": "Random seed; each process samples with seed + its rank."})
    max_skipped_steps: int = field(default=5, metadata={"help": "Abort after this many consecutive updates skipped for a non-finite loss or gradient norm."})
    # --- logging and saving
    output_dir: str = field(default="outputs/grpo", metadata={"help": "Checkpoints, metrics.jsonl and the final model (output_dir/final) go here."})
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    report_to: Literal["none", "tensorboard", "wandb"] = field(default="none", metadata={"help": "Also send metrics to this tracker (metrics.jsonl is always written)."})
    run_name: str = field(default="lean-rl-grpo", metadata={"help": "Run name for the tracker."})
    save_steps: int = field(default=100, metadata={"help": "Save a resumable checkpoint every this many steps; 0: only at the end and on SIGTERM/SIGINT."})
    save_total_limit: Optional[int] = field(default=2, metadata={"help": "Keep at most this many checkpoints (oldest removed first)."})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "A checkpoint folder, or `latest` for the newest in --output_dir."})
    debug: bool = field(default=False, metadata={"help": "One process, small batch, few steps, a per-phase time/memory line every step; with no model: the toy task."})
    config: Optional[str] = field(default=None, metadata={"help": "YAML file of flag names and values; flags on the command line win."})


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


def per_token_policy_loss(logprobs, old_logprobs, advantages, epsilon_low, epsilon_high, ref_logprobs=None, beta=0.0):
    """Clipped surrogate (PPO) per token, plus beta * k3 KL to the reference.

    logprobs, old_logprobs, ref_logprobs: [B, C]; advantages: [B] (one per completion).
    Returns loss [B, C], kl [B, C] (zeros when beta == 0) and is_clipped [B, C] (the clip is
    active: the ratio left [1 - eps_low, 1 + eps_high] in the direction the advantage pushes)."""
    ratio = torch.exp(logprobs - old_logprobs)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    adv = advantages.unsqueeze(1)  # [B, 1]
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    kl = torch.zeros_like(logprobs)
    if beta > 0:
        kl = k3_kl(logprobs, ref_logprobs)
        loss = loss + beta * kl
    is_clipped = ((ratio < 1 - epsilon_low) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
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


# ----------------------------------------------------------------------------------------------
# Arguments: presets, derived sizes, validation (everything here runs before a model loads)


def apply_presets(args, explicit):
    toy = args.model_name_or_path is None
    presets = (TOY_PRESET if toy else {}) | ({} if toy or not args.debug else DEBUG_PRESET)
    for name, value in presets.items():
        if name not in explicit:
            setattr(args, name, value)
    if args.epsilon_high is None:
        args.epsilon_high = args.epsilon
    if args.reward_funcs is None:
        args.reward_funcs = "none" if args.reward_model_name_or_path else "accuracy"


def check_args(args, num_processes):
    """Validate flags and derive per-process sizes; raises UsageError naming the flag."""
    from utils.cli import UsageError

    positive = ["prompts_per_step", "per_device_train_batch_size", "num_iterations", "max_prompt_length",
                "max_completion_length", "logging_steps", "max_skipped_steps"]
    for name in positive:
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.num_generations < 2:
        raise UsageError(
            f"--num_generations {args.num_generations}: GRPO's advantage is the reward minus its group's mean, "
            "so each prompt needs at least 2 completions"
        )
    for name in ("temperature", "learning_rate", "epsilon", "epsilon_high"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0 (got {getattr(args, name)})")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1] (got {args.top_p})")
    for name in ("beta", "top_k", "max_grad_norm", "weight_decay", "save_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup_ratio must be in [0, 1) (got {args.warmup_ratio})")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise UsageError(f"--save_total_limit must be at least 1 (got {args.save_total_limit})")
    if args.prompts_per_step % num_processes:
        raise UsageError(
            f"--prompts_per_step {args.prompts_per_step} does not split over {num_processes} processes "
            "(every process generates whole groups); use a multiple of the process count"
        )
    local_completions = args.prompts_per_step // num_processes * args.num_generations
    if local_completions % args.per_device_train_batch_size:
        divisors = [d for d in range(1, local_completions + 1) if local_completions % d == 0]
        raise UsageError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size} does not divide the {local_completions} "
            f"completions each process trains on per step (--prompts_per_step {args.prompts_per_step} x "
            f"--num_generations {args.num_generations} / {num_processes} processes); valid: {divisors}"
        )
    return local_completions


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from utils import data as data_utils
    from utils import rewards as reward_utils
    from utils.checkpoint import (StopSignal, list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint,
                                  save_pretrained_atomic)
    from utils.cli import UsageError, fail, parse_args, parse_float_list
    from utils.generation import build_generation_config, generate_completions
    from utils.logger import MetricsLogger, check_report_to
    from utils.memory import PhaseTimer, host_peak_rss_gib
    from utils.modeling import (DTYPES, check_attn_implementation, count_parameters, eos_token_ids, load_causal_lm,
                                load_tokenizer, param_fingerprint)
    from utils.ops import batched_completion_logprobs, completion_logprobs
    from utils.optim import build_optimizer, build_scheduler

    # ---- 1. arguments, checked before any model loads -------------------------------------------
    try:
        args, explicit = parse_args(Args, argv)
    except UsageError as e:
        fail(str(e))
    apply_presets(args, explicit)
    mixed_precision = args.mixed_precision
    if mixed_precision == "auto":
        mixed_precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = Accelerator(mixed_precision=mixed_precision,
                              log_with=None if args.report_to == "none" else args.report_to,
                              project_dir=args.output_dir)
    is_main = accelerator.is_main_process
    try:
        local_completions = check_args(args, accelerator.num_processes)
        check_attn_implementation(args.attn_implementation, accelerator.device.type == "cuda")
        check_report_to(args.report_to)
        specs = [s.strip() for s in args.reward_funcs.split(",") if s.strip() and s.strip() != "none"]
        reward_fns = [(reward_utils.reward_function_name(s), reward_utils.load_reward_function(s)) for s in specs]
        if not reward_fns and not args.reward_model_name_or_path:
            raise UsageError("no reward: give --reward_funcs and/or --reward_model_name_or_path")
        num_rewards = len(reward_fns) + bool(args.reward_model_name_or_path)
        weights = parse_float_list(args.reward_weights, "--reward_weights") if args.reward_weights else [1.0] * num_rewards
        if len(weights) != num_rewards:
            raise UsageError(f"--reward_weights has {len(weights)} values for {num_rewards} rewards "
                             f"({', '.join([n for n, _ in reward_fns] + (['reward_model'] if args.reward_model_name_or_path else []))})")
        with accelerator.main_process_first():
            if args.dataset_name is None:
                from utils import toy
                dataset, source = toy.build_dataset(seed=args.seed), "the toy task"
            else:
                dataset = data_utils.load_prompt_dataset(args.dataset_name, args.dataset_config, args.dataset_split)
                source = args.dataset_name
        data_utils.check_columns(dataset, args.prompt_column, args.answer_column,
                                 answer_required="accuracy" in specs, source=source)
        resume_path = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    except UsageError as e:
        fail(str(e))
    if args.debug and accelerator.num_processes > 1:
        warnings.warn("--debug is meant for a single process")
    if args.max_steps < 0:
        args.max_steps = math.ceil(len(dataset) * args.num_train_epochs / args.prompts_per_step)
    grad_accum_steps = local_completions // args.per_device_train_batch_size
    local_prompts = args.prompts_per_step // accelerator.num_processes
    optimizer_steps = args.max_steps * args.num_iterations
    set_seed(args.seed, device_specific=True)  # each rank samples differently
    device = accelerator.device

    # ---- 2. models ---------------------------------------------------------------------------------
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    use_chat_template = args.use_chat_template
    if use_chat_template is None:
        use_chat_template = getattr(tokenizer, "chat_template", None) is not None
    train_dtype = DTYPES.get(args.torch_dtype, "auto")
    frozen_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, train_dtype)
    model = load_causal_lm(args.model_name_or_path, tokenizer, train_dtype, args.attn_implementation,
                           args.trust_remote_code, args.disable_dropout, seed=args.seed)
    if args.use_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref_model = None
    if args.beta > 0:  # the frozen reference policy for the KL penalty
        ref_model = load_causal_lm(args.model_name_or_path, tokenizer, frozen_dtype, args.attn_implementation,
                                   args.trust_remote_code, True, seed=args.seed)
        ref_model.requires_grad_(False).eval().to(device)
    if args.reward_model_name_or_path:
        reward_model = reward_utils.RewardModel(args.reward_model_name_or_path, device, frozen_dtype,
                                                fallback_tokenizer=tokenizer, trust_remote_code=args.trust_remote_code)
        reward_fns.append((reward_model.name, reward_model))
    reward_weights = torch.tensor(weights, device=device)
    optimizer = build_optimizer(model.to(device), args.learning_rate, args.weight_decay)
    warmup = args.warmup_steps or int(args.warmup_ratio * optimizer_steps)
    scheduler = build_scheduler(optimizer, args.lr_scheduler_type, optimizer_steps, warmup)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # not prepared: it steps once per optimizer step
    unwrapped = accelerator.unwrap_model(model)
    eos_ids = eos_token_ids(tokenizer, unwrapped)
    generation_config = build_generation_config(args.max_completion_length, args.temperature, args.top_p,
                                                args.top_k, tokenizer.pad_token_id, eos_ids)
    encode_prompts = data_utils.PromptEncoder(tokenizer, args.max_prompt_length, use_chat_template, args.system_prompt)

    start_step, skipped_in_a_row, total_skipped = 0, 0, 0
    if resume_path:
        state = load_checkpoint(accelerator, resume_path)
        start_step, total_skipped = state["step"], state.get("total_skipped", 0)
    elif is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        if list_checkpoints(args.output_dir):
            warnings.warn(f"{args.output_dir} already holds checkpoints; this run starts from scratch "
                          "(use --resume_from_checkpoint latest to continue)")
        open(os.path.join(args.output_dir, "metrics.jsonl"), "w").close()
    logger = MetricsLogger(accelerator, args.output_dir, args.report_to, args.run_name, dataclasses.asdict(args))
    timer = PhaseTimer(device)
    stop = StopSignal()
    if is_main:
        total, trainable = count_parameters(unwrapped)
        print(f"model {args.model_name_or_path or 'embedded tiny model (toy task)'}: {total / 1e6:.2f}M parameters "
              f"({trainable / 1e6:.2f}M trained, {args.torch_dtype}), reference: {'yes' if ref_model else 'none (beta=0)'}, "
              f"rewards: {', '.join(n for n, _ in reward_fns)}")
        print(f"num_processes={accelerator.num_processes} device={device} mixed_precision={mixed_precision} | "
              f"{args.prompts_per_step} prompts x {args.num_generations} generations per step; per process "
              f"{local_completions} completions in {grad_accum_steps} micro-batches of {args.per_device_train_batch_size} "
              f"| steps {start_step}->{args.max_steps}", flush=True)

    # ---- 3. training loop --------------------------------------------------------------------------
    reward_history = []
    mb = args.per_device_train_batch_size
    progress = tqdm(range(start_step, args.max_steps), initial=start_step, total=args.max_steps,
                    disable=not is_main, desc="grpo", dynamic_ncols=True,
                    mininterval=0.5 if sys.stderr.isatty() else 30)
    for step in progress:
        timer.reset()
        step_start = time.perf_counter()
        rows = data_utils.prompt_indices(len(dataset), args.prompts_per_step, step, args.seed)
        rows = rows[accelerator.process_index * local_prompts:(accelerator.process_index + 1) * local_prompts]
        batch = dataset[rows]  # this process's prompts: dict of column -> list
        prompts = [p for p in batch[args.prompt_column] for _ in range(args.num_generations)]  # G copies, adjacent
        columns = {k: [v for v in vals for _ in range(args.num_generations)]
                   for k, vals in batch.items() if k != args.prompt_column}
        if args.answer_column in columns:
            columns["answer"] = columns[args.answer_column]

        # 1. generate G completions per prompt
        with timer.phase("generate"):
            prompt_ids, prompt_mask = encode_prompts(batch[args.prompt_column], device)  # [b, P]
            prompt_ids = prompt_ids.repeat_interleave(args.num_generations, 0)  # [B, P]
            prompt_mask = prompt_mask.repeat_interleave(args.num_generations, 0)
            completion_ids, completion_mask, is_truncated = generate_completions(
                unwrapped, prompt_ids, prompt_mask, generation_config, eos_ids)  # [B, C], [B, C], [B]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P + C]
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        num_completion_tokens = completion_ids.shape[1]
        loss_mask = completion_mask.float()  # [B, C]
        if args.mask_truncated_completions:
            loss_mask = loss_mask * (~is_truncated).float().unsqueeze(1)

        # 2. reference logprobs (frozen policy) for the KL penalty
        ref_logprobs = None
        if ref_model is not None:
            with timer.phase("ref"):
                ref_logprobs = batched_completion_logprobs(ref_model, input_ids, attention_mask,
                                                           num_completion_tokens, args.temperature, mb)

        # 3. rewards: every function on every completion, weighted sum; gathered over processes
        with timer.phase("reward"):
            completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            rewards_per_func = torch.zeros(len(completions), len(reward_fns), device=device)  # [B, F]
            for j, (name, fn) in enumerate(reward_fns):
                values = reward_utils.call_reward_function(fn, name, completions, prompts, columns)
                rewards_per_func[:, j] = torch.tensor(values, dtype=torch.float32, device=device)
            all_rewards_per_func = accelerator.gather(rewards_per_func)  # [N, F], groups adjacent
            all_rewards = (all_rewards_per_func * reward_weights).nansum(dim=1)  # [N]

        # 4. group-relative advantages over the whole batch, then this process's slice
        all_advantages = compute_advantages(all_rewards, args.num_generations, args.scale_rewards)
        local = slice(accelerator.process_index * local_completions, (accelerator.process_index + 1) * local_completions)
        advantages = all_advantages[local]  # [B]

        # 5. old-policy logprobs: needed only when the batch serves several updates
        old_logprobs = None
        if args.num_iterations > 1:
            with timer.phase("old_logprobs"):
                old_logprobs = batched_completion_logprobs(unwrapped, input_ids, attention_mask,
                                                           num_completion_tokens, args.temperature, mb)

        # 6. policy update: clipped surrogate over micro-batches, one optimizer step per iteration
        num_loss_tokens = accelerator.reduce(loss_mask.sum(), reduction="sum").item()
        num_sequences = args.prompts_per_step * args.num_generations
        sums = torch.zeros(5, device=device)  # loss, kl, clipped, entropy (token sums) and tokens
        grad_norms = []
        with timer.phase("actor_update"):
            for iteration in range(args.num_iterations):
                for i, start in enumerate(range(0, local_completions, mb)):
                    rows_mb = slice(start, start + mb)
                    sync = start + mb >= local_completions  # all-reduce gradients on the last micro-batch only
                    with nullcontext() if sync else accelerator.no_sync(model):
                        logprobs, entropy = completion_logprobs(model, input_ids[rows_mb], attention_mask[rows_mb],
                                                                num_completion_tokens, args.temperature, with_entropy=True)
                        old = old_logprobs[rows_mb] if old_logprobs is not None else logprobs.detach()
                        ref = ref_logprobs[rows_mb] if ref_logprobs is not None else None
                        per_token, kl, is_clipped = per_token_policy_loss(
                            logprobs, old, advantages[rows_mb], args.epsilon, args.epsilon_high, ref, args.beta)
                        mask = loss_mask[rows_mb]
                        loss = aggregate_loss(per_token, mask, args.loss_type, num_sequences, num_loss_tokens,
                                              args.max_completion_length)
                        # DDP averages gradients over processes; the loss above is already a global share
                        accelerator.backward(loss * accelerator.num_processes)
                    sums += torch.stack([loss.detach(), (kl * mask).sum().detach(), (is_clipped * mask).sum(),
                                         (entropy * mask).sum(), mask.sum()])
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or float("inf"))
                step_loss = accelerator.reduce(sums[0].clone(), reduction="sum")
                # fp16: the grad scaler skips overflowing steps itself, so let it see every step
                if (torch.isfinite(grad_norm) and torch.isfinite(step_loss)) or accelerator.scaler is not None:
                    optimizer.step()
                    scheduler.step()
                    skipped_in_a_row = 0
                else:
                    skipped_in_a_row += 1
                    total_skipped += 1
                    warnings.warn(f"step {step}: non-finite loss ({step_loss.item()}) or gradient norm "
                                  f"({grad_norm.item()}); update skipped ({skipped_in_a_row} in a row)")
                optimizer.zero_grad(set_to_none=True)
                grad_norms.append(grad_norm.detach().float())
                sums[0] = 0.0
        if skipped_in_a_row >= args.max_skipped_steps:
            fail(f"aborting at step {step}: {skipped_in_a_row} consecutive updates had a non-finite loss or gradient "
                 "norm. Check the rewards for inf/nan, lower --learning_rate, or raise --max_skipped_steps. "
                 "The last checkpoint is untouched.", code=1)

        # 7. metrics: one reduction for the update sums, gathered tensors for the rest
        global_sums = accelerator.reduce(sums, reduction="sum")
        lengths = accelerator.gather(completion_mask.sum(1).float())
        truncated = accelerator.gather(is_truncated.float())
        reward_history.append(all_rewards.mean().item())
        if (step + 1) % args.logging_steps == 0 or step + 1 == args.max_steps:
            tokens = max(global_sums[4].item(), 1.0)
            group_std = all_rewards.view(-1, args.num_generations).std(dim=1)
            metrics = {
                "reward/mean": all_rewards.mean().item(),
                "reward/std": all_rewards.std().item(),
                "reward/frac_zero_std": (group_std < 1e-6).float().mean().item(),
                "advantage/std": all_advantages.std().item(),
                "advantage/min": all_advantages.min().item(),
                "advantage/max": all_advantages.max().item(),
                "loss/policy": step_loss.item(),
                "policy/kl": global_sums[1].item() / tokens,
                "policy/clipfrac": global_sums[2].item() / tokens,
                "policy/entropy": global_sums[3].item() / tokens,
                "completions/mean_length": lengths.mean().item(),
                "completions/max_length": lengths.max().item(),
                "completions/min_length": lengths.min().item(),
                "completions/truncated_frac": truncated.mean().item(),
                "optim/lr": scheduler.get_last_lr()[0],
                "optim/grad_norm": torch.stack(grad_norms).mean().item(),
                "optim/skipped_steps": total_skipped,
                "memory/host_peak_rss_gib": host_peak_rss_gib(),
            }
            for j, (name, _) in enumerate(reward_fns):
                metrics[f"reward/{name}/mean"] = all_rewards_per_func[:, j].nanmean().item()
                metrics[f"reward/{name}/std"] = all_rewards_per_func[:, j].std().item()
            metrics |= timer.metrics
            metrics["time/step"] = time.perf_counter() - step_start
            metrics["throughput/tokens_per_s"] = lengths.sum().item() / metrics["time/step"]
            logger.log(metrics, step + 1)
            progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics['policy/kl']:.3g}")
            if args.debug and is_main:
                tqdm.write(logger.console_line(metrics, step + 1) + " || " + timer.summary())
                if step % 25 == 0:
                    tqdm.write(f"  sample: {str(prompts[0])!r} -> {completions[0]!r} "
                               f"(reward {rewards_per_func[0].tolist()})")

        # 8. save: every --save_steps, and on SIGTERM/SIGINT before exiting
        done = step + 1
        trainer_state = {"total_skipped": total_skipped}
        if args.save_steps and done % args.save_steps == 0 and done < args.max_steps:
            save_checkpoint(accelerator, args.output_dir, done, trainer_state, args.save_total_limit)
        signum = stop.requested(accelerator)
        if signum:
            path = save_checkpoint(accelerator, args.output_dir, done, trainer_state, args.save_total_limit)
            if is_main:
                print(f"\nreceived signal {signum}: saved {path}; resume with --resume_from_checkpoint latest", flush=True)
            logger.close()
            sys.exit(128 + signum)

    # ---- 4. the end: final checkpoint and model ------------------------------------------------------
    progress.close()
    save_checkpoint(accelerator, args.output_dir, args.max_steps, {"total_skipped": total_skipped}, args.save_total_limit)
    final_dir = os.path.join(args.output_dir, "final")
    save_pretrained_atomic(accelerator, model, tokenizer, final_dir)
    if accelerator.num_processes > 1:  # DDP keeps replicas equal; check it, cheaply, once
        fingerprint = param_fingerprint(unwrapped)
        print(f"[rank {accelerator.process_index}] final weights fingerprint: {fingerprint}", flush=True)
        fingerprints = accelerator.gather(torch.tensor([fingerprint], dtype=torch.float64, device=device))
        if not torch.all(fingerprints == fingerprints[0]):
            fail(f"ranks ended with different weights: {fingerprints.tolist()}", code=1)
    if is_main and reward_history:
        k = max(1, min(10, len(reward_history) // 4))
        before, after = sum(reward_history[:k]) / k, sum(reward_history[-k:]) / k
        print(f"reward: first {k} steps {before:.3f} -> last {k} steps {after:.3f} | saved {final_dir}", flush=True)
    logger.close()


if __name__ == "__main__":
    main()
