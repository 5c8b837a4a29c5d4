"""Flags both scripts share (model, placement, data, rewards, sampling, optimisation, logging,
saving), their checks, and the presets. Each script's `Args` extends `SharedArgs` with its
algorithm's flags and its own defaults for prompts_per_step, learning_rate, output_dir, run_name."""

from dataclasses import dataclass, field
from typing import Literal, Optional

from utils.base import CAPTURED_BACKENDS, parse_memory
from utils.cli import UsageError


@dataclass
class SharedArgs:
    # --- model
    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Hub id or local folder of a causal LM (the policy); unset: the embedded tiny model and toy task."})
    tokenizer_name_or_path: Optional[str] = field(default=None, metadata={"help": "Hub id or local folder of the tokenizer; default: the model's."})
    torch_dtype: Literal["float32", "bfloat16", "float16", "auto"] = field(default="float32", metadata={"help": "Dtype of the trained weights. bfloat16 halves weights and gradients; its optimizer steps then use stochastic rounding (torchao), since a plain bf16 AdamW rounds RL-sized updates away. Frozen models (reference, reward) load in the mixed-precision dtype."})
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = field(default="auto", metadata={"help": "Autocast dtype for forward passes; auto: bf16 on a GPU that supports it, else no. Overrides accelerate's config."})
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = field(default="sdpa", metadata={"help": "Attention kernel; flash_attention_2 needs the optional flash-attn package and a GPU."})
    use_gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward (non-reentrant) instead of storing them, in every trained model."})
    torch_compile: bool = field(default=False, metadata={"help": "Compile each decoder layer of the trained models and the reference in place (regional compilation with torch.compile): fused kernels for the norms, RoPE and activations in every forward and backward. Compiles during the first steps. Not under ZeRO-3/FSDP2."})
    use_chat_template: Optional[bool] = field(default=None, metadata={"help": "Wrap prompts in the tokenizer's chat template; default: when the tokenizer has one."})
    system_prompt: Optional[str] = field(default=None, metadata={"help": "System message put before each prompt (chat template) or a line before it (raw)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model code from the hub (from_pretrained's trust_remote_code)."})
    disable_dropout: bool = field(default=True, metadata={"help": "Set dropout to 0 in trained models so old and new logprobs agree; --no_disable_dropout keeps it."})
    # --- memory levers (README: "what each flag saves and what it costs")
    activation_offload: bool = field(default=False, metadata={"help": "With --use_gradient_checkpointing: keep each checkpointed layer input in pinned CPU memory (copied asynchronously), brought back in backward. Same math."})
    use_dynamic_bsz: bool = field(default=False, metadata={"help": "Form micro-batches by a token budget (--max_token_len_per_gpu, sequences grouped by length) instead of --per_device_train_batch_size, for the update and every no-grad pass. Same math."})
    max_token_len_per_gpu: int = field(default=16384, metadata={"help": "Token budget of one micro-batch with --use_dynamic_bsz (rows x longest row, padding counted)."})
    logprob_chunk_size: int = field(default=0, metadata={"help": "Compute logprobs and entropy through the LM head this many tokens at a time (recomputed in backward), so the full [B, T, vocab] logits never exist; 0: all at once. Same math."})
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus: subtract entropy_coef x the mean token entropy from the policy loss (entropy then needs gradients)."})
    entropy_checkpointing: bool = field(default=False, metadata={"help": "With --entropy_coef > 0: keep no softmax for the entropy's gradient. Since 2026-12-06 no path keeps one (logprobs_and_entropy's backward recomputes it from the logits), so this changes nothing; kept so existing commands run. Same math."})
    optim: Literal["adamw_torch", "adamw_8bit", "paged_adamw_8bit", "adamw_4bit"] = field(default="adamw_torch", metadata={"help": "adamw_torch (fused on GPU); adamw_8bit / paged_adamw_8bit (bitsandbytes, 8-bit states: changes numerics slightly; paged pages states to CPU under pressure); adamw_4bit (torchao, 4-bit states: changes numerics more). bf16 weights: torchao's AdamW variants with stochastic rounding."})
    load_in_4bit: bool = field(default=False, metadata={"help": "bitsandbytes NF4 weights (double quantisation: --use_bnb_nested_quant) for the frozen reference and reward models, and for the policy/critic with --use_lora (QLoRA). Changes numerics."})
    load_in_8bit: bool = field(default=False, metadata={"help": "As --load_in_4bit, with bitsandbytes int8 weights."})
    use_bnb_nested_quant: bool = field(default=True, metadata={"help": "With --load_in_4bit: double quantisation (TRL's name; TRL's default is false). false keeps each 64-weight block's statistic in float32 instead of 8 bits: +0.047 bytes a quantised weight (7b: +0.28 GiB) and the statistics' own dequantising gone from every product (QLoRA decoding step at 64 rows, H100: 7b 17.90 ms against 18.80, 1.5b 6.76 against 7.59). --auto_memory chooses false where it fits, unless this flag is given. Changes numerics slightly (the weights dequantise with exact statistics)."})
    ref_offload: bool = field(default=False, metadata={"help": "Shorthand for --ref_device offload: the reference's weights in CPU memory, streamed to the GPU layer by layer in every micro-batch (slow at real sizes: a 1.5b reference pass took 12.2 s instead of 0.62 on an H200)."})
    reward_offload: bool = field(default=False, metadata={"help": "Shorthand for --reward_device offload."})
    param_offload: bool = field(default=False, metadata={"help": "Keep the trained weights (and their gradients and optimizer state) of the modules in --offload_policy in pinned CPU memory, copied to the GPU at each use (an input embedding: only the rows a micro-batch uses, and only their gradient back); their optimizer step runs on the CPU (torch's fused AdamW, float32 moments, a float32 master copy of bf16 weights); one process only, not with --mixed_precision fp16. Same math for float32 weights with adamw_torch; otherwise those weights step in float32, more precisely than --optim's."})
    optimizer_offload: bool = field(default=False, metadata={"help": "Keep the optimizer state (moments, quantisation scales) of the trained roles in pinned CPU memory, copied to the GPU for each optimizer step and back after it (verl's optimizer_offload): generation, the no-grad passes and the forward/backward run without it, for two copies of the state over the host link per step. Not under DeepSpeed/FSDP (they offload through their own configs) or with paged_adamw_8bit; --auto_memory may choose it. Same math."})
    offload_policy: str = field(default="embedding,lm_head", metadata={"help": "Comma list for --param_offload: embedding (input embeddings), lm_head (output embeddings), or names of Linear/Embedding modules."})
    generation_slice_size: Optional[int] = field(default=None, metadata={"help": "Decode this many rollouts (completions) at a time (smaller KV cache), in slices of similar prompt length without their shared left padding; default: all of the step's at once. Not TRL's --generation_batch_size (completions generated per round)."})
    prefill_chunk_size: Optional[int] = field(default=None, metadata={"help": "Prefill the rollouts' prompts this many positions at a time into the KV cache: the prefill's activations (its MLP holds three [rows x positions, intermediate] tensors at once: 1.7 GiB at 7b for 64 rows of 256 prompt tokens) shrink by the number of chunks, for one more forward per chunk; default: the whole prompt in one forward. Same tokens and logprobs up to float rounding (every backend; hf through generate's own prefill_chunk_size)."})
    kv_cache_dtype: Literal["auto", "fp8"] = field(default="auto", metadata={"help": "auto: the rollouts' KV cache in the model's compute dtype (bf16). fp8: keys and values stored as float8 e4m3 codes with one float32 scale per position and head (0.52x the bytes: 2.6 GiB instead of 5.2 at 7b for 128 rows of 768 positions), dequantised to bf16 one layer at a time as attention reads them; static, cudagraph and compiled backends (auto picks static where it would pick hf). Changes the rollouts' numerics only (the training forward is unchanged; the rollout correction's metrics show the mismatch)."})
    share_prompt_cache: Optional[bool] = field(default=None, metadata={"help": "Static-cache backends (static, cudagraph, compiled; auto picks static where it would pick hf): each distinct prompt of a generation slice is prefilled once and its keys and values are kept once in the KV cache; the rows that share it (GRPO's --num_generations completions of one prompt) read that copy as they decode. The cache's prompt part shrinks by the group size (W-GRPO, 8 completions of 256-token prompts + 512 new tokens: 768 -> 544 positions a row), and so do the prefill's compute and activations. Same tokens and logprobs up to float rounding. Default: on for GRPO (--num_generations > 1) where the decoding step is captured (cudagraph, compiled) with the policy on one GPU (each process's), the cache in bf16 and the model's attention sdpa or eager through transformers' attention interface, without sliding windows or softcapping; off elsewhere (the choice and its reason are printed at start); true: also on the static backend; false: off. Not with --kv_cache_dtype fp8 or --generation_backend hf."})
    generation_backend: Literal["auto", "hf", "static", "cudagraph", "compiled"] = field(default="auto", metadata={"help": "auto: compiled wherever the policy's weights stay put on a CUDA GPU (cudagraph under 100M parameters), static on a GPU where they move (--param_offload, balanced), hf elsewhere (CPU, ZeRO-3, FSDP2; static there with --kv_cache_dtype fp8); the choice and its reason are printed at start. Or: rollouts with transformers' generate (hf), or this project's loop over a static KV cache (static), with each decoding step replayed as one captured CUDA graph (cudagraph), or compiled with torch.compile and then captured (compiled; a minute of compiling at start; if compiling fails on a model, a warning and the uncompiled step). cudagraph/compiled: GPU only (static elsewhere); they keep their KV cache allocated between rollouts. Same sampling distribution (temperature, top-k, top-p, EOS); other random draws."})
    generation_copy: bool = field(default=False, metadata={"help": "Generate from a bf16 copy of the policy, refreshed before each rollout: LoRA merged into the weights, 4-bit/8-bit weights dequantised (QLoRA then decodes from plain bf16 matrices). Costs one bf16 copy of the weights in memory; generation runs in bf16 throughout, the training forward keeps its numerics."})
    generation_copy_in_place: bool = field(default=False, metadata={"help": "With --generation_copy, LoRA on a bf16 base (--use_lora --torch_dtype bfloat16): the copy holds no weights of its own. Before each rollout the adapters are merged into the base's own storage (the bf16 copy's numerics exactly), after it the exact base is written back from a copy kept once in pinned CPU memory (13 GiB at 7b; one host-to-GPU copy of the decoder's Linears per rollout, 0.26 s at 7b at 50 GB/s, an estimate), also when the rollout fails. Decodes at the base's speed (no adapter matmuls in the step) for no GPU memory; training sees the unchanged base."})
    generation_copy_dtype: Literal["bfloat16", "int8"] = field(default="bfloat16", metadata={"help": "With --generation_copy: the copy's weights in bf16, or int8 (every Linear, the LM head too, as int8 codes with one bf16 scale per output row, torchao's int8 weight-only mapping; the embedding and norms in bf16): about half the copy's bytes (8.2 GB instead of 15.2 at 7b); on a GPU the decoding steps read the codes in a Triton kernel of this project's. Changes the rollouts' numerics only (int8 rounding of the sampling weights; the rollout correction's metrics show the mismatch)."})
    gather_for_generation: bool = field(default=True, metadata={"help": "Under DeepSpeed ZeRO-3 or FSDP2: gather the policy's full weights once for each rollout (one full copy in memory during generation); false: each layer is gathered at every decoding step (less memory, much slower). No effect otherwise."})
    log_memory_every: int = field(default=0, metadata={"help": "Print each role's GPU/CPU bytes (weights, gradients, optimizer state) and the phase peaks every N steps and at the end; 0: never."})
    memory_report: Optional[str] = field(default=None, metadata={"help": "Folder for memory.json, memory_timeline.png (phase peaks across steps) and memory_breakdown.png (roles x weights/gradients/optimizer, phases' transient memory), written at the end."})
    memory_snapshot: Optional[str] = field(default=None, metadata={"help": "Record the CUDA allocator over one step (--memory_snapshot_step, the first by default) and write this pickle (open it at pytorch.org/memory_viz); GPU only."})
    memory_snapshot_step: int = field(default=1, metadata={"help": "With --memory_snapshot: the step to record (1-based); 2 or later leaves out step 1's compiles and captures."})
    profile_step: Optional[int] = field(default=None, metadata={"help": "Profile step N (1-based; 2 or later skips step 1's compiles and captures) with torch.profiler: write OUTPUT_DIR/profile_stepN.json (a trace for ui.perfetto.dev or chrome://tracing, each phase a phase/<name> range) and print each phase's ten kernels with the most GPU time (ops by self CPU time on a CPU)."})
    auto_reduce_micro_batch: bool = field(default=False, metadata={"help": "On out-of-memory, halve the micro-batch (or token budget, or generation batch; in a rollout first --prefill_chunk_size 64 where prompts are longer) and redo that pass exactly; kept for later steps; one process."})
    plan: bool = field(default=False, metadata={"help": "Print the memory planner's estimate (per role, component and phase) and the cheapest flags that fit (utils/plan.py), then exit; nothing loads."})
    auto_memory: bool = field(default=False, metadata={"help": "Apply the memory planner's flags, then train."})
    gpu_memory: Optional[str] = field(default=None, metadata={"help": "The GPU budget: a card as sold (24GB: a 24 GB card, whose usable 21 GiB the run gets) or an allocator budget (21GiB). On a GPU this process's allocator is capped at it (an H200 can stand in for a smaller card), and --plan / --auto_memory plan for it; default: no cap, plan for this process's GPU."})
    empty_cache_between_phases: bool = field(default=False, metadata={"help": "Return cached GPU memory to the driver after each phase (generate, ref, update...), so one phase's KV cache and logits do not crowd the next (--generation_backend cudagraph/compiled then also drop their KV cache and CUDA graph after each rollout and capture them again at the next). Costs allocator time."})
    # --- LoRA (PEFT): the reference is then the policy with its adapter disabled, no second copy
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters instead of all weights (actor, and the critic with its value head fully trained)."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA path; 0 keeps old and new logprobs consistent."})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "Comma list of module names to adapt (e.g. q_proj,v_proj), or all-linear."})
    # --- placement (utils/placement.py; several processes: cuda:N is the N-th GPU the process owns)
    actor_device: Optional[str] = field(default=None, metadata={"help": "Policy placement: cpu, cuda:N or balanced (layers split over this process's GPUs); default: the process's device."})
    ref_device: Optional[str] = field(default=None, metadata={"help": "Reference placement: cpu, cuda:N, balanced, offload (CPU memory, streamed layer by layer to --offload_execution_device in every micro-batch) or swap (pinned CPU memory, copied whole to --offload_execution_device for the reference phase and freed after: one copy per step)."})
    reward_device: Optional[str] = field(default=None, metadata={"help": "Reward model placement: cpu, cuda:N, balanced, offload or swap (as --ref_device)."})
    offload_execution_device: Optional[str] = field(default=None, metadata={"help": "Where offloaded roles run (cpu, cuda:N); default: the actor's device."})
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
    reward_model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Sequence-classification model (num_labels=1) scoring prompt + completion at its last token, with its own tokenizer."})
    overlong_buffer_len: int = field(default=0, metadata={"help": "DAPO's soft overlong punishment (arXiv:2503.14476): completions longer than max_completion_length - this many tokens get a penalty falling linearly from 0 to -overlong_penalty_factor at max_completion_length, added to the reward (logged as reward/overlong_penalty); 0: off."})
    overlong_penalty_factor: float = field(default=1.0, metadata={"help": "The overlong penalty at max_completion_length tokens (with --overlong_buffer_len)."})
    # --- sampling and batching
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (logprobs are computed at the same temperature)."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling threshold; 1.0 disables."})
    top_k: int = field(default=0, metadata={"help": "Sample from the k most likely tokens; 0 disables."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Completions per forward/backward micro-batch on each process; gradients accumulate over the rest of the optimizer step. Left unset, it shrinks to divide each process's share."})
    rollout_importance_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = field(default="none", metadata={"help": "Correct the loss for the gap between the numerics that sampled the tokens (the decoding loop, --generation_copy, a compiled step) and the training forward's: weight each token by pi_train / pi_rollout per token, or per sequence (the product over its tokens), truncated at --rollout_importance_clip (TIS) or zeroed above it (masked IS); TRL's vllm_importance_sampling_mode. policy/rollout_train_logprob_diff is logged either way."})
    rollout_importance_clip: float = field(default=3.0, metadata={"help": "C of --rollout_importance_correction: weights are truncated at C (*_truncate) or zeroed above C (*_mask); TRL's vllm_importance_sampling_clip_max."})
    # --- optimisation
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak learning rate of the policy."})
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = field(default="constant", metadata={"help": "Learning-rate schedule after warmup."})
    warmup_ratio: float = field(default=0.0, metadata={"help": "Fraction of optimizer steps for linear warmup."})
    warmup_steps: int = field(default=0, metadata={"help": "Warmup optimizer steps; overrides --warmup_ratio when > 0."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not applied to biases and norms)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip each trained model's gradient norm to this; 0 disables clipping (the norm is still logged)."})
    max_steps: int = field(default=-1, metadata={"help": "Steps (rollout + update) to run; -1: --num_train_epochs over the dataset."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the prompts when --max_steps is -1."})
    seed: int = field(default=42, metadata={"help": "Random seed; each process samples with seed + its rank."})
    max_skipped_steps: int = field(default=5, metadata={"help": "Abort after this many consecutive updates skipped for a non-finite loss or gradient norm."})
    delta: Optional[float] = field(default=None, metadata={"help": "Two-sided (dual) clip: the unclipped ratio is capped at delta, so a token with a negative advantage and a large ratio adds at most delta x |A| (INTELLECT-2, arXiv:2505.07291; verl's clip_ratio_c); must exceed 1 + the upper clip range; unset: off."})
    # --- logging and saving
    output_dir: str = field(default="outputs", metadata={"help": "Checkpoints, metrics.jsonl and the final model (output_dir/final) go here."})
    logging_steps: int = field(default=1, metadata={"help": "Log metrics every this many steps."})
    report_to: Literal["none", "tensorboard", "wandb"] = field(default="none", metadata={"help": "Also send metrics to this tracker (metrics.jsonl is always written)."})
    run_name: str = field(default="lean-rl", metadata={"help": "Run name for the tracker."})
    save_strategy: Literal["steps", "no"] = field(default="steps", metadata={"help": "steps: checkpoints every --save_steps, at the end and on SIGTERM, and the final model; no: write nothing (benchmarks)."})
    save_steps: int = field(default=100, metadata={"help": "Save a resumable checkpoint every this many steps; 0: only at the end and on SIGTERM/SIGINT."})
    save_total_limit: Optional[int] = field(default=2, metadata={"help": "Keep at most this many checkpoints (oldest removed first)."})
    resume_from_checkpoint: Optional[str] = field(default=None, metadata={"help": "A checkpoint folder, or `latest` for the newest in --output_dir."})
    save_on_error: bool = field(default=True, metadata={"help": "When user code (a reward function or reward model) fails mid-step, first save the state of the last finished step, so the run resumes from it exactly."})
    debug: bool = field(default=False, metadata={"help": "One process, small batch, few steps, a per-phase time/memory line every step; with no model: the toy task."})
    config: Optional[str] = field(default=None, metadata={"help": "YAML file of flag names and values; flags on the command line win."})
    log_completions: bool = field(default=False, metadata={"help": "Every logged step, a table of the step's prompts, completions, each reward function's score, the reward and the advantage: to output_dir/completions.jsonl and the tracker (tensorboard text, wandb table)."})
    num_completions_to_print: int = field(default=4, metadata={"help": "With --log_completions, print this many of the table's rows under the progress bar; 0: none."})


def apply_presets(args, explicit, toy_preset, debug_preset):
    """Fill in what the user did not set: `toy_preset` when no model is given (the embedded tiny
    model needs large batches and a large learning rate), `debug_preset` for --debug on a real
    model (a smoke test). Then the defaults that depend on other flags."""
    toy = args.model_name_or_path is None
    presets = toy_preset if toy else (debug_preset if args.debug else {})
    for name, value in presets.items():
        if name not in explicit:
            setattr(args, name, value)
    if args.reward_funcs is None:
        args.reward_funcs = "none" if args.reward_model_name_or_path else "accuracy"


def check_shared_args(args, num_processes=1):
    """Range checks of the shared flags; raises UsageError naming the flag."""
    for name in ("prompts_per_step", "per_device_train_batch_size", "max_prompt_length", "max_completion_length",
                 "logging_steps", "max_skipped_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1 (got {getattr(args, name)})")
    for name in ("temperature", "learning_rate"):
        if not getattr(args, name) > 0:
            raise UsageError(f"--{name} must be > 0 (got {getattr(args, name)})")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1] (got {args.top_p})")
    for name in ("top_k", "max_grad_norm", "weight_decay", "save_steps", "warmup_steps"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError(f"--warmup_ratio must be in [0, 1) (got {args.warmup_ratio})")
    if args.use_lora:
        if args.lora_r < 1 or args.lora_alpha <= 0:
            raise UsageError(f"--lora_r must be at least 1 and --lora_alpha > 0 (got {args.lora_r}, {args.lora_alpha})")
        if not 0 <= args.lora_dropout < 1:
            raise UsageError(f"--lora_dropout must be in [0, 1) (got {args.lora_dropout})")
        if args.ref_device is not None:
            raise UsageError(f"--ref_device {args.ref_device}: with --use_lora the reference is the policy with its "
                             "adapter disabled, so there is no copy to place")
    check_memory_args(args, num_processes)
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise UsageError(f"--save_total_limit must be at least 1 (got {args.save_total_limit})")
    if not 0 <= args.overlong_buffer_len <= args.max_completion_length:
        raise UsageError(f"--overlong_buffer_len must be in [0, --max_completion_length {args.max_completion_length}] "
                         f"(got {args.overlong_buffer_len})")
    for name in ("overlong_penalty_factor", "num_completions_to_print"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    if not args.rollout_importance_clip > 0:
        raise UsageError(f"--rollout_importance_clip must be > 0 (got {args.rollout_importance_clip})")
    check_output_dir(args.output_dir)


def check_output_dir(path):
    """--output_dir must be a folder, or creatable: its nearest existing ancestor a writable folder."""
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--output_dir {path}: is a file; give a folder (created if missing)")
    ancestor = os.path.abspath(path)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise UsageError(f"--output_dir {path}: {ancestor} is a file, so the folder cannot be created")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--output_dir {path}: {ancestor} is not writable (permission denied)")


def check_memory_args(args, num_processes=1):
    """The memory levers' combinations; also turns the offload shorthands into placements."""
    if args.activation_offload and not args.use_gradient_checkpointing:
        raise UsageError("--activation_offload moves the inputs that gradient checkpointing keeps to the CPU; "
                         "add --use_gradient_checkpointing")
    if args.max_token_len_per_gpu < args.max_prompt_length + args.max_completion_length and args.use_dynamic_bsz:
        raise UsageError(f"--max_token_len_per_gpu {args.max_token_len_per_gpu} is below the longest sequence "
                         f"(--max_prompt_length {args.max_prompt_length} + --max_completion_length "
                         f"{args.max_completion_length}); raise it to at least {args.max_prompt_length + args.max_completion_length}")
    for name in ("logprob_chunk_size", "entropy_coef"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name} must be >= 0 (got {getattr(args, name)})")
    for name in ("generation_slice_size", "prefill_chunk_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1 (got {getattr(args, name)}); leave it unset for all at once")
    if args.load_in_4bit and args.load_in_8bit:
        raise UsageError("--load_in_4bit and --load_in_8bit: choose one")
    if (args.load_in_4bit or args.load_in_8bit) and args.model_name_or_path is None:
        raise UsageError(f"--load_in_{4 if args.load_in_4bit else 8}bit quantises weights loaded with from_pretrained; "
                         "give --model_name_or_path (the embedded tiny model is built in code)")
    if not args.use_bnb_nested_quant and not args.load_in_4bit:
        raise UsageError("--use_bnb_nested_quant false keeps --load_in_4bit's statistics in float32; add "
                         "--load_in_4bit or drop it")
    for role in ("ref", "reward"):
        if getattr(args, f"{role}_offload"):
            current = getattr(args, f"{role}_device")
            if current not in (None, "offload"):
                raise UsageError(f"--{role}_offload and --{role}_device {current}: choose one")
            if role == "ref" and args.use_lora:
                raise UsageError("--ref_offload: with --use_lora the reference is the policy with its adapter "
                                 "disabled, so there is no copy to offload")
            setattr(args, f"{role}_device", "offload")
    bits = 4 if args.load_in_4bit else 8
    quantized_roles = ("ref", "reward") + (("actor", "critic") if args.use_lora else ())
    for role in quantized_roles if (args.load_in_4bit or args.load_in_8bit) else ():
        value = getattr(args, f"{role}_device", None)
        if value in ("balanced", "auto", "offload", "swap"):
            raise UsageError(f"--{role}_device {value} with --load_in_{bits}bit: a quantised model is loaded onto one "
                             "device and stays there; use cuda:N or cpu")
    if args.log_memory_every < 0:
        raise UsageError(f"--log_memory_every must be >= 0 (got {args.log_memory_every})")
    for flag in ("memory_snapshot_step", "profile_step"):  # a step of this run (1-based)
        step = getattr(args, flag)
        if step is not None and (step < 1 or 0 < args.max_steps < step):
            raise UsageError(f"--{flag} {step}: a step of this run, 1 to "
                             + (f"--max_steps ({args.max_steps})" if args.max_steps > 0 else "its last"))
    if args.memory_snapshot and not torch_cuda_available():
        raise UsageError("--memory_snapshot records the CUDA allocator; no CUDA GPU is visible (use --memory_report "
                         "for the per-phase and per-role report)")
    if args.gpu_memory is not None:
        try:
            parse_memory(args.gpu_memory)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.auto_reduce_micro_batch and num_processes > 1:
        raise UsageError(f"--auto_reduce_micro_batch needs one process: with {num_processes}, an out-of-memory error "
                         "on one rank would leave the others waiting in a collective")
    if args.optimizer_offload and args.optim == "paged_adamw_8bit":
        raise UsageError("--optimizer_offload with --optim paged_adamw_8bit: bitsandbytes pages that state to the CPU "
                         "itself; use one of them")
    if args.param_offload and num_processes > 1:
        raise UsageError(f"--param_offload keeps trained weights on the CPU, which DDP cannot wrap; it needs one process "
                         f"(got {num_processes})")
    if args.generation_copy_dtype != "bfloat16" and not args.generation_copy:
        raise UsageError(f"--generation_copy_dtype {args.generation_copy_dtype} sets the dtype of --generation_copy's "
                         "copy: add --generation_copy (or leave --generation_copy_dtype at bfloat16)")
    if args.generation_copy_in_place:
        problem = ("needs --generation_copy (it is how that copy is made)" if not args.generation_copy else
                   "needs --use_lora (it merges the adapters into the base)" if not args.use_lora else
                   "needs a bf16 base, not a 4-bit or 8-bit one (use --generation_copy_dtype int8 for QLoRA)"
                   if args.load_in_4bit or args.load_in_8bit else
                   f"needs --torch_dtype bfloat16 (the base is {args.torch_dtype})" if args.torch_dtype != "bfloat16" else
                   "needs --generation_copy_dtype bfloat16 (an int8 copy holds codes of its own)"
                   if args.generation_copy_dtype != "bfloat16" else
                   "cannot merge into --param_offload's CPU weights" if args.param_offload else None)
        if problem:
            raise UsageError(f"--generation_copy_in_place {problem}")
    if args.kv_cache_dtype == "fp8" and args.generation_backend == "hf":
        raise UsageError("--kv_cache_dtype fp8 needs this project's static KV cache: use --generation_backend static, "
                         "cudagraph, compiled or auto (transformers' generate keeps its own cache)")
    if args.share_prompt_cache and (args.generation_backend == "hf" or args.kv_cache_dtype == "fp8"
                                    or args.actor_device == "balanced"):
        raise UsageError("--share_prompt_cache keeps the prompts' keys and values in this project's static KV cache: "
                         + ("use --generation_backend static, cudagraph, compiled or auto (transformers' generate keeps "
                            "its own cache)" if args.generation_backend == "hf" else
                            "not yet with --kv_cache_dtype fp8 (use one or the other)" if args.kv_cache_dtype == "fp8"
                            else "not yet with --actor_device balanced (the policy's layers on several GPUs)"))
    if args.generation_backend in CAPTURED_BACKENDS:
        moving = ("--param_offload (the offloaded weights are copied to the GPU anew at each rollout)"
                  if args.param_offload and not args.generation_copy else
                  "--actor_device balanced (the layers live on several GPUs)" if args.actor_device == "balanced" else None)
        if moving:
            raise UsageError(f"--generation_backend {args.generation_backend} replays a CUDA graph that reads the "
                             f"weights at fixed addresses, which {moving} does not keep; use --generation_backend "
                             "static" + (", or add --generation_copy (a bf16 copy that stays on the GPU)"
                                         if args.param_offload else ""))
    if args.param_offload and not [p for p in args.offload_policy.split(",") if p.strip()]:
        raise UsageError("--param_offload needs --offload_policy (e.g. embedding,lm_head)")
    if args.param_offload and args.mixed_precision == "fp16":  # the scaler unscales only the optimizer's own groups
        raise UsageError("--param_offload with --mixed_precision fp16: the offloaded weights step on the CPU through "
                         "their own optimizer, whose gradients fp16's loss scaler would not unscale; use "
                         "--mixed_precision bf16 (or no)")


def torch_cuda_available():
    import torch

    return torch.cuda.is_available()


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]
