"""Planner: the GPU memory and the time a run will need, per role, component and phase, estimated
from the model's config alone (no weights loaded), and the fastest configuration that fits a budget.

    python -m utils.plan --model qwen2.5-7b --workload --gpu_memory 48GB       # a workload shape, a 48 GB card
    python -m utils.plan --model Qwen/Qwen2.5-1.5B-Instruct --algo ppo --gpu_memory 24GB -- --use_lora
    python -m utils.plan --measured                                            # vs the H200 runs

Arguments after `--` are the training script's flags (the same parser, so the same names and
defaults). Memory (estimate) is per process and counts what the scripts allocate: weights, gradients
and optimizer state of each role, the KV cache and prefill of generation, activations (all layers, or
only each layer's input under checkpointing, plus one layer recomputed), the LM head's logits with
their fp32 copies, the bf16 copies autocast makes of fp32 weights during a forward and torchao's 4-bit
step buffers. Reserved memory is allocated memory plus the allocator's slack (a fitted fraction).
Time (estimate_time) is seconds per phase: bytes over the bandwidth, FLOPs over the matmul rate,
host-link bytes, per-layer and per-micro-batch overheads. search() tries every combination of the flags
the user left unset and keeps the fastest that fits. The coefficients marked `fitted` were fitted to
the H200 runs below (MEASURED for memory, TIME_FIT for time); HELD_OUT, TIME_HELD_OUT and BUDGET_RUNS
were not used (`--measured` prints estimate against measurement for each).

This module imports no runtime code (utils.base and utils.cli only; the scripts' Args to parse flags)."""

import math
import sys
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from utils.base import (CAPTURED_BACKENDS, GIB, PREFILL_CHUNK, REWARD_BATCH_ROWS, STEP_SLICE, own_gpus, parse_memory,  # noqa: F401
                        resolve_generation_backend, resolve_share_prompt_cache, static_cache_len,
                        unshareable_attention)

# the workload shapes (benchmarks/README.md); benchmarks/memory.py builds its models from these
SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}

# fitted: bytes per token per layer of a decoder layer's activations kept for backward (in units of
# hidden and intermediate size), bytes per logit position x vocab of the loss's logits path, the
# allocator's slack, and generation's prefill bytes per prompt token x hidden
LAYER_ACT_HIDDEN, LAYER_ACT_INTER = 34, 8
# counted, not fitted: --torch_compile's layers keep 4 of the MLP's 8 bytes per token x intermediate (gate's and up's
# outputs; Inductor's partitioner recomputes act(gate) and the product in backward). Added after the 7b 80GB budget
# row without checkpointing (micro-batches of 2, 2026-12-03) updated at 56.88 GiB allocated against 61.02 estimated
LAYER_ACT_INTER_COMPILED = 4
LOGIT_BYTES, LOGIT_BYTES_NO_GRAD = 14, 10
# counted, not fitted: since the logprobs and entropy come from one autograd Function (utils/ops.py
# logprobs_and_entropy, 2026-12-06) a chunk holds its logits and, in backward, their gradient, in the logits' dtype
# (bf16 under autocast or bf16 weights: 4 bytes; float32 without autocast: 8), no float32 copy or probabilities; a
# no-grad chunk as many at most. Checked by the 1.5b 24GB row's flags measured before and after on one H100 (update
# 17.62 -> 15.76 GiB allocated, 16.84 estimated; ref 9.98 -> 9.33, 9.24 estimated). The constants above are those
# of the runs measured before (logits_fused=False), all under autocast
LOGIT_COPIES_FUSED = 2
# the time the Function saved (bytes per logit position x vocab and pass, at the bandwidth): an update's forward,
# recompute and backward of the logits, and a no-grad pass (reference, old logprobs). Fitted: the mean of the three
# before/after pairs on one H100 (2026-12-06; 1.0e10 logits a step, 128 rows x 513 positions x 152k): update 0.40 s (1.5b
# 24GB), 0.22 (7b QLoRA 24GB), 0.57 (7b LoRA 24GB), ref 0.09, 0.05, 0.20 -- a spread of about +-45% around the mean,
# not explained by the chunk size (the first two both ran chunks of 1024)
LOGIT_PASSES_SAVED, LOGIT_PASSES_SAVED_NO_GRAD = 120, 34
RESERVED_SLACK = 0.08
# --empty_cache_between_phases hands the cached blocks back after every phase, so a phase's peak meets less
# of the earlier phases' fragments: set (not held out) from the budget rows run with it, all decoding with
# the compiled step, whose reserved peak was 1.2-4.4% above the allocated one (W-PPO 7b 1.2, 7b LoRA 24GB
# 1.9, 7b 48GB 2.0, 7b QLoRA 12GB 4.4); without the flag they measured 3.9-10.7%. generate's growing cache
# fragments the pool within its own phase: hf keeps RESERVED_SLACK
RESERVED_SLACK_EMPTIED = 0.05
PREFILL_BYTES = 12
# counted, not fitted: the prefill's MLP holds three [prompt tokens, intermediate] bf16 tensors at once
# (act(gate), up and their product), 6 bytes per prompt token x intermediate. Added after the H200's
# per-phase peaks showed generation short by 1.2-4.2 GiB at 7b (80GB full, W-PPO 7b, LoRA and QLoRA
# rows; the 7b QLoRA 12GB row ran out of memory there); with it the six generation phases of PHASE_PEAKS
# are within 5%
PREFILL_INTER_BYTES = 6


# the embedded tiny model of utils/toy.py (Llama: no q/k/v biases); tests/test_plan.py checks it against
# the model toy.build_model builds
TOY_SHAPE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v; Llama only with attention_bias
    unshareable: Optional[str] = None  # why --share_prompt_cache's step cannot read its attention (sliding windows)

    @classmethod
    def from_config(cls, config):
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        qwen2 = (get("model_type") or "qwen2") == "qwen2"
        return cls(get("vocab_size"), get("hidden_size"), get("intermediate_size"), get("num_hidden_layers"),
                   get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads"),
                   bool(get("tie_word_embeddings", False)), bool(get("attention_bias", qwen2)),
                   unshareable_attention(config))

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @cached_property  # read ~10^6 times by a search
    def linear_params(self):  # the decoder layers' Linear weights: what bitsandbytes quantises
        kv = self.kv_heads * self.head_dim
        return self.layers * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.inter)

    @cached_property
    def embedding_params(self):
        return self.vocab * self.hidden

    @cached_property
    def params(self):
        biases = (self.hidden + 2 * self.kv_heads * self.head_dim) if self.qkv_bias else 0
        norms_biases = self.layers * (2 * self.hidden + biases) + self.hidden
        return self.linear_params + norms_biases + self.embedding_params * (1 if self.tied else 2)

    def lora_params(self, r):  # all-linear adapters: r x (in + out) per Linear
        kv = self.kv_heads * self.head_dim
        per_layer = (r * (2 * self.hidden) * 2 + r * (self.hidden + kv) * 2 + 3 * r * (self.hidden + self.inter))
        return self.layers * per_layer


def load_shape(model) -> Shape:
    """A workload shape name, anything AutoConfig loads (hub id, local folder; no weights), or
    None: the embedded tiny model."""
    if model is None:
        return Shape.from_config(TOY_SHAPE)
    if model in SHAPES:
        return Shape.from_config(SHAPES[model])
    import os

    from transformers import AutoConfig

    if os.path.sep in model and not os.path.isdir(model):
        raise ValueError(f"model {model!r}: no such folder; expected a workload shape ({', '.join(SHAPES)}), a local "
                         "folder with a config.json or a hub id")
    if not os.path.isdir(model):
        from huggingface_hub import try_to_load_from_cache

        cached = isinstance(try_to_load_from_cache(model, "config.json"), str)
        if not cached and ("/" not in model or os.environ.get("HF_HUB_OFFLINE") == "1"):
            raise ValueError(f"model {model!r}: not a workload shape ({', '.join(SHAPES)}), a local folder or a hub "
                             "id in the local cache")
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as e:  # transformers' chained errors: one line for the user
        raise ValueError(f"model {model!r}: not a workload shape ({', '.join(SHAPES)}) and its config could not be "
                         f"loaded ({str(e).splitlines()[0][:160]})") from None
    return Shape.from_config(getattr(config, "text_config", config))


def _storage_bytes(args):
    """(bytes per trained weight in --torch_dtype, bytes per quantised frozen weight with --load_in_4bit /
    --load_in_8bit (with the scales; 4-bit's double-quantised unless --use_bnb_nested_quant false) or None)."""
    trained = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}[args.torch_dtype]
    nested = args.use_bnb_nested_quant
    return trained, ((0.52 if nested else 0.52 + NESTED_SAVED_BYTES) if args.load_in_4bit else 1.02 if args.load_in_8bit
                     else None)


def _optimizer_bytes_per_param(optim, weight_bytes):
    if optim == "adamw_torch":
        return 2 * weight_bytes  # two moments in the weights' dtype (fp32; bf16 for torchao's SR AdamW)
    return {"adamw_8bit": 2.03, "paged_adamw_8bit": 2.03, "adamw_4bit": 1.06}[optim]  # measured, with scales


def _frozen_bytes(shape, params, quant):
    """A frozen model's weights: bf16, or the decoder Linears at `quant` bytes (4/8-bit) and the rest bf16."""
    return (shape.linear_params * quant + (params - shape.linear_params) * 2) if quant else params * 2


def generation_copy_bytes(shape, dtype="bfloat16"):
    """--generation_copy's weights: bf16, or (--generation_copy_dtype int8) every Linear, the LM head too, as
    int8 codes (the per-row bf16 scales are ~0.05% more) and the embedding and norms in bf16."""
    if dtype != "int8":
        return shape.params * 2
    bf16_part = shape.params - shape.linear_params - (0 if shape.tied else shape.embedding_params)
    return shape.linear_params + shape.embedding_params + 2 * bf16_part


def _offloaded_embeddings(shape, policy: str) -> set:
    """--param_offload --offload_policy `policy` -> which of the modules {"embedding", "lm_head"} have their weight
    in CPU memory: each one named; with tied weights (one matrix for both) naming either moves both, as
    utils/offload.py moves every module that uses a moved weight."""
    named = {p.strip() for p in policy.split(",")} & {"embedding", "lm_head"}
    return {"embedding", "lm_head"} if (shape.tied and named) else named


def generation_copy_shared_bytes(shape, args):
    """Bytes of --generation_copy that are the policy's own tensors, not copies (utils/generation.py holds the
    tensor of a module without an adapter that the policy keeps in bf16 on the GPU): the norms and the
    embedding, and in a bf16 copy the untied LM head (LoRA adapts the decoder's Linears only) and, without
    LoRA or with --generation_copy_in_place (the adapters merged into the base itself), every weight. QLoRA
    keeps those in bf16; LoRA and full training with --torch_dtype bfloat16."""
    train_bytes, quant = _storage_bytes(args)
    if not args.generation_copy or (2 if (args.use_lora and quant) else train_bytes) != 2:
        return 0
    moved = _offloaded_embeddings(shape, args.offload_policy) if args.param_offload else set()
    norms = shape.params - shape.linear_params - shape.embedding_params * (1 if shape.tied else 2)
    shared = norms + (0 if "embedding" in moved else shape.embedding_params)
    if args.generation_copy_dtype == "bfloat16":
        shared += 0 if (shape.tied or "lm_head" in moved) else shape.embedding_params
        shared += shape.linear_params if _copy_shares_linears(args) else 0
    return 2 * shared


def _copy_shares_linears(args):
    """Whether a bf16 --generation_copy's decoder Linears are the policy's own bf16 tensors: full training in bf16,
    or LoRA merged into the base itself (--generation_copy_in_place; all-linear adapters assumed)."""
    train_bytes, quant = _storage_bytes(args)
    return (args.generation_copy and args.generation_copy_dtype == "bfloat16"
            and (2 if (args.use_lora and quant) else train_bytes) == 2
            and (not args.use_lora or args.generation_copy_in_place))


def copy_fuses_projections(args):
    """Whether --generation_copy fuses q/k/v and gate/up (utils/generation.py _fuse_projections): a bf16 copy that
    holds them in its own storage, not the policy's (float32 full training, LoRA merged into a copy, QLoRA)."""
    return args.generation_copy and args.generation_copy_dtype == "bfloat16" and not _copy_shares_linears(args)


def embedding_rows(vocab, tokens):
    """Distinct rows `tokens` ids touch, expected for ids uniform over the vocabulary (text, whose ids follow
    Zipf's law, touches fewer): what --param_offload's embedding copies per micro-batch."""
    return vocab * (1 - math.exp(-tokens / vocab))


def in_place_backup_bytes(shape, args):
    """--generation_copy_in_place: the exact bf16 base of the decoder's Linears (LoRA's all-linear targets),
    kept once in pinned CPU memory and written back after each rollout."""
    return 2 * shape.linear_params if (args.generation_copy and args.generation_copy_in_place) else 0


def owned_gpus(num_processes) -> int:
    """The GPUs each process owns (utils/placement.py: with several processes, --ref_device cuda:1
    names a process's own second GPU): the last rank's count, the fewest; 1 without GPUs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, len(own_gpus(num_processes - 1, num_processes, count)))


def kv_bytes_per_token(shape, kv_cache_dtype="auto") -> int:
    """The KV cache of one token: keys and values of every layer, in bf16, or with --kv_cache_dtype fp8
    one byte an element plus a float32 scale per head (utils/generation.py fp8_codes)."""
    if kv_cache_dtype == "fp8":
        return shape.layers * 2 * shape.kv_heads * (shape.head_dim + 4)
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * 2


def planned_backend(shape, args, engine="single") -> str:
    """The --generation_backend a run of these flags on a GPU uses (`auto` resolved as the scripts do)."""
    kind = "balanced" if args.actor_device == "balanced" else "device"
    return resolve_generation_backend(args.generation_backend, "cuda", kind, engine, args.param_offload,
                                      args.generation_copy, shape.params, args.kv_cache_dtype,
                                      args.share_prompt_cache)[0]


def planned_share(shape, args, algo, backend) -> bool:
    """--share_prompt_cache as a run of these flags on a GPU resolves it with `backend` (the resolved
    --generation_backend; the scripts' utils/base.py resolve_share_prompt_cache): off unset where the model's
    config has sliding windows or softcapping (`shape.unshareable`), its attention otherwise assumed reached
    through transformers' attention interface."""
    return resolve_share_prompt_cache(args.share_prompt_cache, backend, "cuda",
                                      args.num_generations if algo == "grpo" else 1, args.kv_cache_dtype,
                                      "balanced" if args.actor_device == "balanced" else "device",
                                      args.attn_implementation, shape.unshareable)[0]


def prompts_per_slice(args, algo, rows, slice_rows) -> list:
    """--share_prompt_cache: the distinct prompts of each generation slice of `slice_rows` rows, which it prefills
    and caches once each. GRPO's rows come in groups of --num_generations consecutive rows of one prompt
    (train_grpo.py repeat_interleave), and the slices keep each group contiguous and starting at a multiple of the
    group (generate_completions orders the rows by prompt length with a stable sort, and a group's rows have one
    length), so the slice from row `start` to `end` holds the groups of its first and last rows and those between:
    rows / group for slices of whole groups, one prompt for slices within a group. PPO: one row per prompt."""
    group = args.num_generations if algo == "grpo" else 1
    return [(min(start + slice_rows, rows) - 1) // group - start // group + 1 for start in range(0, rows, slice_rows)]


def _other_gpu(device) -> bool:
    """A role placed on a GPU other than the process's first (cuda:0 in the planner's terms)."""
    return bool(device) and device.startswith("cuda:") and device != "cuda:0"


def estimate(shape: Shape, args, algo="grpo", num_processes=1, copy_shares=True, updates_apart=True,
             swapped_moments_for_step=True, logits_fused=True) -> dict:
    """Bytes per component and per phase for one process. `args`: the script's Args (flags). copy_shares=False:
    a generation copy that holds its own copy of every tensor (as before 2026-12-02; the runs measured then).
    updates_apart=False: PPO's actor and critic passes interleaved per micro-batch, both roles' gradients alive
    in both update phases (train_ppo.py before 2026-12-03 9d89c71; the PPO runs measured then).
    swapped_moments_for_step=False: a --critic_device swap critic's moments on the GPU for its whole update phase
    (before --optimizer_offload's OptimizerSwap took them, 2026-12-03; the three swap runs measured then).
    logits_fused=False: the logprobs and entropy through autograd's graph over float32 logits (before the
    logprobs_and_entropy Function, 2026-12-06; every run measured before).
    Roles placed on another GPU (`--ref_device cuda:1`, `--critic_device cuda:1`) are left out of the
    phases (the first GPU's) and counted in `other_gpus`: {device: estimated peak reserved bytes}."""
    P, C = args.max_prompt_length, args.max_completion_length
    T = P + C
    if algo == "grpo":
        rows = args.prompts_per_step // num_processes * args.num_generations
    else:
        rows = args.prompts_per_step // num_processes
    gen_rows = min(args.generation_slice_size or rows, rows)
    backend = planned_backend(shape, args)
    mixed = args.mixed_precision != "no"  # auto is bf16 on a GPU
    train_bytes, quant = _storage_bytes(args)  # bytes per trained weight, per quantised weight (or None)
    roles = ["actor"] + (["critic"] if algo == "ppo" else [])
    offloaded = critic_offloaded = 0  # parameters in CPU memory (--param_offload)
    if args.param_offload:
        policy = {p.strip() for p in args.offload_policy.split(",")}
        moved = _offloaded_embeddings(shape, args.offload_policy)
        offloaded = shape.embedding_params * (1 if shape.tied and moved else len(moved))  # tied: one matrix
        # a critic has no LM head (lm_head matches nothing in it, utils/offload.py strict=False): its embedding only
        critic_offloaded = shape.embedding_params if "embedding" in policy else 0
    comp = {}
    for role in roles:
        head = shape.embedding_params if role == "actor" and not shape.tied else shape.hidden  # value head
        role_params = shape.params - (0 if role == "actor" else (0 if shape.tied else shape.embedding_params)) + (
            0 if role == "actor" else head)
        on_gpu = role_params - (offloaded if role == "actor" else critic_offloaded)
        if args.use_lora:
            base_bytes = quant if quant else train_bytes
            rest = on_gpu - shape.linear_params
            weights = shape.linear_params * base_bytes + rest * (2 if quant else train_bytes)
            trainable, trainable_bytes = shape.lora_params(args.lora_r), 4
            weights += trainable * trainable_bytes
        else:
            weights, trainable, trainable_bytes = on_gpu * train_bytes, on_gpu, train_bytes
        comp[f"{role}/weights"] = weights
        comp[f"{role}/gradients"] = trainable * trainable_bytes
        comp[f"{role}/optimizer"] = trainable * _optimizer_bytes_per_param(args.optim, trainable_bytes)
        # autocast casts fp32 trained weights to bf16 once per forward and keeps the copies until it ends
        comp[f"{role}/autocast_copies"] = trainable * 2 if (mixed and trainable_bytes == 4 and not args.use_lora) else 0
    uses_ref = (args.beta > 0) if algo == "grpo" else (args.kl_coef > 0 or args.target_kl is not None)
    ref = swapped_ref = 0
    if uses_ref and not args.use_lora:
        if args.ref_device == "swap":  # on the GPU for the reference phase only
            swapped_ref = _frozen_bytes(shape, shape.params, quant)
        elif args.ref_device == "offload":
            ref = max(shape.embedding_params, shape.linear_params // shape.layers) * 2  # one module at a time
        elif args.ref_device in (None, "cuda", "cuda:0"):
            ref = _frozen_bytes(shape, shape.params, quant)
    comp["ref/weights"] = ref
    # a reward model (W-PPO: a sequence classifier of the policy's shape; its head is one number)
    reward_state = 0
    if args.reward_model_name_or_path:
        body = shape.params - (0 if shape.tied else shape.embedding_params)
        reward_state = _frozen_bytes(shape, body, quant)
    reward_elsewhere = bool(reward_state) and _other_gpu(args.reward_device)
    comp["reward/weights"] = (0 if not reward_state or args.reward_device in ("cpu", "swap") or reward_elsewhere
                              else max(shape.embedding_params, shape.linear_params // shape.layers) * 2
                              if args.reward_device == "offload" else reward_state)
    cache_len = T if backend == "hf" else static_cache_len(P, C)  # the static cache is rounded up
    comp["generate/kv_cache"] = gen_rows * cache_len * kv_bytes_per_token(shape, args.kv_cache_dtype)
    # --share_prompt_cache (static-cache backends; never with fp8, utils/args.py refuses it): a prompt cache of the
    # slice's distinct prompts (the slice holding the most) and a completion cache of its rows, each rounded up
    shared = planned_share(shape, args, algo, backend) and backend != "hf"
    prompt_rows = max(prompts_per_slice(args, algo, rows, gen_rows)) if shared else gen_rows
    if shared:
        comp["generate/kv_cache"] = (prompt_rows * static_cache_len(P, 0) + gen_rows * static_cache_len(0, C)) \
            * kv_bytes_per_token(shape, args.kv_cache_dtype)
    # --kv_cache_dtype fp8: one layer's keys and values dequantised to bf16 while attention reads them
    comp["generate/kv_dequantised"] = (gen_rows * cache_len * kv_bytes_per_token(shape) // shape.layers
                                       if args.kv_cache_dtype == "fp8" else 0)
    comp["generate/copy"] = (generation_copy_bytes(shape, args.generation_copy_dtype)  # --generation_copy
                             - (generation_copy_shared_bytes(shape, args) if copy_shares else 0)
                             if args.generation_copy else 0)
    # what a rollout leaves allocated for the next one (a captured decoder's KV cache, the copy), unless
    # --empty_cache_between_phases drops them
    kept = 0 if args.empty_cache_between_phases else comp["generate/copy"] + (
        comp["generate/kv_cache"] if backend in CAPTURED_BACKENDS else 0)
    prefill_len = min(args.prefill_chunk_size or P, P)  # prompt positions per prefill forward
    prefill_per_token = shape.hidden * PREFILL_BYTES + shape.inter * PREFILL_INTER_BYTES
    # the prefill's activations, and each row's last-position logits twice in float32 (the LM head's output and the
    # sampling's scaled copy). --share_prompt_cache prefills the distinct prompts only; their [U, V] logits stay
    # while the rows' [R, V] gathered copy and its scaled copy are made
    comp["generate/prefill"] = prompt_rows * prefill_len * prefill_per_token + gen_rows * shape.vocab * 8 + (
        prompt_rows * shape.vocab * 4 if shared else 0)
    # the static and captured backends allocate the whole cache before the prefill; generate's cache
    # grows from the prompt's keys and values, so its prefill meets only those
    gen_kv = comp["generate/kv_cache"] + comp["generate/prefill"] if backend != "hf" else max(
        comp["generate/kv_cache"], comp["generate/kv_cache"] * P // cache_len + comp["generate/prefill"])
    # micro-batch of the update and the no-grad passes
    if args.use_dynamic_bsz:
        tokens = min(args.max_token_len_per_gpu // T, rows) * T
    else:
        tokens = min(args.per_device_train_batch_size, rows) * T
    positions = tokens // T * (C + 1)
    layer_act = tokens * (LAYER_ACT_HIDDEN * shape.hidden
                          + (LAYER_ACT_INTER_COMPILED if args.torch_compile else LAYER_ACT_INTER) * shape.inter)
    residual_bytes = 4 if train_bytes == 4 and not args.use_lora else 2
    if args.use_gradient_checkpointing:
        saved = 0 if args.activation_offload else shape.layers * tokens * shape.hidden * residual_bytes
        comp["update/activations"] = saved + layer_act
    else:
        comp["update/activations"] = shape.layers * layer_act
    chunk = min(args.logprob_chunk_size or positions, positions)
    logit_bytes = 4 if train_bytes == 4 and not mixed else 2  # the LM head's output dtype
    comp["update/logits"] = chunk * shape.vocab * (LOGIT_COPIES_FUSED * logit_bytes if logits_fused
                                                   else LOGIT_BYTES) + positions * shape.hidden * 4
    if args.logprob_chunk_size and not args.use_lora:  # the head's weight gradient, summed over chunks
        comp["update/logits"] += 2 * shape.vocab * shape.hidden * train_bytes
    # a no-grad pass keeps no activations: its peak is the larger of a layer's MLP's [tokens, intermediate] bf16
    # tensors and the LM head's chunk, which comes after the last layer. Eager layers (the LoRA and QLoRA rows): 8
    # bytes a token and intermediate, four such tensors (every 7b LoRA/QLoRA reference phase measured held 7.8-8.6
    # bytes a token and intermediate above the weights, at micro-batches of 8-32 and chunks of 256-1024, before and
    # after the logprob Function; counted before as gate's and up's outputs beside the chunk, which fitted while the
    # chunk held 10 bytes a logit and left the runs since the Function 10-12% short). Compiled layers
    # (--torch_compile; the reference is compiled too): gate's, up's and their product's outputs, freed inside the
    # layer's graph (their sum with the chunk had the 1.5b rows at micro-batches of 16-32 with chunks of 1024 at +5%
    # to +9%, 2026-12-03)
    head_chunk = chunk * shape.vocab * (LOGIT_COPIES_FUSED * logit_bytes if logits_fused else LOGIT_BYTES_NO_GRAD)
    compiled_layers = args.torch_compile and not args.use_lora  # LoRA under --torch_compile: not measured
    no_grad_mlp = tokens * shape.inter * (6 if compiled_layers else 8)
    comp["ref/logits"] = max(head_chunk, no_grad_mlp)
    # a reward model's forward: REWARD_BATCH_ROWS rows of its own (utils/rewards.py), eager, whatever the micro-batch;
    # 12 bytes per token x intermediate (fitted: the three W-PPO 1.5b rows with a swapped reward model, micro-batches of
    # 4 to 32, each held 1.23 GiB above its weights in the reward phase, 2026-12-03; counted before as a quarter of
    # the reference pass's, -7% to -9%). Not measured at 7b
    comp["reward/pass"] = min(REWARD_BATCH_ROWS, rows) * T * shape.inter * 12 if args.reward_model_name_or_path else 0
    # torchao's 4-bit step (compiled) allocates int64 buffers the size of the parameter it steps (on the H200,
    # before utils/optim.py stepped large ones in slices: 1.74 GiB for the 1.5b embedding, 4.06 GiB for the 7b
    # one; both runs ran out of memory there): the largest parameter or STEP_SLICE elements, the smaller
    embeddings_on_gpu = (1 if shape.tied else 2) - offloaded // shape.embedding_params
    largest = 0 if args.use_lora else shape.embedding_params if embeddings_on_gpu else shape.hidden * shape.inter
    stepped = min(largest, STEP_SLICE)
    comp["update/optimizer_step"] = 16 * stepped if args.optim == "adamw_4bit" else 0  # with what else was live there

    other = {}  # another GPU -> its peak: the role's state plus its own pass
    if reward_elsewhere:
        other[args.reward_device] = reward_state + comp["reward/pass"]
    ref_elsewhere = _other_gpu(args.ref_device) and uses_ref and not args.use_lora
    if ref_elsewhere:
        other[args.ref_device] = other.get(args.ref_device, 0) + _frozen_bytes(shape, shape.params, quant) \
            + comp["ref/logits"]
    critic_elsewhere = algo == "ppo" and _other_gpu(getattr(args, "critic_device", None))
    here = [r for r in roles if not (r == "critic" and critic_elsewhere)]
    if critic_elsewhere:
        other[args.critic_device] = other.get(args.critic_device, 0) + sum(
            comp[f"critic/{k}"] for k in ("weights", "gradients", "optimizer")) + comp["update/activations"] \
            + positions * shape.hidden * 4
    # --critic_device swap: the critic's weights on the GPU in its values and update phases only, its moments for
    # its optimizer step only; --optimizer_offload: every trained role's moments for its step only
    critic_swapped = algo == "ppo" and getattr(args, "critic_device", None) == "swap"
    resident_roles = [r for r in here if not (r == "critic" and critic_swapped)]
    # {trained role: its moments out of the GPU between optimizer steps} (estimate_time reads it for the copies)
    moments_out = {r: getattr(args, "optimizer_offload", False) or (r == "critic" and critic_swapped) for r in roles}
    step_moments = {r: comp[f"{r}/optimizer"] if moments_out[r] else 0 for r in here}
    swapped_critic = comp["critic/weights"] if critic_swapped else 0
    if critic_swapped and not swapped_moments_for_step:  # as the first swap runs had it: the whole phase
        swapped_critic, step_moments["critic"] = swapped_critic + comp["critic/optimizer"], 0
    static = sum(comp[f"{r}/weights"] + (0 if moments_out[r] else comp[f"{r}/optimizer"]) for r in resident_roles) \
        + comp["ref/weights"] + comp["reward/weights"]
    # train_ppo.py steps the actor (all its micro-batches), then the critic: one role's gradients at a time
    grads = {r: comp[f"{r}/gradients"] for r in here} if updates_apart else dict.fromkeys(
        here, sum(comp[f"{r}/gradients"] for r in here))
    casts = comp["actor/autocast_copies"]
    # compiled, checkpointed decoder layers cast their weights inside their own graphs, freed with the layer;
    # autocast's cache then holds only the LM head's bf16 copy (plus the layer being run)
    update_casts = ((shape.embedding_params + shape.linear_params // shape.layers) * 2
                    if casts and args.torch_compile and args.use_gradient_checkpointing else casts)
    # a checkpointed update meets the LM head's chunks after the last layer's forward and before the first layer's
    # recompute: beside the saved layer inputs, not beside a layer's activations. Counted apart for compiled full-
    # parameter updates of an untied head, fitted to the 7b 80GB checkpointed micro-batch-32 runs (2026-12-03 and
    # 12-04: update 57.73 and 57.40 GiB allocated, 61.42 estimated with the two summed, 57.14 apart; HEAD_APART_FIT).
    # A tied head (1.5b) keeps the sum: its compiled, checkpointed updates measured 0.2-0.8 GiB above the parts
    # counted apart (16 runs); the head's gradient waits in autograd's buffer for the embedding's through the layers'
    # backward, and the sum bounds that
    head_apart = args.use_gradient_checkpointing and args.torch_compile and not args.use_lora and not shape.tied
    layer_then_head = max(update_casts + comp["update/activations"],
                          comp["update/activations"] - (layer_act if head_apart else 0) + comp["update/logits"])
    phases = {
        "generate": static + gen_kv + comp["generate/kv_dequantised"] + comp["generate/copy"]
        + (0 if args.generation_copy else casts),
        "ref": static + kept + (0 if ref_elsewhere else comp["ref/logits"]) + swapped_ref
        + (shape.embedding_params * 2 if args.ref_device == "offload" else 0),
        "actor_update": static + kept + grads["actor"] + max(layer_then_head,
                                                    comp["update/optimizer_step"] + step_moments["actor"]),
    }
    if reward_state and args.reward_device == "swap":  # the reward model on the GPU for its phase only
        phases["reward"] = static + kept + reward_state + comp["reward/pass"]
    if critic_swapped:  # its values pass: the weights, a no-grad layer's MLP intermediates and the float32 hidden
        # states the value head reads (no LM head; the W-PPO 1.5b runs of 2026-12-03: -2.4% at micro-batches of 16,
        # -3.1% at 32, where the reward model's count, a quarter of the reference pass's, was -5% and -7%)
        phases["values"] = static + kept + comp["critic/weights"] + tokens * (shape.inter + shape.hidden) * 4
    if algo == "ppo" and not critic_elsewhere:
        phases["critic_update"] = static + kept + swapped_critic + grads["critic"] + max(
            comp["update/activations"] + positions * shape.hidden * 4, step_moments["critic"])
    peak_allocated = max(phases.values())
    slack = RESERVED_SLACK_EMPTIED if args.empty_cache_between_phases and backend != "hf" else RESERVED_SLACK
    return dict(components=comp, phases=phases, peak_allocated=peak_allocated,
                other_gpus={device: used * (1 + slack) for device, used in other.items()},
                peak_reserved=peak_allocated * (1 + slack),
                host_bytes=offloaded * (train_bytes * 2 + _optimizer_bytes_per_param(args.optim, train_bytes))
                + (shape.params * 2 if args.ref_device in ("offload", "swap") else 0)
                + (reward_state if args.reward_device in ("offload", "swap", "cpu") else 0)
                + (comp["critic/weights"] if critic_swapped else 0)
                + sum(comp[f"{r}/optimizer"] for r in here if moments_out[r])
                + in_place_backup_bytes(shape, args),
                tokens_per_micro_batch=tokens, rows=rows, moments_out=moments_out)


# ----------------------------------------------------------------------------------------------
# Time: seconds per phase of one step, from the bytes and FLOPs each phase moves, over a GPU's
# measured rates, with efficiencies fitted to the H200 runs in MEASURED_TIME (held-out runs in
# HELD_OUT_TIME were not used; `--measured` prints both)

# GPU rates: bandwidth (B/s, a device-to-device copy), dense bf16 matmul (FLOP/s) and the host link
# (B/s, pinned host-to-device). The H200's are measured here; the others are their datasheets' rates
# scaled by the H200's measured/datasheet ratio (0.89 bandwidth, 0.80 matmul): estimates, not measurements.
GPUS = {
    "h200": dict(name="NVIDIA H200", bandwidth=4.26e12, matmul=7.9e14, host=5.0e10),
    "h100": dict(name="NVIDIA H100 80GB HBM3", bandwidth=2.98e12, matmul=7.9e14, host=5.0e10),
    "a100-80gb": dict(name="NVIDIA A100-SXM4-80GB", bandwidth=1.82e12, matmul=2.5e14, host=2.5e10),
    "a100-40gb": dict(name="NVIDIA A100-SXM4-40GB", bandwidth=1.38e12, matmul=2.5e14, host=2.5e10),
    "l40s": dict(name="NVIDIA L40S", bandwidth=7.7e11, matmul=2.9e14, host=2.5e10),
    "a6000": dict(name="NVIDIA RTX A6000", bandwidth=6.8e11, matmul=1.24e14, host=2.5e10),
    "rtx4090": dict(name="NVIDIA GeForce RTX 4090", bandwidth=9.0e11, matmul=1.32e14, host=2.5e10),
}

# fitted (MEASURED_TIME): matmuls run at MATMUL_EFF of the matmul rate; the rest of a layer's work
# (norms, RoPE, attention, activations, residuals) moves ELEMENTWISE_BYTES x (34 hidden + 8
# intermediate) bytes per token and layer, at the bandwidth (x UPDATE_ELEMENTWISE in an update's
# forward, recompute and backward); --torch_compile's fused kernels move COMPILED_* of that
MATMUL_EFF = 0.95  # held, not fitted (large bf16 GEMMs): the elementwise term takes the rest
ELEMENTWISE_BYTES = 2.9
UPDATE_ELEMENTWISE = 5.7
COMPILED_FORWARD, COMPILED_UPDATE = 0.17, 0.49
# decoding: one step reads the weights and every row's KV cache at DECODE_EFF of the bandwidth, plus a
# fixed time per layer (kernel launches and sampling: none captured in a graph, fused when compiled)
DECODE_EFF = 0.93
# (refitted 2026-12-03 to the step with utils/decode_attention.py's kernel, which reads only the cache positions the
# mask keeps: benchmarks/decode_step.py --shape qwen2.5-7b --backends compiled --dtypes bf16 --short 400 --long 512 on
# the H200, 7.37 ms a step at 128 rows against 8.36 ms through SDPA, the same run with --sdpa, which reads all 768
# positions; 0.81 before, fitted under SDPA. Checked on the 7b 80GB budget row's generate: 4.41 s measured, 4.39
# estimated. DECODE_LAYER_S below was fitted under SDPA and is kept: one step's time does not separate the two terms)
# --generation_copy_dtype int8: utils/int8.py's kernel reads the codes at INT8_DECODE_EFF of bf16's efficiency
# per byte, at 64 rows a slice (fitted to the 7b QLoRA 24GB budget row after the kernel's splits of K,
# 2026-12-02: generate 9.20 s; 0.43 before them, generate 9.86 s; 0.48 then, with DECODE_EFF 0.81, rescaled to
# 0.48 x 0.81 / 0.93 when DECODE_EFF was refitted, so the int8 weights' time is what it was); other row counts scaled
# as the kernel's time per byte against bf16's F.linear on the H200 (a 7b decoding step's matrix products,
# tests/gpu: 0.665 at 1-7 rows, 0.39 at 64, 0.305 at 128), linear in between
INT8_DECODE_EFF = 0.418
INT8_DECODE_ROWS = ((8, 0.665 / 0.39), (64, 1.0), (128, 0.305 / 0.39))


def int8_decode_eff(rows):
    """INT8_DECODE_EFF at a slice of `rows` rows (interpolated in INT8_DECODE_ROWS, held beyond its ends)."""
    points = INT8_DECODE_ROWS
    rows = min(max(rows, points[0][0]), points[-1][0])
    for (r0, f0), (r1, f1) in zip(points, points[1:]):
        if rows <= r1:
            return INT8_DECODE_EFF * (f0 + (f1 - f0) * (rows - r0) / (r1 - r0))
# --generation_copy's projections fused (utils/generation.py FUSE_PROJECTIONS): FUSED_LAYER_S less per layer and
# decoding step, measured at 1.5b only (H100, benchmarks/decode_step.py --backends compiled --dtypes fp32
# --generation_copy --short 400 --long 512, 128 rows, 2026-12-05: 3.84 ms a step unfused, 3.48 fused; the budget row's
# generate 2.32 -> 2.19 s), assumed the same per layer at other shapes and rows
FUSED_LAYER_S = 0.013e-3
# a float32 policy's captured decoding step with its matrix products through utils/int8.py's float32_mm (the float32
# weight read in the kernel where faster than autocast's cast at the shape's first call): the bytes a weight costs a
# step, as 8 (autocast: read, cast, read again) scaled by the kernel's time over autocast's for a step's products, 1.5b
# shape, 64 rows, one H100 (tests/gpu/test_gpu_generation.py test_float32_mm_matches_autocast_at_every_split_and_
# prints_its_time, 2026-12-07: 3.59 ms against 5.07; 3.17 against 4.89 at one row), assumed at other shapes and rows.
# Held out: the no-flags row on that H100 estimates generate 3.14 s, ran 3.08 (BUDGET_RUNS)
FLOAT32_KERNEL_BYTES = 8 * 3.59 / 5.07
DECODE_LAYER_S = {"compiled": 0.092e-3, "cudagraph": 0.174e-3, "static": 0.45e-3, "hf": 0.91e-3}  # cudagraph: compiled
# + the difference benchmarks/decode_step.py measured at 1.5b (6.10 - 3.80 ms over 28 layers); static: not measured
# bitsandbytes 4-bit: dequantising costs DEQUANT_S per weight at every matmul call (decode step,
# micro-batch pass); int8 is not measured (assumed twice that)
DEQUANT_S = {4: 2.7e-12, 8: 5.4e-12}
# ... and a decoding step (bitsandbytes dequantises each matrix to bf16, then cuBLAS reads it: memory-bound) moves
# DECODE_DEQUANT_BYTES per weight beyond the 4-bit codes, at the bandwidth: fitted to the 7b QLoRA 12GB budget row's
# rollouts after 43ac109 (o_proj's product no longer one-row products) on one H100, 2026-12-06 (slices of 64 rows:
# generate 22.07 s, 12.4 ms a decoding step for this term). The fit of 2026-12-01 (seconds per weight rising with
# the rows) had the one-row products in it. 8-bit: assumed twice 4-bit's
DECODE_DEQUANT_BYTES = {4: 5.28, 8: 10.56}
# --use_bnb_nested_quant false: the 4-bit blocks' statistics kept in float32 instead of double-quantised. Saves the
# statistics' own dequantising, a fixed cost per quantised matrix and product call (a kernel of its own, whatever the
# matrix's size): 0.90 ms of the 7b QLoRA decoding step at 64 rows (17.90 against 18.80 ms) and 0.83 ms of the 1.5b
# one (6.76 against 7.59 ms), 196 matrices each (H100, 2026-12-06, benchmarks/decode_step.py --backends
# compiled --dtypes qlora,qlora_unnested --rows 64). Per weight (the first fit) it would have predicted 0.18 ms at
# 1.5b. Taken per call for the training passes too (a few ms a step; the 7b budget rows' updates were within noise);
# costs NESTED_SAVED_BYTES a quantised weight (a float32 statistic per 64 weights against an 8-bit one and its
# float32 statistic per 256)
STATISTICS_CALL_S = 4.4e-6
NESTED_SAVED_BYTES = 4 / 64 - 1 / 64 - 4 / (64 * 256)


def unnested_saving_s(shape, bits, args):
    """Seconds one product call of every quantised Linear (7 a layer: q, k, v, o, gate, up, down) saves with
    --use_bnb_nested_quant false (4-bit only)."""
    return 7 * shape.layers * STATISTICS_CALL_S if bits == 4 and not args.use_bnb_nested_quant else 0.0


def dequant_s(shape, bits, args):
    """Seconds bitsandbytes' dequantising adds to one product call of every quantised Linear (DEQUANT_S a weight,
    fitted with double quantisation on)."""
    return shape.linear_params * DEQUANT_S[bits] - unnested_saving_s(shape, bits, args)


# LoRA through the unmerged adapter: per adapted Linear and call, eager (training passes, hf decoding)
# or inside a captured step. A bf16 base's inputs reach the float32 adapters uncast under autocast
# (utils/modeling.py skip_input_casts_under_autocast; PEFT's cast and its gradient's are not counted: with them
# the 7b LoRA 24GB row's update ran 11.96 s against 10.78 estimated, without them 10.21)
ADAPTER_EAGER_S, ADAPTER_CAPTURED_S = 200e-6, 15e-6  # captured: assumed (no run of it alone)
# transfers: --ref_device swap at the host link; --ref_device offload streams every micro-batch at
# OFFLOAD_STREAM of the link plus a per-phase setup at OFFLOAD_SETUP; --param_offload copies its
# modules 3 times per micro-batch (forward, recompute, gradient back) at PARAM_OFFLOAD of the link (refit
# 2026-12-05 to the 1.5b bf16 run with its tied embedding and head in CPU memory and HostStepped: update 6.47 s
# against 3.47 without, H100; 0.0436 before, fitted to a float32 run of 2026-11-30 whose CPU step has changed since)
OFFLOAD_STREAM, OFFLOAD_SETUP, PARAM_OFFLOAD = 0.15, 0.0124, 0.0838
# --param_offload: each offloaded weight's optimizer step runs on the CPU, on a CPU gradient made afresh each step
# and accumulated there, per parameter. Through torchao's compiled 8-bit step it took 1e-8 s (fitted to one run: 7b
# bf16, the untied input embedding, 16 host cores; H100, 2026-12-05: update 14.06 s against 8.48 estimated without
# the term). Since, the offloaded weights step through torch's fused CPU AdamW on a float32 master (utils/optim.py
# HostStepped): 3.4 ns a bf16 parameter against torchao's 41 on a 2-core CPU, so 1e-8 scaled by that ratio, assumed.
# Checked since by the 7b run with HostStepped (H100, 2026-12-05, held out): 17.57 s against 16.91 estimated (-4%),
# its update 9.20 s against 8.93
HOST_STEP_S = 1.0e-8 * 3.4 / 41
# small micro-batches: a matmul over `t` tokens runs at t / (t + MB_TOKENS x (1536 / hidden)^2) of the rate
# (assumed at 1.5b, hidden 1536; smaller for wider layers, whose GEMMs fill the GPU's SMs with fewer rows. Scaled by
# 1 / hidden until 2026-12-03, chosen after the 7b 48GB row at micro-batches of 2 ran 19.6 s against 27.3 estimated
# unscaled, 23.8 scaled; by its square since a 7b no-checkpointing run at micro-batches of 2 updated in 8.46 s against
# 9.10 estimated with 1 / hidden, and the checkpointed 7b updates ran 11.51 s at micro-batches of 2 and 11.75 s at
# 32: at 7b the size barely matters. Neither 7b row is held out for the exponent), and every micro-batch pass costs
# MB_LAYER_S per layer (launches, autograd; fitted)
MB_TOKENS, MB_TOKENS_HIDDEN = 1024, 1536
MB_LAYER_S = 0.27e-3
# per parameter: torchao's 4-bit step (its quantise/dequantise kernels). Fitted with the first time model (d1a2605,
# 2026-12-01, H200 runs of that day), before utils/optim.py sliced the step; since, four held-out 7b adamw_4bit runs
# are 12-16% over in time (`--measured`; the 48GB row's update 9.25 s on an H100 against 12.10 estimated): unrefitted
# until a --profile_step of that row says how long the step takes now
ADAMW_4BIT_S = 0.44e-9
# --empty_cache_between_phases: the allocator grows its pool again once per phase (torch.cuda.empty_cache runs
# after each phase, utils/memory.py PhaseTimer, not per micro-batch; assumed: 1.5b runs with and without it differ
# by 0.1-0.4 s a step, recaptures included)
EMPTY_CACHE_S = 0.05
RECAPTURE_S = 0.15  # a captured decoder dropped and captured again per rollout (--empty_cache_between_phases; assumed)
REWARD_FUNC_S = 0.3e-3  # per completion: decode the text and run a rule reward (assumed)


def gpu_of(name=None) -> dict:
    """A GPUS entry: by key (`h200`), by the CUDA device name (`NVIDIA H200`), or the H200 when unknown."""
    if name is None:
        return GPUS["h200"]
    key = name.lower()
    if key in GPUS:
        return GPUS[key]
    for gpu in GPUS.values():
        if gpu["name"].lower() == key:
            return gpu
    for short, gpu in GPUS.items():
        if short.split("-")[0].replace("rtx", "") in key.replace(" ", "").replace("-", ""):
            return gpu
    return GPUS["h200"]


def _quant_bits(args):
    return 4 if args.load_in_4bit else 8 if args.load_in_8bit else None


def estimate_time(shape: Shape, args, algo="grpo", num_processes=1, gpu=None, engine="single",
                  copy_fused=True, logits_fused=True, float32_kernel=True) -> dict:
    """Seconds per phase of one step after the first (compiles and captures are the first step's), for
    one process on `gpu` (a GPUS entry). Returns {"phases": {phase: s}, "step": s, "unmeasured": [what
    the estimate assumes without a measurement behind it]}. copy_fused=False: as the code was before the
    generation copy's projections were fused (2026-12-05), for the runs measured then. logits_fused=False: as the
    logprobs were computed before utils/ops.py's Function (2026-12-06): every run measured before, to which the
    fitted constants were fitted (the Function's measured saving, LOGIT_PASSES_SAVED, is taken off the others).
    float32_kernel=False: a float32 policy's captured decoding steps through autocast's bf16 casts, as before
    utils/int8.py's float32_mm (2026-12-07): every run measured before."""
    gpu = gpu or GPUS["h200"]
    bw, mm, host = gpu["bandwidth"], gpu["matmul"] * MATMUL_EFF, gpu["host"]
    P, C = args.max_prompt_length, args.max_completion_length
    T = P + C
    rows = args.prompts_per_step // num_processes * (args.num_generations if algo == "grpo" else 1)
    tokens = rows * T
    if args.use_dynamic_bsz:
        mb_rows = max(min(args.max_token_len_per_gpu // T, rows), 1)
    else:
        mb_rows = min(args.per_device_train_batch_size, rows)
    n_mb = -(-rows // mb_rows)
    backend = planned_backend(shape, args, engine)
    bits = _quant_bits(args)
    lora, compiled = args.use_lora, args.torch_compile and engine not in ("zero3", "fsdp2")
    head = shape.vocab * shape.hidden
    matmul_params = shape.linear_params + head  # decoder Linears and the LM head
    elementwise = tokens * shape.layers * (34 * shape.hidden + 8 * shape.inter) * ELEMENTWISE_BYTES / bw
    adapters = 7 * shape.layers if lora else 0  # all-linear: q, k, v, o, gate, up, down
    unmeasured = []
    trained_bytes, quant = _storage_bytes(args)
    fp32_autocast = trained_bytes == 4 and args.mixed_precision != "no" and not (lora and bits)
    residual_bytes = 4 if trained_bytes == 4 and not lora else 2  # the layer inputs' dtype, as estimate() has it

    mb_tokens = MB_TOKENS * (MB_TOKENS_HIDDEN / shape.hidden) ** 2
    mm_mb = mm * mb_rows * T / (mb_rows * T + mb_tokens)  # the matmul rate at a micro-batch's size

    def forward(params, quantized, with_adapters=False):
        """A no-grad forward over every row (ref, old_logprobs, values, reward)."""
        t = 2 * params * tokens / mm_mb + elementwise * (COMPILED_FORWARD if compiled else 1)
        t += n_mb * shape.layers * MB_LAYER_S
        if quantized:
            t += n_mb * dequant_s(shape, quantized, args)
        if with_adapters:
            t += n_mb * adapters * ADAPTER_EAGER_S
        return t

    def update(params, quantized, with_lm_head):
        """Forward, (recompute,) backward over every row, the optimizer step."""
        passes = 3 if args.use_gradient_checkpointing else 2  # forward (+ recompute) + backward
        # FLOPs per token and parameter: forward 2, recompute 2, backward 4 (activations and weights; LoRA: 2,
        # no weight gradients of the base)
        flops_per_token = 2 * (passes - 1) + (2 if lora else 4)
        t = flops_per_token * params * tokens / mm_mb + passes * n_mb * shape.layers * MB_LAYER_S
        t += elementwise * UPDATE_ELEMENTWISE * (passes / 3) * (COMPILED_UPDATE if compiled else 1)
        if with_lm_head and args.logprob_chunk_size:
            t += 2 * head * tokens / mm  # the chunked LM head recomputed in backward
            if not lora:  # per chunk, the head's weight gradient written and added into .grad (bf16: 8 bytes a
                # weight); float32 weights: the recompute casts the weight again (autocast caches its cast only
                # within the forward's region) and the gradient is accumulated in float32 (18 bytes). Counted,
                # not fitted
                chunks = -(-rows * (C + 1) // args.logprob_chunk_size)
                t += chunks * head * (18 if fp32_autocast else 8) / bw
        if args.activation_offload and args.use_gradient_checkpointing:
            # every checkpointed layer input to pinned host memory and back, charged in full at the host link
            # (not overlapped: the 7b LoRA and QLoRA budget rows' updates ran 1.3-2.2 s over the estimate
            # without it; an eager 1.5b float32 pair ran the same with and without the flag). Counted, not fitted
            t += 2 * shape.layers * tokens * shape.hidden * residual_bytes / host
        if quantized:
            t += passes * n_mb * dequant_s(shape, quantized, args)
        if lora:
            t += passes * n_mb * adapters * ADAPTER_EAGER_S
        if fp32_autocast and not lora:  # bf16 casts of the fp32 weights in every pass, fp32 gradients accumulated
            t += n_mb * params * (6 * passes + 12) / bw
        trained = shape.lora_params(args.lora_r) if lora else params
        t += trained * (16 if trained_bytes == 4 else 10) * 2 / bw  # the optimizer reads and writes its state
        if args.optim == "adamw_4bit":
            t += trained * ADAMW_4BIT_S
        if args.param_offload:
            named = _offloaded_embeddings(shape, args.offload_policy)  # tied: either name moves both
            if "lm_head" in named:
                t += 3 * n_mb * shape.embedding_params * trained_bytes / (host * PARAM_OFFLOAD)  # the whole head
            if "embedding" in named:  # the input embedding: only the rows a micro-batch uses, there and back
                t += 2 * n_mb * embedding_rows(shape.vocab, mb_rows * T) * shape.hidden * trained_bytes / (
                    host * PARAM_OFFLOAD)
                unmeasured.append("--param_offload's embedding rows (the distinct ids of a micro-batch; assumed "
                                  "uniform over the vocabulary, an upper bound for text)")
            t += len(named) // (2 if shape.tied else 1) * shape.embedding_params * HOST_STEP_S
            unmeasured.append("--param_offload's optimizer step on the CPU (HostStepped; scaled from a 2-core CPU, "
                              "checked by one 7b run)")
        if args.empty_cache_between_phases:
            t += EMPTY_CACHE_S
        return t

    # the Function's saving per pass over every row's logits (s); 0 for the runs measured before it
    logit_passes = rows * (C + 1) * shape.vocab / bw if logits_fused else 0.0
    phases = {}
    # generate: a prefill of the prompts, then one decoding step per new token, per slice
    slice_rows = min(args.generation_slice_size or rows, rows)
    slices = -(-rows // slice_rows)
    if args.generation_copy:
        weight_bytes, dequant, adapter_s = generation_copy_bytes(shape, args.generation_copy_dtype), 0.0, 0.0
        if args.generation_copy_dtype == "int8":
            weight_bytes /= int8_decode_eff(slice_rows)
    else:
        if lora and bits:
            weight_bytes = shape.linear_params * bits / 8 + (shape.params - shape.linear_params) * 2
        else:
            # fp32 under autocast: read, cast, read again (8 bytes a weight); in a captured step on a GPU the
            # products read the float32 weight in float32_mm where faster (FLOAT32_KERNEL_BYTES)
            weight_bytes = shape.params * (trained_bytes if not fp32_autocast else FLOAT32_KERNEL_BYTES
                                           if float32_kernel and backend in CAPTURED_BACKENDS else 8)
        dequant = (shape.linear_params * DECODE_DEQUANT_BYTES[bits] / (bw * DECODE_EFF)
                   - unnested_saving_s(shape, bits, args) if (lora and bits) else 0.0)
        adapter_s = adapters * (ADAPTER_CAPTURED_S if backend in CAPTURED_BACKENDS else ADAPTER_EAGER_S)
        if lora and backend in CAPTURED_BACKENDS:
            unmeasured.append("LoRA adapters inside a captured decoding step (15 us each assumed)")
    kv = slice_rows * (P + C / 2) * kv_bytes_per_token(shape, args.kv_cache_dtype)
    # --share_prompt_cache: the prefill over each slice's distinct prompts only (prompt_rows on average), and a
    # decoding step reads a prompt's keys and values once for its group: its rows read the same blocks, which the
    # kernel finds in L2 after the first (assumed, not measured)
    shared = planned_share(shape, args, algo, backend) and backend != "hf"
    prompts = sum(prompts_per_slice(args, algo, rows, slice_rows)) if shared else rows
    prompt_rows = prompts / slices if shared else slice_rows
    if shared:
        kv = (prompt_rows * P + slice_rows * C / 2) * kv_bytes_per_token(shape, args.kv_cache_dtype)
        unmeasured.append("--share_prompt_cache's prompt keys read once per group (L2 assumed)")
    if args.kv_cache_dtype == "fp8":  # the codes read, each layer's bf16 keys and values written and read again
        kv += 2 * slice_rows * (P + C / 2) * kv_bytes_per_token(shape)
        unmeasured.append("--kv_cache_dtype fp8's dequantising (assumed at the bandwidth)")
    decode_step = shape.layers * DECODE_LAYER_S[backend] + (weight_bytes + kv) / (bw * DECODE_EFF) + dequant + adapter_s
    if copy_fused and copy_fuses_projections(args):  # q/k/v and gate/up: 2 products a layer instead of 5
        decode_step -= shape.layers * FUSED_LAYER_S
    if backend == "static":
        unmeasured.append("--generation_backend static's step on a GPU (0.45 ms per layer assumed)")
    prefill = 2 * matmul_params * prompts * P / mm
    chunk = min(args.prefill_chunk_size or P, P)
    if chunk < P:  # --prefill_chunk_size: smaller forwards (a lower matmul rate), one more pass per chunk
        unmeasured.append("--prefill_chunk_size's smaller prefill forwards (counted as micro-batch passes)")
        whole, part = prompt_rows * P, prompt_rows * chunk
        prefill *= (part + mb_tokens) / part * whole / (whole + mb_tokens)
        prefill += slices * (-(-P // chunk) - 1) * shape.layers * MB_LAYER_S
    generate = slices * C * decode_step + prefill
    if args.generation_copy:  # the refresh: float32 merged weights written and read, the copy written
        generate += (shape.params * 6 / bw + (dequant_s(shape, bits, args) if bits else 0)
                     + (shape.params * 8 / bw if args.generation_copy_dtype == "int8" else 0))  # + quantising
    if args.param_offload and not args.generation_copy:  # one GPU copy of each offloaded matrix for the phase
        moved = _offloaded_embeddings(shape, args.offload_policy)
        generate += shape.embedding_params * trained_bytes * (1 if shape.tied else len(moved)) / (host * PARAM_OFFLOAD)
    if args.generation_copy and args.generation_copy_in_place:  # the exact base back over the host link
        generate += in_place_backup_bytes(shape, args) / host
        unmeasured.append("--generation_copy_in_place's restore (assumed at the host link's rate)")
    if args.empty_cache_between_phases and backend in CAPTURED_BACKENDS:
        generate += RECAPTURE_S * slices
    phases["generate"] = generate

    uses_ref = (args.beta > 0) if algo == "grpo" else (args.kl_coef > 0 or args.target_kl is not None)
    if uses_ref:
        t = forward(matmul_params, bits)  # quantised with --load_in_4bit/8bit; with LoRA it is the policy's base
        ref_bytes = _frozen_bytes(shape, shape.params, quant)
        if not lora and args.ref_device == "swap":
            t += ref_bytes / host
        elif not lora and args.ref_device == "offload":
            t += n_mb * ref_bytes / (host * OFFLOAD_STREAM) + ref_bytes / (host * OFFLOAD_SETUP)
        elif not lora and args.ref_device == "cpu":
            t = 2 * matmul_params * tokens / 1e12  # a CPU forward: ~1 TFLOP/s (not measured)
            unmeasured.append("the reference on the CPU (~1 TFLOP/s assumed)")
        phases["ref"] = t - LOGIT_PASSES_SAVED_NO_GRAD * logit_passes
    reward = rows * REWARD_FUNC_S
    if args.reward_model_name_or_path:
        reward += forward(shape.linear_params, bits)
        body = _frozen_bytes(shape, shape.params - (0 if shape.tied else shape.embedding_params), quant)
        if args.reward_device == "swap":
            reward += body / host
        elif args.reward_device == "offload":
            reward += n_mb * body / (host * OFFLOAD_STREAM) + body / (host * OFFLOAD_SETUP)
    phases["reward"] = reward
    epochs = args.num_iterations if algo == "grpo" else args.ppo_epochs
    steps_per_update = epochs * (args.num_mini_batches if algo == "ppo" else 1)  # optimizer steps per role and step
    # over the host link per optimizer step (assumed at its rate both ways): --optimizer_offload's moments in and
    # out, a --critic_device swap critic's weights in and out (and its moments); its weights once more for values
    host_per_step = dict.fromkeys(["actor", "critic"], 0)
    critic_swapped = algo == "ppo" and getattr(args, "critic_device", None) == "swap"
    if getattr(args, "optimizer_offload", False) or critic_swapped:
        memory = estimate(shape, args, algo, num_processes)
        moments_out, memory = memory["moments_out"], memory["components"]
        for role in ("actor", "critic") if algo == "ppo" else ("actor",):
            host_per_step[role] = 2 * memory[f"{role}/optimizer"] * moments_out[role] + (
                2 * memory["critic/weights"] if role == "critic" and critic_swapped else 0)
        unmeasured.append("the optimizer state's copies" + (" and the critic's swap" if critic_swapped else "")
                          + " (the host link's rate assumed both ways)")
    no_grad_logits = forward(matmul_params, bits if lora else None, with_adapters=lora) \
        - LOGIT_PASSES_SAVED_NO_GRAD * logit_passes  # a no-grad pass through the LM head's logprobs
    if algo == "ppo":
        phases["values"] = forward(shape.linear_params, bits if lora else None, with_adapters=lora)
        phases["old_logprobs"] = no_grad_logits
        if critic_swapped:
            phases["values"] += memory["critic/weights"] / host
    elif args.num_iterations > 1:
        phases["old_logprobs"] = no_grad_logits
    elif getattr(args, "top_entropy_quantile", 1.0) < 1:  # the same no-grad pass, run for the tokens' entropy
        phases["entropy"] = no_grad_logits
    if getattr(args, "dynamic_sampling", False):  # at least one round; more depend on the rewards
        unmeasured.append("--dynamic_sampling: one round of generation and rewards per step counted (more rounds "
                          "add their generate and reward time each)")
    phases["actor_update"] = epochs * (update(matmul_params, bits if lora else None, True)
                                       - LOGIT_PASSES_SAVED * logit_passes) + steps_per_update * host_per_step["actor"] / host
    if algo == "ppo":
        phases["critic_update"] = epochs * update(shape.linear_params, bits if lora else None, False) \
            + steps_per_update * host_per_step["critic"] / host
    return dict(phases=phases, step=sum(phases.values()), unmeasured=unmeasured, backend=backend)


# levers the planner may add, cheapest first: (flags, why, applies(args, shape)?) -- LoRA changes the method, so
# it is only suggested, never applied
LEVERS = [
    (["--logprob_chunk_size", "1024"], "the LM head's logits 1024 tokens at a time",
     lambda a, s: not a.logprob_chunk_size),
    (["--use_gradient_checkpointing"], "keep only each layer's input for backward",
     lambda a, s: not a.use_gradient_checkpointing),
    (["--torch_dtype", "bfloat16"], "bf16 weights and gradients (stochastic-rounding optimizer)",
     lambda a, s: a.torch_dtype == "float32" and not a.use_lora),
    (["--optim", "adamw_8bit"], "8-bit optimizer moments", lambda a, s: a.optim == "adamw_torch"),
    (["--ref_device", "swap"], "the reference in CPU memory, on the GPU for its phase only",
     lambda a, s: a.ref_device is None and not a.use_lora),
    (["--ref_device", "offload"], "the reference in CPU memory, streamed layer by layer (slow)",
     lambda a, s: a.ref_device in (None, "swap") and not a.use_lora),
    (["--critic_device", "swap"], "the critic and its optimizer state in CPU memory, on the GPU for its values "
     "and update phases only", lambda a, s: getattr(a, "critic_device", "none") is None),
    (["--optimizer_offload"], "the optimizer state in CPU memory, on the GPU for each optimizer step only",
     lambda a, s: not a.optimizer_offload and a.optim != "paged_adamw_8bit"),
    (["--prefill_chunk_size", str(PREFILL_CHUNK)],
     f"the prompts prefilled {PREFILL_CHUNK} positions at a time (smaller prefill activations)",
     lambda a, s: (a.prefill_chunk_size or 1 << 30) > PREFILL_CHUNK and a.max_prompt_length > PREFILL_CHUNK),
    (["--share_prompt_cache"], "each prompt's keys and values kept once per generation slice, for all its "
     "completions", lambda a, s: not a.share_prompt_cache and a.generation_backend != "hf" and a.kv_cache_dtype != "fp8"
     and s.unshareable is None),
    (["--kv_cache_dtype", "fp8"], "the rollouts' KV cache in float8 (changes the rollouts' numerics and costs "
     "decoding time; not searched)", lambda a, s: a.kv_cache_dtype != "fp8" and a.generation_backend != "hf"),
    (["--activation_offload"], "checkpointed layer inputs in pinned CPU memory",
     lambda a, s: a.use_gradient_checkpointing and not a.activation_offload),
    (["--optim", "adamw_4bit"], "4-bit optimizer moments", lambda a, s: a.optim in ("adamw_torch", "adamw_8bit")),
    (["--use_dynamic_bsz", "--max_token_len_per_gpu", "4096"], "micro-batches of at most 4096 tokens",
     lambda a, s: not a.use_dynamic_bsz
     and a.per_device_train_batch_size * (a.max_prompt_length + a.max_completion_length) > 4096),
    (["--generation_slice_size", "32"], "rollouts 32 at a time (smaller KV cache)",
     lambda a, s: (a.generation_slice_size or 1 << 30) > 32),
    (["--param_offload", "--offload_policy", "embedding,lm_head"], "embeddings and LM head in CPU memory",
     lambda a, s: not a.param_offload),
]


FIT_FRACTION = 0.95  # a configuration fits when its estimated peak reserved is within this share of the budget
NUMERICS_SLACK = 1.25  # the numerics are changed only where keeping them costs more than this factor in step time

# What --auto_memory may change of the numerics, in this order and only when the flags' own numerics fit
# nowhere (the README's lever table says how each changes them): (flags, what it changes)
NUMERICS = [
    ({}, None),
    ({"optim": "adamw_8bit"}, "8-bit optimizer moments"),
    ({"torch_dtype": "bfloat16", "optim": "adamw_8bit"}, "bf16 weights (stochastic-rounding steps), 8-bit moments"),
    ({"torch_dtype": "bfloat16", "optim": "adamw_4bit"}, "bf16 weights (stochastic-rounding steps), 4-bit moments"),
]


def search_space(shape, args, algo, explicit, num_processes=1, engine="single"):
    """The same-math speed and memory flags --auto_memory may set, each axis only where the user did
    not set that flag: [(name, [values])], the first value of each being what a run without it does."""
    rows = args.prompts_per_step // num_processes * (args.num_generations if algo == "grpo" else 1)
    per_update = rows if algo == "grpo" else rows // args.num_mini_batches  # what a micro-batch must divide
    axes = []

    def axis(name, values):
        if name not in explicit and len(values) > 1:
            axes.append((name, values))

    axis("use_gradient_checkpointing", [False, True])
    # (float32 weights under --torch_compile searched again since 2026-12-05: the offload kept out of torch.compile,
    # the 1.5b 24GB run that missed by 41% ran 7.83 s on an H100 where 7.14 s is estimated, BUDGET_RUNS)
    axis("activation_offload", [False, True])
    axis("logprob_chunk_size", [0, 1024, 256])
    if not args.use_dynamic_bsz:
        axis("per_device_train_batch_size", [b for b in (8, 16, 32, 4, 2, 1) if per_update % b == 0] or [
            args.per_device_train_batch_size])
    separate_ref = not args.use_lora and ((args.beta > 0) if algo == "grpo" else (args.kl_coef > 0 or
                                                                                 args.target_kl is not None))
    if separate_ref and args.ref_device in (None, "cuda", "cuda:0"):
        axis("ref_device", [args.ref_device, "swap", "offload"])
    if args.reward_model_name_or_path and args.reward_device in (None, "cuda", "cuda:0"):
        axis("reward_device", [args.reward_device, "swap"])
    if algo == "ppo" and num_processes == 1 and engine == "single" and args.critic_device in (None, "cuda", "cuda:0") \
            and not (args.use_lora and (args.load_in_4bit or args.load_in_8bit)):
        axis("critic_device", [args.critic_device, "swap"])
    if engine in ("zero3", "fsdp2"):
        axis("generation_backend", ["hf"])
    else:  # static is left out: its speed on a GPU is not measured (hf's is, where weights move)
        axis("generation_backend", ["compiled", "hf"])
        if args.use_lora or args.load_in_4bit or args.load_in_8bit or args.torch_dtype == "float32":
            axis("generation_copy", [False, True])  # bf16 full-parameter weights: the copy would be the same bytes
        if args.use_lora and args.torch_dtype == "bfloat16" and not (args.load_in_4bit or args.load_in_8bit):
            axis("generation_copy_in_place", [False, True])  # the copy without its bytes (LoRA on a bf16 base)
        if args.load_in_4bit or args.load_in_8bit:  # rollouts already sample from quantised weights
            axis("generation_copy_dtype", ["bfloat16", "int8"])
    if args.load_in_4bit:  # float32 statistics: more memory, none to dequantise, the weights dequantised with exact
        # statistics (both 7b QLoRA budget rows ran faster with it, BUDGET_RUNS of 2026-12-06)
        axis("use_bnb_nested_quant", [True, False])
    axis("generation_slice_size", [None] + [n for n in (64, 32, 16) if n < rows])
    axis("prefill_chunk_size", [None] + ([PREFILL_CHUNK] if PREFILL_CHUNK < args.max_prompt_length else []))
    # one copy of each prompt's keys and values per slice: same math, a smaller cache and prefill, where rows share
    # prompts (GRPO's groups) and the cache is this project's static one (_valid drops it beside the hf axis). Unset,
    # the flag is on for the captured steps already (planned_share); true adds the static step (--param_offload's).
    # Not where auto resolves to hf (ZeRO-3, FSDP2): the flag would turn that into static, unmeasured on a GPU
    static_cache = args.generation_backend != "hf" and not (engine in ("zero3", "fsdp2")
                                                            and args.generation_backend == "auto")
    if (algo == "grpo" and args.num_generations > 1 and args.kv_cache_dtype != "fp8" and static_cache
            and shape.unshareable is None):  # a sliding window: the shared step refuses it
        axis("share_prompt_cache", [args.share_prompt_cache, True])
    axis("empty_cache_between_phases", [False, True])
    if engine in ("single", "ddp") and args.optim != "paged_adamw_8bit":  # DeepSpeed/FSDP hold the state themselves
        axis("optimizer_offload", [False, True])
    if num_processes == 1 and not args.use_lora:
        axis("param_offload", [False, True])
    return axes


def _valid(a, num_processes=1, engine="single"):
    """The scripts' own checks of lever combinations (utils/args.py check_memory_args) and of the levers a run's
    processes and engine refuse (utils/placement.py, utils/args.py, utils/engines.py check_engine_args)."""
    if a.activation_offload and not a.use_gradient_checkpointing:
        return False
    alone = num_processes == 1 and engine == "single"
    if (a.param_offload or getattr(a, "critic_device", None) == "swap") and not alone:
        return False
    if a.optimizer_offload and (engine not in ("single", "ddp") or a.optim == "paged_adamw_8bit"):
        return False
    if a.generation_backend in CAPTURED_BACKENDS and a.param_offload and not a.generation_copy:
        return False
    if a.generation_copy_dtype != "bfloat16" and not a.generation_copy:
        return False
    if getattr(a, "critic_device", None) == "swap" and a.param_offload:
        return False
    if a.generation_copy_in_place and (not a.generation_copy or a.generation_copy_dtype != "bfloat16"
                                       or a.param_offload):
        return False
    if a.share_prompt_cache and (a.generation_backend == "hf" or a.kv_cache_dtype == "fp8"
                                 or a.actor_device == "balanced"):
        return False
    return True


def search(shape, args, algo, gpu_bytes, explicit=frozenset(), num_processes=1, gpu=None, engine="single"):
    """Every combination of the search space at each numerics level (NUMERICS, the flags' own first) whose
    estimated peak reserved fits FIT_FRACTION of gpu_bytes, timed by estimate_time; the fastest of the
    lowest level whose fastest is within NUMERICS_SLACK of the fastest of all (the numerics change only
    where keeping them would cost more). Returns dict(flags, args, memory, time, level, numerics,
    considered, fitting, smallest), `smallest` being the least-memory configuration seen; flags is None
    when nothing fits."""
    import copy
    import itertools

    budget = FIT_FRACTION * gpu_bytes
    smallest, considered, fitting, best_per_level = None, 0, 0, []
    compile_ok = ("torch_compile" not in explicit and engine not in ("zero3", "fsdp2") and not args.use_lora
                  and not (args.load_in_4bit or args.load_in_8bit))
    for level, (numerics, what) in enumerate(NUMERICS):
        if any(name in explicit for name in numerics) or (level and all(getattr(args, n) == v
                                                                        for n, v in numerics.items())):
            continue  # the user chose this part of the numerics, or the level changes nothing here
        base = copy.copy(args)
        for name, value in dict(numerics, **({"torch_compile": True} if compile_ok else {})).items():
            setattr(base, name, value)
        axes = search_space(shape, base, algo, explicit, num_processes, engine)
        best = None
        for values in itertools.product(*(vals for _, vals in axes)):
            trial = copy.copy(base)
            for (name, _), value in zip(axes, values):
                setattr(trial, name, value)
            if not _valid(trial, num_processes, engine):
                continue
            if trial.share_prompt_cache is True and base.share_prompt_cache is None:
                unset = copy.copy(trial)
                unset.share_prompt_cache = None
                if planned_share(shape, unset, algo, planned_backend(shape, unset, engine)):
                    continue  # unset shares there already: the same run as the axis' first value
            considered += 1
            memory = estimate(shape, trial, algo, num_processes)
            if smallest is None or memory["peak_reserved"] < smallest["memory"]["peak_reserved"]:
                smallest = dict(args=trial, memory=memory, level=level)
            if memory["peak_reserved"] > budget or any(u > budget for u in memory["other_gpus"].values()):
                continue
            fitting += 1
            seconds = estimate_time(shape, trial, algo, num_processes, gpu, engine)
            if best is None or seconds["step"] < best["time"]["step"]:
                best = dict(args=trial, memory=memory, time=seconds, level=level, numerics=what)
        if best is not None:
            best_per_level.append(best)
    if smallest is None:
        raise ValueError("the planner found no valid configuration of these flags")
    smallest["flags"] = flags_between(args, smallest["args"])
    smallest["time"] = estimate_time(shape, smallest["args"], algo, num_processes, gpu, engine)
    if not best_per_level:
        return dict(flags=None, considered=considered, fitting=0, smallest=smallest)
    fastest = min(b["time"]["step"] for b in best_per_level)
    chosen = next(b for b in best_per_level if b["time"]["step"] <= NUMERICS_SLACK * fastest)
    own = next((b for b in best_per_level if b["level"] == 0), None)
    chosen = dict(chosen, kept_numerics_step=own["time"]["step"] if own else None)
    return dict(chosen, flags=flags_between(args, chosen["args"]), considered=considered, fitting=fitting,
                smallest=smallest)


def flags_between(before, after):
    """The command-line flags that turn `before` into `after` (each a script's Args)."""
    import dataclasses

    flags = []
    for f in dataclasses.fields(after):
        old, new = getattr(before, f.name), getattr(after, f.name)
        if old != new:
            if isinstance(new, bool):
                flags += [f"--{f.name}"] if new else [f"--{f.name}", "false"]
            elif new is not None:
                flags += [f"--{f.name}", str(new)]
    return flags


def plan(shape, args, algo, gpu_bytes, num_processes=1, parse=None, gpus_per_process=1, explicit=None, gpu=None,
         engine="single"):
    """Placement, then the fastest configuration that fits: with more than one GPU per process, the
    frozen reference (and the PPO critic, the reward model) go to GPUs of their own first, as they cost
    no time and change no math; then search() over the flags the user left unset (`explicit`: the
    flags the user set; None: every flag that differs from its default counts as set).
    `parse(extra flags) -> args`. Returns (flags added, lines of reasoning, final estimate with "time")."""
    parse = parse or (lambda extra: apply_flags(args, extra))
    if explicit is None:
        explicit = _set_flags(args, algo)
    budget = FIT_FRACTION * gpu_bytes
    placed, reasons = [], []
    current = estimate(shape, args, algo, num_processes)
    free_gpus = [f"cuda:{i}" for i in range(1, gpus_per_process)]
    movable = [("critic", "the critic's weights, gradients, optimizer state and update")] if algo == "ppo" else []
    movable.append(("ref", "the reference's weights and its logprob pass"))
    if args.reward_model_name_or_path:
        movable.append(("reward", "the reward model's weights and its scoring pass"))
    for role, what in movable:
        if current["peak_reserved"] <= budget or not free_gpus:
            break
        if getattr(args, f"{role}_device", None) is not None or (role == "ref" and args.use_lora):
            continue  # placed by the user, or (LoRA) the reference is the policy itself
        flags = [f"--{role}_device", free_gpus.pop(0)]
        trial = parse(placed + flags)
        after = estimate(shape, trial, algo, num_processes)
        if after["peak_reserved"] < current["peak_reserved"]:
            there = after["other_gpus"][flags[1]]
            reasons.append(f"{' '.join(flags)}: {what} on a GPU of their own ({there / GIB:.1f} GiB there): "
                           f"{current['peak_reserved'] / GIB:.1f} -> {after['peak_reserved'] / GIB:.1f} GiB here")
            placed, args, current = placed + flags, trial, after
            explicit = explicit | {f"{role}_device"}
    found = search(shape, args, algo, gpu_bytes, explicit, num_processes, gpu, engine)
    if found["flags"] is None:
        small = found["smallest"]
        reasons.append(f"nothing fits: the least memory of {found['considered']} configurations is "
                       f"{small['memory']['peak_reserved'] / GIB:.1f} GiB > {budget / GIB:.1f} GiB "
                       f"({FIT_FRACTION:.0%} of {gpu_bytes / GIB:.1f} GiB), with "
                       + (" ".join(small["flags"]) or "no flags"))
        if not args.use_lora:
            reasons += lora_alternatives(shape, args, algo, gpu_bytes, num_processes, gpu, engine)
        reasons.append("or more GPUs (accelerate launch with DeepSpeed/FSDP configs), or a smaller batch")
        final = dict(small["memory"], time=small["time"])
        return placed, reasons, final
    final = dict(found["memory"], time=found["time"])
    if found["numerics"]:
        kept = found["kept_numerics_step"]
        reasons.append(f"numerics changed: {found['numerics']} (" + (
            "the flags' own numerics fit in no configuration)" if kept is None else
            f"keeping the flags' own would take {kept:.1f} s per step, more than {NUMERICS_SLACK}x)"))
    chosen = found["args"]
    if chosen.generation_copy and chosen.generation_copy_dtype == "int8" and "generation_copy_dtype" not in explicit:
        reasons.append("rollouts' numerics changed: the quantised policy (adapter merged) sampled from an int8 copy "
                       "(--generation_copy_dtype int8, one scale per row; the training forward is unchanged)")
    if chosen.load_in_4bit and not chosen.use_bnb_nested_quant and "use_bnb_nested_quant" not in explicit:
        reasons.append("numerics changed slightly: the 4-bit weights dequantised with float32 statistics instead of "
                       "double-quantised ones (--use_bnb_nested_quant false, TRL's default; closer to the bf16 weights)")
    reasons.append(f"the fastest of {found['fitting']} fitting configurations ({found['considered']} considered): "
                   f"{final['peak_reserved'] / GIB:.1f} GiB, {final['time']['step']:.1f} s per step estimated")
    return placed + found["flags"], reasons, final


def lora_alternatives(shape, args, algo, gpu_bytes, num_processes=1, gpu=None, engine="single"):
    """When full-parameter training fits nowhere: the fastest LoRA and QLoRA runs that fit (lines)."""
    lines = []
    for extra, name in ((["--use_lora"], "LoRA"), (["--use_lora", "--load_in_4bit"], "QLoRA")):
        trial = apply_flags(args, extra)
        found = search(shape, trial, algo, gpu_bytes, _set_flags(trial, algo) | {"use_lora", "load_in_4bit"},
                       num_processes, gpu, engine)
        if found["flags"] is None:
            lines.append(f"{name} (r{args.lora_r}, {' '.join(extra)}) does not fit either "
                         f"(least {found['smallest']['memory']['peak_reserved'] / GIB:.1f} GiB)")
        else:
            lines.append(f"{name} r{args.lora_r} fits: {found['memory']['peak_reserved'] / GIB:.1f} GiB, "
                         f"{found['time']['step']:.1f} s per step estimated, with {' '.join(extra + found['flags'])}")
    return lines


def _set_flags(args, algo):
    """The flags whose value differs from the script's default: what the user set, as far as a parsed
    `args` can tell (the scripts pass the exact set)."""
    import dataclasses

    return {f.name for f in dataclasses.fields(args) if f.default is not dataclasses.MISSING
            and getattr(args, f.name) != f.default}


def apply_flags(args, flags):
    """A copy of `args` with command-line style `flags` set (`--name value` or a bare `--name`
    for True), and the offload shorthands turned into placements, as the scripts' checks do."""
    import copy
    from typing import get_type_hints

    from transformers.hf_argparser import string_to_bool  # the scripts' parser's reading of a boolean's value

    args = copy.copy(args)
    booleans = {name for name, hint in get_type_hints(type(args)).items() if hint in (bool, Optional[bool])}
    i = 0
    while i < len(flags):
        name = flags[i][2:]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            current = getattr(args, name)
            value = flags[i + 1]
            setattr(args, name, string_to_bool(value) if name in booleans
                    else int(value) if isinstance(current, int) and not isinstance(current, bool)
                    or (current is None and value.isdigit()) else float(value) if isinstance(current, float)
                    else value)
            i += 2
        else:
            setattr(args, name, True)
            i += 1
    for role in ("ref", "reward"):
        if getattr(args, f"{role}_offload", False):
            setattr(args, f"{role}_device", "offload")
    return args


def run_planner(args, algo, num_processes, device, is_main=True, explicit=None, engine="single"):
    """--plan / --auto_memory in the scripts: print the estimate (memory and time per phase) and the
    plan; exit after --plan; return the flags to add for --auto_memory. Before any model loads."""
    from utils.cli import UsageError

    on_gpu = str(device).startswith("cuda")
    if args.gpu_memory:
        gpu_bytes = parse_memory(args.gpu_memory)
    elif on_gpu:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        raise UsageError("--plan / --auto_memory: no GPU here to plan for; give --gpu_memory (e.g. 24GB, a card as "
                         "sold, or 21GiB)")
    try:
        shape = load_shape(args.model_name_or_path)
    except ValueError as e:
        raise UsageError(str(e)) from None
    gpu = gpu_of(__import__("torch").cuda.get_device_name(device) if on_gpu else None)
    gpus = owned_gpus(num_processes) if on_gpu else 1
    if not on_gpu:  # planned for a GPU, run here: no compiling, and the CPU's generate (--share_prompt_cache: static)
        explicit = (explicit if explicit is not None else _set_flags(args, algo)) | {
            "torch_compile", "generation_backend", "generation_copy", "share_prompt_cache"}
    added, reasons, final = plan(shape, args, algo, gpu_bytes, num_processes, parse=lambda f: apply_flags(args, f),
                                 gpus_per_process=gpus, explicit=explicit, gpu=gpu, engine=engine)
    fits = final["peak_reserved"] <= FIT_FRACTION * gpu_bytes
    if args.auto_memory and num_processes == 1 and not args.auto_reduce_micro_batch:
        added = added + ["--auto_reduce_micro_batch"]  # an estimate too low costs a halved micro-batch, not the run
    if is_main:
        own = estimate(shape, args, algo, num_processes)
        print(report(shape, own, gpu_bytes, estimate_time(shape, args, algo, num_processes, gpu, engine), gpu))
        print("plan: " + (" ".join(added) if added else "fits as it is" if fits else "nothing fits")
              + "".join("\n  " + r for r in reasons)
              + f"\nestimated with the plan: peak reserved {final['peak_reserved'] / GIB:.1f} GiB, step "
              f"{final['time']['step']:.1f} s (" + ", ".join(f"{p} {t:.2f}" for p, t in final["time"]["phases"].items())
              + ")", flush=True)
    if args.plan:
        sys.exit(0)
    return added


def report(shape, est, gpu_bytes=None, seconds=None, gpu=None) -> str:
    """The estimate as a table: components, then per phase its peak and (with `seconds`) its time."""
    lines = [f"model: {shape.params / 1e9:.2f}B parameters ({shape.layers} layers, hidden {shape.hidden}, vocab "
             f"{shape.vocab}); micro-batch {est['tokens_per_micro_batch']} tokens; {est['rows']} completions "
             "per process per step", f"{'component':<28}{'GiB':>9}"]
    lines += [f"{name:<28}{value / GIB:>9.2f}" for name, value in est["components"].items() if value]
    lines += [f"{'phase':<28}{'peak GiB':>9}" + (f"{'seconds':>10}" if seconds else "")]
    times = seconds["phases"] if seconds else {}
    for name in list(est["phases"]) + [p for p in times if p not in est["phases"]]:
        peak = f"{est['phases'][name] / GIB:>9.2f}" if name in est["phases"] else f"{'':>9}"
        lines.append(f"{name:<28}{peak}" + (f"{times[name]:>10.2f}" if name in times else ""))
    lines.append(f"peak reserved (estimated): {est['peak_reserved'] / GIB:.2f} GiB"
                 + (f" of {gpu_bytes / GIB:.1f} GiB" if gpu_bytes else "")
                 + f"; host memory for offloading: {est['host_bytes'] / GIB:.1f} GiB")
    if seconds:
        lines.append(f"step time (estimated, steps after the first, on {(gpu or GPUS['h200'])['name']}): "
                     f"{seconds['step']:.1f} s with --generation_backend {seconds['backend']}"
                     + "".join(f"; not measured: {u}" for u in seconds["unmeasured"]))
    lines += [f"{device}: peak reserved (estimated) {used / GIB:.2f} GiB (roles placed there)"
              for device, used in est["other_gpus"].items()]
    return "\n".join(lines)


# measured on one H200, 2026-11-30, W-GRPO (benchmarks/memory.py): (shape, flags, peak reserved GiB)
MEASURED = [
    ("qwen2.5-1.5b", [], 58.50),
    ("qwen2.5-1.5b", ["--use_gradient_checkpointing"], 40.57),
    ("qwen2.5-1.5b", ["--use_gradient_checkpointing", "--activation_offload"], 40.06),
    ("qwen2.5-1.5b", ["--use_dynamic_bsz", "--max_token_len_per_gpu", "8192"], 65.90),
    ("qwen2.5-1.5b", ["--logprob_chunk_size", "1024"], 51.70),
    ("qwen2.5-1.5b", ["--optim", "adamw_8bit"], 49.93),
    ("qwen2.5-1.5b", ["--optim", "adamw_4bit"], 49.69),
    ("qwen2.5-1.5b", ["--torch_dtype", "bfloat16"], 42.90),
]
_TARGET_FLAGS = ("--use_gradient_checkpointing --activation_offload --use_dynamic_bsz --max_token_len_per_gpu 8192 "
                 "--logprob_chunk_size 1024 --empty_cache_between_phases").split()
MEASURED += [
    ("qwen2.5-1.5b", _TARGET_FLAGS + "--optim adamw_4bit --torch_dtype bfloat16 --ref_offload "
     "--generation_slice_size 64".split(), 13.80),
    ("qwen2.5-7b", _TARGET_FLAGS + "--optim adamw_4bit --torch_dtype bfloat16 --ref_offload --param_offload "
     "--offload_policy embedding,lm_head".split(), 39.43),
    ("qwen2.5-7b", _TARGET_FLAGS + "--use_lora --load_in_4bit --generation_slice_size 32 --param_offload "
     "--offload_policy embedding".split(), 9.11),
    ("qwen2.5-7b", _TARGET_FLAGS + "--use_lora --torch_dtype bfloat16 --generation_slice_size 32 --param_offload "
     "--offload_policy embedding,lm_head".split(), 18.28),
]
# measured later the same day, after the `fitted` coefficients were set (held out, not used for fitting)
HELD_OUT = [
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --activation_offload --use_dynamic_bsz --max_token_len_per_gpu 4096 "
     "--logprob_chunk_size 256 --optim adamw_4bit --torch_dtype bfloat16 --ref_offload --empty_cache_between_phases "
     "--generation_slice_size 64 --param_offload --offload_policy embedding".split(), 9.00),
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit "
     "--logprob_chunk_size 1024".split(), 16.44),
    ("qwen2.5-1.5b", _TARGET_FLAGS + "--optim adamw_4bit --torch_dtype bfloat16 --ref_offload "
     "--generation_slice_size 32".split(), 13.76),
    ("qwen2.5-1.5b", ["--empty_cache_between_phases"], 58.50),
    ("qwen2.5-1.5b", ["--use_lora"], 37.57),
    ("qwen2.5-1.5b", "--param_offload --offload_policy embedding,lm_head".split(), 55.88),
    # 2026-12-01, --generation_backend compiled (its KV cache kept through the other phases)
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --generation_backend compiled".split(), 43.78),
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled".split(), 19.56),
    ("qwen2.5-7b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled".split(), 71.07),
    # 2026-12-01, later: QLoRA with and without --generation_copy (steps 2-3); the dropped cache
    # really freed (steps 2-5)
    ("qwen2.5-7b", "--use_gradient_checkpointing --use_lora --load_in_4bit --generation_backend compiled".split(), 23.69),
    ("qwen2.5-7b", "--use_gradient_checkpointing --use_lora --load_in_4bit --generation_copy "
     "--generation_backend compiled".split(), 37.77),
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled --torch_compile --empty_cache_between_phases".split(), 16.69),
    # 2026-12-01, next session: the reference swapped in for its phase only
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled --torch_compile --ref_device swap".split(), 16.81),
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled --torch_compile --ref_device swap --per_device_train_batch_size 16".split(), 17.63),
]


def _then_default(rows):
    """Runs measured before --generation_backend auto decoded with hf, then the default: said as a flag."""
    return [(shape, flags if "--generation_backend" in flags else flags + ["--generation_backend", "hf"], gib)
            for shape, flags, gib in rows]


MEASURED, HELD_OUT = _then_default(MEASURED), _then_default(HELD_OUT)
WORKLOAD_GRPO = ["--prompts_per_step", "16", "--num_generations", "8", "--max_prompt_length", "256",
                 "--max_completion_length", "512", "--beta", "0.04", "--model_name_or_path", "x"]
# W-PPO (actor, critic and reference of one shape), measured 2026-12-01 with benchmarks/throughput.py --script ppo
HELD_OUT_PPO = [
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled".split(), 28.12),
]
WORKLOAD_PPO = ["--prompts_per_step", "128", "--max_prompt_length", "256", "--max_completion_length", "512",
                "--ppo_epochs", "1", "--model_name_or_path", "x"]


# Step times (median of steps 2..) and phase times (s, those of 0.1 s and more) of W-GRPO / W-PPO runs on
# one H200, 2026-11-30 and 12-01 (benchmarks/throughput.py, which adds --use_gradient_checkpointing, and
# benchmarks/memory.py's sweep of 2 steps, which does not): (shape, algo, flags, step, phases). The time
# model's fitted constants were fitted to TIME_FIT (least squares on log phase and step times, a weak
# prior on each); TIME_HELD_OUT was not used. Runs before 2026-12-01 decoded with hf, then the default.
# TIME_FIT and TIME_HELD_OUT runs of a code path changed since: {flags: what changed}; --measured lists them as
# `old code`, not counted, and tests/test_plan.py skips them (as BUDGET_RUNS' `superseded`)
TIME_SUPERSEDED = {
    "--use_gradient_checkpointing --use_lora --load_in_4bit --generation_backend compiled": (
        "43ac109 (2026-12-06): the compiled decoding step ran QLoRA's o_proj as one-row products over its weight "
        "broadcast; the decoding step's dequantising (DECODE_DEQUANT_BYTES) was refit to rollouts without them"),
    "--param_offload --offload_policy embedding,lm_head --generation_backend hf": (
        "HostStepped (2026-12-05): the offloaded float32 matrix steps through torch's fused CPU AdamW on its own "
        "parameter group; PARAM_OFFLOAD was refit to a run of that (2026-12-05), after which this run of 2026-11-30 "
        "(39.94 s, update 23.73 s) estimates 30.0 s, -25%"),
}
LEAN = ("--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
        "--generation_backend compiled")
TIME_FIT = [
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --generation_backend compiled",
     8.05, {"generate": 3.44, "ref": 0.81, "actor_update": 3.77}),
    ("qwen2.5-1.5b", "grpo", LEAN, 6.74, {"generate": 2.18, "ref": 0.81, "actor_update": 3.72}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile", 5.64, {"generate": 2.18, "ref": 0.62, "actor_update": 2.81}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile --ref_offload",
     17.28, {"generate": 2.18, "ref": 12.2, "actor_update": 2.8}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile --ref_offload --per_device_train_batch_size 16",
     13.67, {"generate": 2.18, "ref": 8.76, "actor_update": 2.69}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile --ref_device swap",
     6.14, {"generate": 2.21, "ref": 0.68, "actor_update": 3.19}),
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --generation_backend hf",
     18.72, {"generate": 13.96, "ref": 0.8, "actor_update": 3.89}),
    ("qwen2.5-1.5b", "ppo", LEAN,
     11.36, {"generate": 2.23, "ref": 0.82, "old_logprobs": 0.84, "values": 0.69, "actor_update": 3.5,
             "critic_update": 3.05}),
    ("qwen2.5-7b", "grpo", LEAN, 19.37, {"generate": 5.06, "ref": 2.8, "actor_update": 11.47}),
    ("qwen2.5-7b", "grpo", "--use_gradient_checkpointing --use_lora --load_in_4bit --generation_backend compiled",
     28.88, {"generate": 15.08, "ref": 2.9, "actor_update": 10.87}),
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --activation_offload --generation_backend hf",
     19.6, {"generate": 14.98, "ref": 0.81, "actor_update": 3.79}),
    ("qwen2.5-1.5b", "grpo", "--use_dynamic_bsz --max_token_len_per_gpu 8192 --generation_backend hf",
     19.63, {"generate": 15.84, "ref": 0.8, "actor_update": 2.95}),
    ("qwen2.5-1.5b", "grpo", "--optim adamw_4bit --generation_backend hf",
     20.63, {"generate": 16.49, "ref": 0.85, "actor_update": 3.25}),
    ("qwen2.5-1.5b", "grpo", "--torch_dtype bfloat16 --generation_backend hf",
     17.43, {"generate": 13.59, "ref": 0.88, "actor_update": 2.91}),
    ("qwen2.5-1.5b", "grpo", "--param_offload --offload_policy embedding,lm_head --generation_backend hf",
     39.94, {"generate": 15.38, "ref": 0.8, "actor_update": 23.73}),
    ("qwen2.5-1.5b", "grpo", "--use_lora --generation_backend hf",
     39.8, {"generate": 35.26, "ref": 0.94, "actor_update": 3.61}),
]
TIME_HELD_OUT = [
    ("qwen2.5-1.5b", "grpo", LEAN + " --empty_cache_between_phases",
     6.86, {"generate": 2.3, "ref": 0.82, "actor_update": 3.68}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile --empty_cache_between_phases",
     6.05, {"generate": 2.35, "ref": 0.62, "actor_update": 3.03}),
    ("qwen2.5-1.5b", "grpo", LEAN + " --torch_compile --ref_device swap --per_device_train_batch_size 16",
     5.7, {"generate": 2.21, "ref": 0.67, "actor_update": 2.78}),
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --generation_backend compiled --torch_compile",
     7.26, {"generate": 3.45, "ref": 0.62, "actor_update": 3.12}),
    ("qwen2.5-1.5b", "ppo", LEAN + " --torch_compile",
     9.84, {"generate": 2.27, "ref": 0.63, "old_logprobs": 0.64, "values": 0.49, "actor_update": 2.94,
            "critic_update": 2.5}),
    ("qwen2.5-7b", "grpo", "--use_gradient_checkpointing --use_lora --load_in_4bit --generation_copy "
     "--generation_backend compiled",
     19.45, {"generate": 5.13, "ref": 2.9, "actor_update": 11.37}),
    ("qwen2.5-1.5b", "grpo", "--generation_backend hf", 21.8, {}),
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --generation_backend hf", 21.1, {}),
    ("qwen2.5-1.5b", "grpo", "--logprob_chunk_size 1024 --generation_backend hf", 18.6, {}),
    ("qwen2.5-1.5b", "grpo", "--optim adamw_8bit --generation_backend hf", 17.5, {}),
    ("qwen2.5-1.5b", "grpo", "--empty_cache_between_phases --generation_backend hf",
     21.2, {"generate": 17.08, "ref": 0.83, "actor_update": 3.23}),
    ("qwen2.5-1.5b", "grpo", "--use_gradient_checkpointing --activation_offload --use_dynamic_bsz "
     "--max_token_len_per_gpu 8192 --logprob_chunk_size 1024 --optim adamw_4bit --torch_dtype bfloat16 --ref_offload "
     "--generation_slice_size 32 "
     "--empty_cache_between_phases --generation_backend hf",
     83.7, {"generate": 65.31, "ref": 14.66, "actor_update": 3.64}),
]

# benchmarks/budget.py's rows on one H200 under the enforced cap, 2026-12-01, measured after the time model
# was fitted (held out): the flags are the mode's and those --auto_memory chose (the 7b 80GB, LoRA, QLoRA and
# PPO rows were planned before the 4-bit optimizer step's buffers were counted; the first 1.5b 12GB row after,
# before torchao's step was sliced; the second 1.5b 12GB row and the 7b 48GB row after both)
# a row whose measured code path has changed since carries `superseded` (what changed): listed by --measured, not
# counted in its summary of today's code
_OFFLOAD_OUT_OF_COMPILE = ("04ef21d (2026-12-05): activation offload kept out of torch.compile, which had traced it "
                           "and run the backward's recompute uncompiled")
_ONE_ROW_PRODUCTS = ("43ac109 (2026-12-06): the compiled decoding step ran QLoRA's o_proj as one-row products over "
                     "its weight broadcast (7b, 64 rows: 6.1 ms of a 25.0 ms step, H100)")
_HOST_STEPPED = ("HostStepped (2026-12-05): --param_offload's weights step through torch's fused CPU AdamW, not "
                 "the --optim's step on CPU tensors (torchao's compiled 8-bit step for bf16 weights)")
BUDGET_RUNS = [
    dict(row="1.5b_full_12gb (before)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=10.04, step_time_s=7.79,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --activation_offload "
                "--logprob_chunk_size 256 --optim adamw_4bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4").split()),
    dict(row="7b_full_48gb (micro-batch 1)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=38.29, step_time_s=30.02,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --optim adamw_4bit "
                "--generation_backend compiled --empty_cache_between_phases --ref_device swap "
                "--per_device_train_batch_size 1").split()),
    dict(row="1.5b_full_12gb (unsliced step)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=9.57, step_time_s=38.09,
         superseded=_HOST_STEPPED,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --activation_offload "
                "--logprob_chunk_size 256 --optim adamw_8bit --param_offload --generation_backend hf "
                "--ref_device swap --per_device_train_batch_size 4").split()),
    dict(row="1.5b_full_24gb (bf16 plan)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=17.24, step_time_s=5.89,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 "
                "--optim adamw_8bit --generation_backend compiled --ref_device swap "
                "--per_device_train_batch_size 32").split()),
    dict(row="1.5b_no_flags", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=62.85, step_time_s=7.43,
         flags=[]),
    dict(row="7b_full_80gb (checkpointed, micro-batches of 32)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=60.13, step_time_s=20.51,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size "
                "1024 --optim adamw_8bit --generation_backend compiled --ref_device swap "
                "--per_device_train_batch_size 32").split()),
    dict(row="7b_lora_24gb (before)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=20.84, step_time_s=26.74,
         flags=("--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --logprob_chunk_size 256 "
                "--generation_slice_size 64 --generation_backend compiled --empty_cache_between_phases").split()),
    dict(row="7b_qlora_24gb (4-bit decoding)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=20.55,
         step_time_s=29.17,
         superseded=_ONE_ROW_PRODUCTS,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --activation_offload "
                "--logprob_chunk_size 256 --generation_backend compiled --per_device_train_batch_size 32").split()),
    # a session later: the two rows not run before (planned after both changes). 7b 12GB: its first rollout
    # ran out of memory at the planned --generation_slice_size 64 and --auto_reduce_micro_batch went on with
    # 32; here as it ran in steps 2-3 (slices of 32: peak reserved 9.21 GiB in the update, 52.59 s)
    dict(row="7b_qlora_12gb (slices of 32)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=9.21, step_time_s=52.59,
         superseded=_ONE_ROW_PRODUCTS,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 256 "
                "--generation_slice_size 32 --generation_backend compiled --empty_cache_between_phases").split()),
    dict(row="ppo_7b_80gb (optimizer on the GPU)", shape="qwen2.5-7b", algo="ppo", peak_reserved_gib=66.16, step_time_s=41.16,
         flags=("--use_lora --torch_dtype bfloat16 --reward_model_name_or_path x --use_gradient_checkpointing "
                "--logprob_chunk_size 1024 --generation_backend compiled --generation_copy "
                "--empty_cache_between_phases --per_device_train_batch_size 32").split()),
    dict(row="ppo_1.5b_24gb (4-bit moments)", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=20.54,
         step_time_s=11.11,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing "
                "--torch_compile --logprob_chunk_size 256 --optim adamw_4bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --reward_device swap "
                "--per_device_train_batch_size 16").split()),
    # a session later (2026-12-01, evening): five rows run again as the planner now plans them (the prefill's
    # MLP activations counted, 5% allocator slack with emptied caches, --prefill_chunk_size searched); 3 steps,
    # the median of steps 2-3. 1.5b 24GB: its step 2 (14.2 s) recompiled in ref and update, step 3 took 8.4 s;
    # it ran with the --generation_copy built with weight initialisation at every rollout (fixed after)
    dict(row="7b_qlora_12gb (no activation offload)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=9.69, step_time_s=39.72,
         superseded=_ONE_ROW_PRODUCTS,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 256 "
                "--generation_slice_size 64 --prefill_chunk_size 64 --generation_backend compiled "
                "--empty_cache_between_phases").split()),
    dict(row="7b_full_48gb (checkpointed)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=39.36, step_time_s=19.61,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --optim adamw_4bit "
                "--generation_backend compiled --empty_cache_between_phases --ref_device swap "
                "--per_device_train_batch_size 2").split()),
    dict(row="7b_lora_24gb (adapters in the step)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=20.38,
         step_time_s=27.35,
         flags=("--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --activation_offload "
                "--logprob_chunk_size 256 --generation_slice_size 64 --prefill_chunk_size 64 "
                "--generation_backend compiled --empty_cache_between_phases --per_device_train_batch_size 16").split()),
    dict(row="1.5b_full_24gb (activation offload)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=19.24,
         superseded=_OFFLOAD_OUT_OF_COMPILE,
         step_time_s=11.29,
         flags=("--use_gradient_checkpointing --torch_compile --activation_offload --logprob_chunk_size 256 "
                "--optim adamw_8bit --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="1.5b_full_12gb (activation offload, 4-bit moments)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=10.05, step_time_s=6.95,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --activation_offload "
                "--logprob_chunk_size 256 --optim adamw_4bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap").split()),
]

BUDGET_RUNS += [
    # 2026-12-02: the two rows whose plans had changed, 4 and 3 steps (medians of steps 2-4 and 2-3). 1.5b 24GB:
    # steps 6.64, 6.43, 6.81 s (estimated 6.5 before it ran). 7b QLoRA 24GB with the new int8 generation copy:
    # estimated 18.7 s before it ran (INT8_DECODE_EFF then 1.0, -22%), measured 23.92 s
    dict(row="1.5b_full_24gb (chunk 256, micro-batches of 8)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=17.79, step_time_s=6.64,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 --optim adamw_8bit "
                "--generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap").split()),
    # 7b QLoRA 24GB again, after the int8 kernel's splits of K (3 steps, median of 2-3: 22.26, 22.57 s; estimated
    # 21.9 s before it ran with INT8_DECODE_EFF 0.43, -2%); INT8_DECODE_EFF was then refitted to its generate
    # time (in-sample for that term, fitted=True). The first run (the unsplit kernel): generate 9.86 s
    dict(row="7b_qlora_24gb (slices of 64)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=18.79,
         step_time_s=22.42, fitted=True,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 1024 "
                "--generation_slice_size 64 --generation_backend compiled --generation_copy "
                "--generation_copy_dtype int8 --empty_cache_between_phases --per_device_train_batch_size 32").split()),
]

# Every run above was measured while --generation_copy held its own copy of every tensor: estimate(...,
# copy_shares=False) for them (as_measured); a run measured since gets copy_shared=True in its entry, and a PPO run
# measured since train_ppo.py's update passes stopped interleaving (2026-12-03, 9d89c71) updates_apart=True.

BUDGET_RUNS += [
    # 2026-12-02, later, held out (3 steps, median of steps 2-3). 7b LoRA 24GB with --generation_copy_in_place:
    # 24.09, 24.16 s (estimated 22.3 before it ran; generate 9.00 s measured, 9.00 estimated: the adapters'
    # cost in the step was the 3 s the in-place copy took off; ref 3.09 / 2.49, update 11.96 / 10.78).
    # 7b QLoRA 24GB, the int8 copy sharing the policy's bf16 tensors, unsliced: 20.63, 20.62 s (estimated 18.0;
    # generate 7.43 / 5.96: the int8 kernel at 128 rows is slower than INT8_DECODE_ROWS has it)
    dict(row="7b_lora_24gb (input cast)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=20.28, step_time_s=24.13,
         copy_shared=True,
         flags=("--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --activation_offload "
                "--logprob_chunk_size 256 --generation_slice_size 64 --prefill_chunk_size 64 "
                "--generation_backend compiled --generation_copy --generation_copy_in_place "
                "--empty_cache_between_phases --per_device_train_batch_size 16").split()),
    dict(row="7b_qlora_24gb (SDPA decoding)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.85,
         step_time_s=20.62,
         copy_shared=True,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 1024 "
                "--prefill_chunk_size 64 --generation_backend compiled --generation_copy --generation_copy_dtype int8 "
                "--empty_cache_between_phases --per_device_train_batch_size 32").split()),
    # 2026-12-02, later still, held out: the 7b LoRA 24GB row's flags (the planner chose the same) once the
    # adapters stopped casting their bf16 inputs to float32 under autocast (utils/modeling.py
    # skip_input_casts_under_autocast): 21.75, 21.85 s (estimated 22.3); update 11.96 -> 10.21 s (10.78 est.),
    # generate 8.65, ref 2.88; peak reserved 20.28 -> 19.44 GiB (19.5 est.: the float32 copies were never counted)
    dict(row="7b_lora_24gb", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.44, step_time_s=21.80,
         copy_shared=True,
         flags=("--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --activation_offload "
                "--logprob_chunk_size 256 --generation_slice_size 64 --prefill_chunk_size 64 "
                "--generation_backend compiled --generation_copy --generation_copy_in_place "
                "--empty_cache_between_phases --per_device_train_batch_size 16").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, 3 steps (median of steps 2-3), decoding through utils/decode_attention.py's kernel. 7b 80GB: the
    # planner's choice once MB_TOKENS scaled with 1 / hidden^2 (no checkpointing, micro-batches of 2): 15.97 s
    # (estimated 15.9; generate 4.41, ref 2.76, update 8.74 s), 57.77 GiB reserved (65.9 estimated). Not held out:
    # the exponent, LAYER_ACT_INTER_COMPILED and DECODE_EFF were set from a run of these flags the session before
    # (15.6 s) and from this one (fitted=True). 7b QLoRA 24GB, the flags of the row above it: 20.00 s (estimated 17.9
    # at the run; generate 6.93 against 7.43 s through SDPA), 19.85 GiB
    dict(row="7b_full_80gb (micro-batches of 2)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=57.77,
         step_time_s=15.97,
         copy_shared=True, fitted=True,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_8bit --generation_backend compiled "
                "--ref_device swap --per_device_train_batch_size 2").split()),
    dict(row="7b_qlora_24gb", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.85, step_time_s=20.00,
         copy_shared=True,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 1024 "
                "--prefill_chunk_size 64 --generation_backend compiled --generation_copy --generation_copy_dtype int8 "
                "--empty_cache_between_phases --per_device_train_batch_size 32").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, later, held out (3 steps, median of steps 2-3): the two rows whose plans changed with the fits above.
    # 7b 80GB: micro-batches of 4 (no checkpointing, caches emptied between phases): 15.17, 15.19 s (estimated 14.6;
    # generate 4.60, ref 2.64, update 7.89 s), 61.52 GiB reserved (65.8 estimated), 60.36 allocated in the update.
    # W-PPO 1.5b 24GB: the planner now keeps 8-bit moments (its fastest 4-bit plan, 10.9 s estimated, is within
    # NUMERICS_SLACK of it), activation offload at micro-batches of 4: 13.94 s (estimated 13.2), 19.16 GiB; the
    # 4-bit plan above ran 11.11 s
    dict(row="7b_full_80gb", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=61.52, step_time_s=15.18,
         copy_shared=True,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_8bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4").split()),
    dict(row="ppo_1.5b_24gb (interleaved updates)", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=19.16,
         step_time_s=13.94,
         copy_shared=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--activation_offload --logprob_chunk_size 256 --optim adamw_8bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --reward_device swap "
                "--per_device_train_batch_size 4").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, evening, held out (3 steps, median of steps 2-3): W-PPO 1.5b 24GB, the same flags, once train_ppo.py
    # stepped the actor's micro-batches, then the critic's (9d89c71; interleaved before): 13.02 s (11.64, 14.41;
    # estimated 13.2), 17.38 GiB reserved in generate (19.9 estimated then, both roles' gradients counted in both
    # updates), actor_update 18.82 -> 15.95 GiB allocated and critic_update 17.92 -> 15.10: one role's gradients
    dict(row="ppo_1.5b_24gb (activation offload, micro-batches of 4)", shape="qwen2.5-1.5b", algo="ppo",
         peak_reserved_gib=17.38, step_time_s=13.02,
         copy_shared=True, updates_apart=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--activation_offload --logprob_chunk_size 256 --optim adamw_8bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --reward_device swap "
                "--per_device_train_batch_size 4").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, evening, held out (3 steps, median of steps 2-3), under the 24GB cap. The planner's W-PPO 1.5b plan once
    # it counted one role's gradients per update and could swap the critic: 10.20 s (10.18, 10.22; estimated 9.4),
    # 19.62 GiB reserved (19.5 estimated): target 12 s met. Beside it, the plan it made before the critic swap existed
    # (micro-batches of 16, no activation offload; estimated 9.6 s, 18.8 GiB), without and with --critic_device swap
    # (its moments then on the GPU for the whole critic update, since for its optimizer step only):
    # 10.13 and 10.43 s, 17.73 and 17.12 GiB reserved; the swap took 5.8 GiB out of generate (16.39 -> 10.59 GiB
    # allocated) and the actor's update (17.10 -> 11.30) for +0.05 s in values and +0.33 s in critic_update
    dict(row="ppo_1.5b_24gb (critic swap, micro-batches of 32)", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=19.62, step_time_s=10.20,
         copy_shared=True, updates_apart=True, critic_moments_whole_phase=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--logprob_chunk_size 1024 --optim adamw_8bit --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --reward_device swap --per_device_train_batch_size 32 --critic_device swap").split()),
    dict(row="ppo_1.5b_24gb (micro-batches of 16)", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=17.73,
         step_time_s=10.13, copy_shared=True, updates_apart=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--logprob_chunk_size 256 --optim adamw_8bit --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --reward_device swap --per_device_train_batch_size 16").split()),
    dict(row="ppo_1.5b_24gb (critic swap, micro-batches of 16)", shape="qwen2.5-1.5b", algo="ppo",
         peak_reserved_gib=17.12, step_time_s=10.43, copy_shared=True, updates_apart=True,
         critic_moments_whole_phase=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--logprob_chunk_size 256 --optim adamw_8bit --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --reward_device swap --per_device_train_batch_size 16 --critic_device swap").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, night, held out (3 steps, median of steps 2-3), under the cap: --optimizer_offload alone, and the 7b
    # 48GB row as the planner plans it once it searches that flag. 1.5b 24GB (float32 weights, 8-bit moments): the
    # row's flags measured again without it, 6.58 s (6.33, 6.83), 17.79 GiB; with it 6.34 s (6.31, 6.38; estimated
    # 6.55), 14.84 GiB reserved: generate 16.77 -> 13.85 GiB allocated, actor_update 17.26 -> 14.56. 7b 48GB (bf16, 4-bit
    # moments, checkpointed, micro-batches of 2): 19.61 s / 39.36 GiB (2026-12-01) -> 19.13 s (19.01, 19.24; estimated
    # 22.3) / 37.60 GiB; generate 31.47 -> 23.93 GiB allocated, ref 37.49 -> 29.96, the update's step (weights,
    # gradients, moments) still 37.55. The planner's plan with it, no checkpointing: 16.53 s (16.52, 16.54; estimated
    # 19.2: its update, 9.08 s, 11.68 estimated), 38.33 GiB (40.3 estimated)
    dict(row="7b_full_48gb", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=38.33, step_time_s=16.53,
         copy_shared=True,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_4bit --optimizer_offload "
                "--generation_backend compiled --empty_cache_between_phases --ref_device swap "
                "--per_device_train_batch_size 2").split()),
    dict(row="7b_full_48gb (checkpointed, optimizer offload)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=37.60, step_time_s=19.13, copy_shared=True,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --optim adamw_4bit "
                "--generation_backend compiled --empty_cache_between_phases --ref_device swap "
                "--per_device_train_batch_size 2 --optimizer_offload").split()),
    dict(row="1.5b_full_24gb (optimizer offload)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=14.84,
         step_time_s=6.34, copy_shared=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 --optim adamw_8bit "
                "--generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --optimizer_offload").split()),
]

BUDGET_RUNS += [
    # 2026-12-03, night, held out (3 steps, median of steps 2-3), under the cap: the two 1.5b rows as the planner plans
    # them once it searches --optimizer_offload, decoding with the pick fused (658c2e2: the compiled 1.5b decoding
    # step 3.68 -> 3.30 ms, benchmarks/decode_step.py). 1.5b 24GB (float32 weights, 8-bit moments out of the GPU,
    # micro-batches of 16, chunk 1024): 5.77 s (5.74, 5.79; estimated 5.9), 18.90 GiB (19.2): generate 2.06, ref 0.68,
    # update 2.98 s. W-PPO 1.5b 24GB (both roles' moments out, the critic on the GPU, caches kept): 9.99 s (9.99, 10.00;
    # estimated 9.0), 18.94 GiB (19.7)
    dict(row="1.5b_full_24gb", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=18.90, step_time_s=5.77,
         copy_shared=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="ppo_1.5b_24gb", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=18.94, step_time_s=9.99,
         copy_shared=True, updates_apart=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--logprob_chunk_size 1024 --optim adamw_8bit --optimizer_offload --generation_backend compiled "
                "--ref_device swap --reward_device swap --per_device_train_batch_size 32").split()),
]

BUDGET_RUNS += [
    # 2026-12-04, held out (3 steps, median of steps 2-3), under the cap: the three rows whose plans changed once the
    # planner searched --optimizer_offload at every card. 1.5b 12GB (bf16 weights, 8-bit moments out of the GPU, no
    # activation offload, micro-batches of 16): 6.95 s / 10.05 GiB -> 5.70 s (5.73, 5.67; estimated 5.8), 9.46 GiB
    # (9.6); 7b QLoRA 12GB (activation offload and the adapters' moments out, micro-batches of 16): 39.72 -> 39.35 s
    # (39.31, 39.39; estimated 38.2), 10.32 GiB (9.7); W-PPO 7b 80GB, the same flags as before, with the generation
    # copy sharing the policy's bf16 tensors and the updates apart: 41.16 s / 66.16 GiB -> 36.42 s (35.86, 36.98;
    # estimated 32.2), 63.84 GiB (66.9). Beside them, the two held-out rows outside the bounds, run again with
    # today's code: 1.5b 24GB with activation offload 11.29 -> 8.87 s (8.02, 9.71), 18.98 GiB; 7b 80GB checkpointed
    # at micro-batches of 32 20.51 -> 16.50 s (16.52, 16.48), 59.56 GiB (its memory estimate still ~11% over)
    dict(row="1.5b_full_12gb", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=9.46, step_time_s=5.70,
         copy_shared=True,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 "
                "--optim adamw_8bit --optimizer_offload --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="7b_qlora_12gb", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=10.32, step_time_s=39.35,
         copy_shared=True,
         superseded=_ONE_ROW_PRODUCTS,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --activation_offload --logprob_chunk_size 256 "
                "--optimizer_offload --generation_slice_size 64 --prefill_chunk_size 64 --generation_backend compiled "
                "--empty_cache_between_phases --per_device_train_batch_size 16").split()),
    dict(row="ppo_7b_80gb", shape="qwen2.5-7b", algo="ppo", peak_reserved_gib=63.84, step_time_s=36.42,
         copy_shared=True, updates_apart=True,
         flags=("--use_lora --torch_dtype bfloat16 --reward_model_name_or_path x --use_gradient_checkpointing "
                "--logprob_chunk_size 1024 --generation_backend compiled --generation_copy "
                "--empty_cache_between_phases --per_device_train_batch_size 32").split()),
    dict(row="1.5b_full_24gb (activation offload, 2026-12-04)", shape="qwen2.5-1.5b", algo="grpo",
         superseded=_OFFLOAD_OUT_OF_COMPILE,
         peak_reserved_gib=18.98, step_time_s=8.87, copy_shared=True,
         flags=("--use_gradient_checkpointing --torch_compile --activation_offload --logprob_chunk_size 256 "
                "--optim adamw_8bit --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="7b_full_80gb (checkpointed, micro-batches of 32, 2026-12-04)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=59.56, step_time_s=16.50, copy_shared=True,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size "
                "1024 --optim adamw_8bit --generation_backend compiled --ref_device swap "
                "--per_device_train_batch_size 32").split()),
]

BUDGET_RUNS += [
    # 2026-12-05, held out (3 steps, median of steps 2-3), under the cap, on an H100 80GB HBM3 (no H200 lent that
    # session; the time estimate on GPUS["h100"], datasheet rates scaled): the 1.5b 24GB row as the planner plans it,
    # side by side on one machine, the generation copy unfused, then fused (FUSE_PROJECTIONS, with the prefill fused
    # too, as it was then): 6.26 s (6.29, 6.24; estimated 6.5) -> 6.19 s (6.22, 6.15), generate 2.32 -> 2.19 s, ref 0.73,
    # update 3.15 / 3.19 s; 18.82 GiB reserved both, generate's peak 13.85 -> 14.40 GiB allocated (the fused prefill's
    # gate/up output held whole: prefills have taken each projection's own product since, FUSE_MAX_TOKENS)
    dict(row="1.5b_full_24gb (H100, unfused copy)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=18.82,
         step_time_s=6.26, copy_shared=True, gpu="h100",
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="1.5b_full_24gb (H100, fused copy)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=18.82,
         step_time_s=6.19, copy_shared=True, gpu="h100", copy_fused=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
]

_FP32_24GB = ("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 --optim adamw_8bit "
              "--generation_backend compiled --generation_copy --empty_cache_between_phases --ref_device swap "
              "--per_device_train_batch_size 16").split()
BUDGET_RUNS += [
    # 2026-12-05, later, held out (3 steps, median of steps 2-3), under the cap, on one H100 80GB HBM3 (no H200 came
    # when asked), side by side: the held-out float32 activation-offload run once the offload stayed out of
    # torch.compile (11.29 s on 12-03, 8.87 s on 12-04, both H200): 7.83 s (generate 2.43, ref 0.74, update 4.61),
    # 18.87 GiB; the same flags without activation offload 6.33 s (2.19, 0.75, 3.32), 20.02 GiB; the planner's 1.5b
    # 24GB plan with micro-batches of 32 and chunks of 256 (what the memory model reverted on 12-05 would have chosen)
    # 6.46 s (2.25, 0.77, 3.36), 19.80 GiB, against the plan's own 6.16 s (2.19 ... , 18.82 GiB, the budget row again
    # on this machine); the 1.5b 12GB row's flags 6.47 s (2.33, 0.76, 3.31), 9.44 GiB (5.70 s, 9.46 GiB on the H200)
    dict(row="1.5b_full_24gb (H100, activation offload, compile kept out)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=18.87, step_time_s=7.83, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_FP32_24GB + ["--activation_offload"]),
    dict(row="1.5b_full_24gb (H100, no activation offload)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=20.02, step_time_s=6.33, copy_shared=True, gpu="h100", copy_fused=True, flags=_FP32_24GB),
    dict(row="1.5b_full_24gb (H100, micro-batches of 32)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=19.80, step_time_s=6.46, copy_shared=True, gpu="h100", copy_fused=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 32").split()),
    dict(row="1.5b_full_12gb (H100)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=9.44, step_time_s=6.47,
         copy_shared=True, gpu="h100",
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 "
                "--optim adamw_8bit --optimizer_offload --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    # the same machine, fitted (HOST_STEP_S, until HostStepped superseded it): the 7b 80GB row's flags with the untied input embedding in CPU memory,
    # its rows fetched per micro-batch (--generation_copy: the captured step needs weights that stay put): 22.7 s
    # (22.77, 22.71; generate 5.68, ref 2.91, update 14.06), 59.70 GiB; the row itself ran 15.18 s (update 7.89),
    # 61.52 GiB on an H200 on 2026-12-03 and was not rerun beside it
    dict(row="input embedding in CPU memory (7b, the 80GB row's flags, H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=59.70, step_time_s=22.74, copy_shared=True, gpu="h100", fitted=True,
         superseded=_HOST_STEPPED,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_8bit --generation_backend compiled "
                "--generation_copy --empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4 "
                "--param_offload --offload_policy embedding").split()),
]

_BF16_24GB = ("--torch_dtype bfloat16 --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
              "--optimizer_offload --generation_backend compiled").split()
_BF16_12GB_COPY = ("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size 256 "
                   "--optim adamw_8bit --optimizer_offload --generation_backend compiled --generation_copy "
                   "--empty_cache_between_phases --ref_device swap --per_device_train_batch_size 16").split()
_BF16_80GB_COPY = ("--torch_dtype bfloat16 --torch_compile --optim adamw_8bit --generation_backend compiled "
                   "--generation_copy --empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4"
                   ).split()
BUDGET_RUNS += [
    # 2026-12-05, night (stop 42), held out unless marked (3 steps, median of steps 2-3), under the cap, on one H100
    # 80GB HBM3 (no H200 came when asked), one machine for all. The 1.5b 24GB row as the planner plans it
    # (`python benchmarks/budget.py --rows 1.5b_full_24gb --steps 3`): 5.95 s (5.94, 5.97; estimated 6.3), 18.82 GiB
    # (generate 2.04, ref 0.72, update 3.16). Beside it, bf16 weights: the planner's bf16 plan (checkpointed,
    # micro-batches of 32) 5.80 s (5.79, 5.81; generate 2.09, ref 0.65, update 3.02), 18.90 GiB; the same without
    # checkpointing at micro-batches of 4 (caches emptied, reference swapped) 6.03 s (6.07, 6.00; update 2.99, ref
    # 0.78), 16.21 GiB: no recompute, but micro-batches too small to run the matmuls faster
    dict(row="1.5b_full_24gb (H100, stop 42)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=18.82,
         step_time_s=5.95, copy_shared=True, gpu="h100", copy_fused=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="1.5b bf16 24GB, checkpointed, micro-batches of 32 (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=18.90, step_time_s=5.80, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_BF16_24GB + "--use_gradient_checkpointing --per_device_train_batch_size 32".split()),
    dict(row="1.5b bf16 24GB, no checkpointing, micro-batches of 4 (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=16.21, step_time_s=6.03, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_BF16_24GB + "--empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4".split()),
    # the input-embedding lever with HostStepped, each beside the same flags without it. 7b (untied: the input
    # embedding's rows per micro-batch): 17.57 s (17.73, 17.41; generate 5.54, ref 2.78, update 9.20), 58.55 GiB,
    # against 19.33 s (16.70, 21.96: step 3's ref 4.40 s and update 12.11 s, step 2's 2.79 and 8.39), 62.67 GiB;
    # before HostStepped the lever's run took 22.7 s (update 14.06). 1.5b (tied: the whole matrix crosses three
    # times a micro-batch), the 12GB row's flags with --generation_copy: 9.60 s (9.63, 9.57; update 6.47), 8.55 GiB,
    # against 6.53 s (6.36, 6.69; update 3.47), 9.44 GiB. PARAM_OFFLOAD was refitted to the 1.5b pair (fitted); the
    # 7b pair is held out
    dict(row="input embedding in CPU memory (7b, HostStepped, H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=58.55, step_time_s=17.57, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_BF16_80GB_COPY + "--param_offload --offload_policy embedding".split()),
    dict(row="7b 80GB row's flags with --generation_copy (H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=62.67, step_time_s=19.33, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_BF16_80GB_COPY),
    # 2026-12-06, H200 (held out): the same flags once the copy is built on the meta device (476a8f6; built on the
    # GPU whole, it held a whole bf16 model for a moment at every rollout): generation 42.91 -> 38.34 GiB allocated,
    # as the flags without the copy. 2 steps; step 2 ran with --memory_snapshot recording the allocator's history
    dict(row="7b 80GB row's flags with --generation_copy built on the meta device (H200)", shape="qwen2.5-7b",
         algo="grpo", peak_reserved_gib=61.52, step_time_s=15.4, copy_shared=True, copy_fused=True,
         flags=_BF16_80GB_COPY),
    dict(row="tied embedding and head in CPU memory (1.5b, HostStepped, H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=8.55, step_time_s=9.60, copy_shared=True, gpu="h100", copy_fused=True, fitted=True,
         flags=_BF16_12GB_COPY + "--param_offload --offload_policy embedding".split()),
    dict(row="1.5b 12GB row's flags with --generation_copy (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=9.44, step_time_s=6.53, copy_shared=True, gpu="h100", copy_fused=True,
         flags=_BF16_12GB_COPY),
]
_QLORA_24GB = ("--use_lora --load_in_4bit --use_gradient_checkpointing --logprob_chunk_size 1024 --prefill_chunk_size 64 "
               "--generation_backend compiled --generation_copy --generation_copy_dtype int8 "
               "--empty_cache_between_phases --per_device_train_batch_size 32").split()
_LORA_24GB = ("--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --activation_offload --logprob_chunk_size "
              "256 --generation_slice_size 64 --prefill_chunk_size 64 --generation_backend compiled --generation_copy "
              "--generation_copy_in_place --empty_cache_between_phases --per_device_train_batch_size 16").split()
BUDGET_RUNS += [
    # 2026-12-06 (stop 44), one H100 80GB HBM3, 3 steps (median of steps 2-3), `python benchmarks/budget.py --rows ROW
    # --steps 3`, each row run from main (edbeef1: the logprobs_and_entropy Function, logits_fused=True) and from
    # f266fff (the graph before it) on the same machine. 1.5b 24GB: 5.95 -> 5.41 s (update 3.11 -> 2.71, ref 0.71 ->
    # 0.62, generate 2.08 -> 2.03), 18.77 -> 16.66 GiB (update 17.62 -> 15.76 allocated); the run before repeats
    # stop 42's (5.95 s, 18.82 GiB) and is not listed again. The fused memory constants were counted and checked on
    # the 1.5b run; the time saved (LOGIT_PASSES_SAVED) was fitted to all three pairs: the three after-runs are
    # marked fitted. 7b QLoRA 24GB: 21.13 -> 20.70 s (update 11.19 -> 10.97), 19.55 GiB both (peak
    # in generate). 7b LoRA 24GB: 24.27 -> 23.95 s (update 11.42 -> 10.85, ref 3.09 -> 2.89, generate 9.69 ->
    # 10.16), 19.63 -> 19.81 GiB (peak in the update, 18.79 allocated both)
    dict(row="1.5b_full_24gb, logprob Function (H100)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=16.66,
         step_time_s=5.41, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True, fitted=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="7b_qlora_24gb before the logprob Function (H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=19.55, step_time_s=21.13, copy_shared=True, gpu="h100", copy_fused=True, flags=_QLORA_24GB),
    dict(row="7b_qlora_24gb, logprob Function (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.55,
         step_time_s=20.70, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True, fitted=True,
         flags=_QLORA_24GB),
    dict(row="7b_lora_24gb before the logprob Function (H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=19.63, step_time_s=24.27, copy_shared=True, gpu="h100", copy_fused=True, flags=_LORA_24GB),
    dict(row="7b_lora_24gb, logprob Function (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.81,
         step_time_s=23.95, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True, fitted=True,
         flags=_LORA_24GB),
]

BUDGET_RUNS += [
    # 2026-12-06 (stop 45), one H100 80GB HBM3, held out: rows rerun as --auto_memory plans them today (3 steps,
    # median of steps 2-3, `python benchmarks/budget.py --rows ROW --steps 3`; benchmarks/results/stop45_h100/). The
    # 1.5b 12GB and 7b LoRA 24GB plans moved to --logprob_chunk_size 1024 with the logits memory of 70aec1a; the
    # 1.5b 24GB and 7b QLoRA 24GB rows repeat stop 44's flags (5.55 s against 5.41 then; 7b QLoRA 20.70 s both,
    # not listed again)
    dict(row="1.5b_full_12gb, logprob Function, chunks of 1024 (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=9.44, step_time_s=5.74, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 "
                "--optim adamw_8bit --optimizer_offload --generation_backend compiled --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="1.5b_full_24gb, logprob Function, again (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=16.66, step_time_s=5.55, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--use_gradient_checkpointing --torch_compile --logprob_chunk_size 1024 --optim adamw_8bit "
                "--optimizer_offload --generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--ref_device swap --per_device_train_batch_size 16").split()),
    dict(row="1.5b_no_flags, logprob Function (H100)", shape="qwen2.5-1.5b", algo="grpo", peak_reserved_gib=57.07,
         step_time_s=8.03, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True, flags=[]),
    dict(row="7b_lora_24gb, logprob Function, chunks of 1024 (H100)", shape="qwen2.5-7b", algo="grpo",
         peak_reserved_gib=20.16, step_time_s=23.88, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=[("1024" if f == "256" else f) for f in _LORA_24GB]),
    dict(row="ppo_1.5b_24gb, logprob Function (H100)", shape="qwen2.5-1.5b", algo="ppo", peak_reserved_gib=17.14,
         step_time_s=10.09, copy_shared=True, updates_apart=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--reward_model_name_or_path x --torch_dtype bfloat16 --use_gradient_checkpointing --torch_compile "
                "--logprob_chunk_size 1024 --optim adamw_8bit --optimizer_offload --generation_backend compiled "
                "--ref_device swap --reward_device swap --per_device_train_batch_size 32").split()),
]

BUDGET_RUNS += [
    # 2026-12-06 (stop 46), one H100 80GB HBM3, held out: the four rows not rerun since the logprob Function, as
    # --auto_memory plans them today (3 steps, median of steps 2-3, `python benchmarks/budget.py --rows ROW --steps
    # 3`; benchmarks/results/stop46_h100/). 7b 80GB: generate 5.32, ref 2.66, update 8.14 s. 7b 48GB: generate 5.31,
    # ref 2.74, update 9.25 s. 7b QLoRA 12GB (no --optimizer_offload in today's plan): generate 28.21, ref 2.97,
    # update 11.70 s. W-PPO 7b (no logprob chunks in today's plan): generate 5.22, update 10.65, critic update 10.19 s
    dict(row="7b_full_80gb, logprob Function (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=60.35,
         step_time_s=16.18, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_8bit --generation_backend compiled "
                "--empty_cache_between_phases --ref_device swap --per_device_train_batch_size 4").split()),
    dict(row="7b_full_48gb, logprob Function (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=37.60,
         step_time_s=17.38, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--torch_dtype bfloat16 --torch_compile --optim adamw_4bit --optimizer_offload "
                "--generation_backend compiled --empty_cache_between_phases --ref_device swap "
                "--per_device_train_batch_size 2").split()),
    dict(row="7b_qlora_12gb, logprob Function (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=10.50,
         step_time_s=42.92, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         superseded=_ONE_ROW_PRODUCTS,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --activation_offload --logprob_chunk_size 256 "
                "--generation_slice_size 64 --prefill_chunk_size 64 --generation_backend compiled "
                "--empty_cache_between_phases --per_device_train_batch_size 16").split()),
    dict(row="ppo_7b_80gb, logprob Function (H100)", shape="qwen2.5-7b", algo="ppo", peak_reserved_gib=70.53,
         step_time_s=38.03, copy_shared=True, updates_apart=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--use_lora --torch_dtype bfloat16 --reward_model_name_or_path x --use_gradient_checkpointing "
                "--generation_backend compiled --generation_copy --empty_cache_between_phases "
                "--per_device_train_batch_size 32").split()),
]

BUDGET_RUNS += [
    # 2026-12-06 (stop 48), one H100 80GB HBM3: the 7b QLoRA 12GB row after 43ac109 and bbad4df (o_proj and the
    # prefill's LM head as one matrix product each), the plan unchanged (`python benchmarks/budget.py --rows
    # 7b_qlora_12gb --steps 3`; benchmarks/results/stop48_h100/): generate 22.07 s (28.21 before), ref 2.99, update
    # 12.61. The 7b QLoRA 24GB row (int8 copy) ran again the same hour: 20.61 s, 19.55 GiB (20.70 before; not listed)
    dict(row="7b_qlora_12gb, one-matrix o_proj (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=10.48,
         step_time_s=37.72, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True, fitted=True,
         flags=("--use_lora --load_in_4bit --use_gradient_checkpointing --activation_offload --logprob_chunk_size 256 "
                "--generation_slice_size 64 --prefill_chunk_size 64 --generation_backend compiled "
                "--empty_cache_between_phases --per_device_train_batch_size 16").split()),
    # 2026-12-06 (stop 49), one H100 80GB HBM3: both 7b QLoRA rows with --use_bnb_nested_quant false added to the row
    # (`python benchmarks/budget.py --rows ROW --steps 3`; benchmarks/results/stop49_h100/), before the planner searched
    # it; its plans are those it chooses since. 12GB: generate 20.96 s (22.07 nested), ref 2.96, update 13.58 (12.61:
    # reserved reached the 10.5 GiB cap); 24GB: generate 6.89, ref 2.69, update 10.82 (20.61 s nested, stop 48)
    dict(row="7b_qlora_12gb, float32 statistics (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=10.50,
         step_time_s=37.55, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--use_lora --load_in_4bit --use_bnb_nested_quant false --use_gradient_checkpointing "
                "--activation_offload --logprob_chunk_size 256 --generation_slice_size 64 --prefill_chunk_size 64 "
                "--generation_backend compiled --empty_cache_between_phases --per_device_train_batch_size 16").split()),
    dict(row="7b_qlora_24gb, float32 statistics (H100)", shape="qwen2.5-7b", algo="grpo", peak_reserved_gib=19.50,
         step_time_s=20.43, copy_shared=True, gpu="h100", copy_fused=True, logits_fused=True,
         flags=("--use_lora --load_in_4bit --use_bnb_nested_quant false --use_gradient_checkpointing "
                "--logprob_chunk_size 1024 --optimizer_offload --prefill_chunk_size 64 --generation_backend compiled "
                "--generation_copy --generation_copy_dtype int8 --empty_cache_between_phases "
                "--per_device_train_batch_size 32").split()),
]


def _unshared(algo, flags):
    """A GRPO run measured before --share_prompt_cache was on by default (2026-12-07) that does not name the flag
    decoded without it: said as a flag (as _then_default says the decoding backend of the runs before auto)."""
    if algo != "grpo" or "--share_prompt_cache" in flags:
        return flags
    off = ["--share_prompt_cache", "false"]
    return f"{flags} {' '.join(off)}" if isinstance(flags, str) else flags + off


# every run above ran before then
MEASURED = [(shape, _unshared("grpo", flags), gib) for shape, flags, gib in MEASURED]
HELD_OUT = [(shape, _unshared("grpo", flags), gib) for shape, flags, gib in HELD_OUT]
TIME_SUPERSEDED = {_unshared("grpo", flags): why for flags, why in TIME_SUPERSEDED.items()}  # GRPO runs' flags only
TIME_FIT = [(shape, algo, _unshared(algo, flags), *rest) for shape, algo, flags, *rest in TIME_FIT]
TIME_HELD_OUT = [(shape, algo, _unshared(algo, flags), *rest) for shape, algo, flags, *rest in TIME_HELD_OUT]
for _run in BUDGET_RUNS:
    _run["flags"] = _unshared(_run["algo"], _run["flags"])

BUDGET_RUNS += [
    # 2026-12-07 (stop 56), one H100 80GB HBM3, held out (4 steps, median of steps 2-4): the no-flags row (float32
    # weights, the prompt cache shared by default, the decoding products through float32_mm), beside 25f1069 (before
    # both) on the same machine (`python benchmarks/budget.py --rows 1.5b_no_flags --steps 4 --baseline 25f1069`;
    # benchmarks/results/stop56_h100/): 7.70 -> 7.11 s, generate 3.68 -> 3.08 s, 58.22 -> 57.52 GiB reserved
    dict(row="1.5b_no_flags, shared prompt and float32_mm (H100)", shape="qwen2.5-1.5b", algo="grpo",
         peak_reserved_gib=57.52, step_time_s=7.11, gpu="h100", copy_fused=True, logits_fused=True,
         float32_kernel=True, flags=[]),
]

# the runs estimate()'s untied head counted apart from a layer's activations was fitted to: --measured counts their
# memory as fitted (`time out`), their step time as held out
HEAD_APART_FIT = {"7b_full_80gb (checkpointed, micro-batches of 32)",
                  "7b_full_80gb (checkpointed, micro-batches of 32, 2026-12-04)"}

# per-phase peak allocated GiB of budget rows (their metrics.jsonl, step 2 or the last), for the phase
# estimates: (row, shape, algo, flags, {phase: GiB}). PREFILL_INTER_BYTES was counted after these showed
# generation short, so they check it rather than hold it out
_FLAGS = {run["row"]: run["flags"] for run in BUDGET_RUNS}
PHASE_PEAKS = [(row, shape, algo, _FLAGS[row], peaks) for row, shape, algo, peaks in [
    ("7b_full_80gb (checkpointed, micro-batches of 32)", "qwen2.5-7b", "grpo",
     {"generate": 38.34, "ref": 50.58, "actor_update": 57.73}),
    ("7b_qlora_12gb (slices of 32)", "qwen2.5-7b", "grpo", {"generate": 8.52, "ref": 6.57, "actor_update": 8.82}),
    ("ppo_7b_80gb (optimizer on the GPU)", "qwen2.5-7b", "ppo", {"generate": 65.36, "ref": 44.85, "actor_update": 56.05}),
    ("1.5b_full_12gb (unsliced step)", "qwen2.5-1.5b", "grpo", {"generate": 8.43, "ref": 8.17, "actor_update": 9.21}),
    ("7b_lora_24gb (before)", "qwen2.5-7b", "grpo", {"generate": 20.45, "actor_update": 18.3}),
    ("7b_qlora_24gb (4-bit decoding)", "qwen2.5-7b", "grpo", {"generate": 16.59, "actor_update": 18.56}),
    ("7b_qlora_12gb (no activation offload)", "qwen2.5-7b", "grpo", {"generate": 9.29, "ref": 6.57, "actor_update": 8.74}),
    ("7b_full_48gb (checkpointed)", "qwen2.5-7b", "grpo", {"generate": 31.47, "ref": 37.49, "actor_update": 38.69}),
    ("7b_lora_24gb (adapters in the step)", "qwen2.5-7b", "grpo", {"generate": 18.31, "actor_update": 19.88}),
    ("1.5b_full_24gb (activation offload)", "qwen2.5-1.5b", "grpo",
     {"generate": 16.34, "ref": 12.25, "actor_update": 16.93}),
    ("1.5b_full_24gb (chunk 256, micro-batches of 8)", "qwen2.5-1.5b", "grpo", {"generate": 16.77, "ref": 12.0, "actor_update": 17.26}),
    ("7b_qlora_24gb (slices of 64)", "qwen2.5-7b", "grpo", {"generate": 18.16, "ref": 9.04, "actor_update": 17.58}),
    ("1.5b_full_12gb (activation offload, 4-bit moments)", "qwen2.5-1.5b", "grpo", {"generate": 9.19, "ref": 7.73, "actor_update": 8.92}),
    ("7b_lora_24gb (input cast)", "qwen2.5-7b", "grpo", {"generate": 18.22, "ref": 16.41, "actor_update": 19.72}),
    ("7b_lora_24gb", "qwen2.5-7b", "grpo", {"generate": 18.22, "ref": 16.41, "actor_update": 18.62}),
    ("7b_qlora_24gb (SDPA decoding)", "qwen2.5-7b", "grpo", {"generate": 19.23, "ref": 9.02, "actor_update": 17.28}),
    ("7b_full_80gb (micro-batches of 2)", "qwen2.5-7b", "grpo", {"generate": 38.34, "ref": 49.61, "actor_update": 56.88}),
    ("7b_full_80gb", "qwen2.5-7b", "grpo", {"generate": 38.34, "ref": 45.81, "actor_update": 60.36}),
    ("7b_full_48gb", "qwen2.5-7b", "grpo", {"generate": 23.93, "ref": 29.95, "actor_update": 37.78}),
    ("7b_full_48gb (checkpointed, optimizer offload)", "qwen2.5-7b", "grpo",
     {"generate": 23.93, "ref": 29.96, "actor_update": 37.55}),
    # (a placed critic's values pass is not a phase of its own in the estimate)
    ("1.5b_full_24gb", "qwen2.5-1.5b", "grpo", {"generate": 13.85, "ref": 9.98, "actor_update": 17.63}),
    ("ppo_1.5b_24gb", "qwen2.5-1.5b", "ppo", {"generate": 10.54, "ref": 12.66, "reward": 12.48, "actor_update": 17.02,
                                              "critic_update": 15.65}),
    ("1.5b_full_24gb (optimizer offload)", "qwen2.5-1.5b", "grpo",
     {"generate": 13.85, "ref": 9.08, "actor_update": 14.56}),
    ("ppo_1.5b_24gb (interleaved updates)", "qwen2.5-1.5b", "ppo",
     {"generate": 16.39, "ref": 14.91, "reward": 15.69, "actor_update": 18.82, "critic_update": 17.92}),
    ("7b_qlora_24gb", "qwen2.5-7b", "grpo", {"generate": 19.23, "ref": 9.02, "actor_update": 17.24}),
    ("ppo_1.5b_24gb (activation offload, micro-batches of 4)", "qwen2.5-1.5b", "ppo",
     {"generate": 16.39, "ref": 14.91, "actor_update": 15.95, "critic_update": 15.10}),
    ("ppo_1.5b_24gb (critic swap, micro-batches of 32)", "qwen2.5-1.5b", "ppo",
     {"generate": 10.59, "ref": 10.08, "reward": 9.90, "values": 9.94, "actor_update": 14.42, "critic_update": 18.70}),
    ("ppo_1.5b_24gb (micro-batches of 16)", "qwen2.5-1.5b", "ppo",
     {"generate": 16.39, "ref": 15.17, "reward": 15.69, "actor_update": 17.10, "critic_update": 16.66}),
    ("ppo_1.5b_24gb (critic swap, micro-batches of 16)", "qwen2.5-1.5b", "ppo",
     {"generate": 10.59, "ref": 9.37, "reward": 9.90, "values": 9.37, "actor_update": 11.30, "critic_update": 16.66}),
    ("1.5b_full_12gb", "qwen2.5-1.5b", "grpo", {"generate": 7.67, "ref": 6.45, "actor_update": 9.37}),
    ("7b_qlora_12gb", "qwen2.5-7b", "grpo", {"generate": 8.99, "ref": 7.09, "actor_update": 9.47}),
    ("ppo_7b_80gb", "qwen2.5-7b", "ppo", {"generate": 63.33, "ref": 44.83, "actor_update": 53.05, "critic_update": 53.05}),
    ("1.5b_full_24gb (activation offload, 2026-12-04)", "qwen2.5-1.5b", "grpo",
     {"generate": 16.77, "ref": 12.24, "actor_update": 16.84}),
    ("7b_full_80gb (checkpointed, micro-batches of 32, 2026-12-04)", "qwen2.5-7b", "grpo",
     {"generate": 38.34, "ref": 50.57, "actor_update": 57.40}),
    ("1.5b_full_24gb (H100, unfused copy)", "qwen2.5-1.5b", "grpo",
     {"generate": 13.85, "ref": 9.98, "actor_update": 17.62}),
    ("1.5b_full_24gb (H100, stop 42)", "qwen2.5-1.5b", "grpo", {"generate": 13.85, "ref": 9.98, "actor_update": 17.63}),
    ("1.5b bf16 24GB, checkpointed, micro-batches of 32 (H100)", "qwen2.5-1.5b", "grpo",
     {"generate": 10.54, "ref": 9.79, "actor_update": 17.02}),
    ("1.5b bf16 24GB, no checkpointing, micro-batches of 4 (H100)", "qwen2.5-1.5b", "grpo",
     {"generate": 7.66, "ref": 7.06, "actor_update": 15.66}),
    ("input embedding in CPU memory (7b, HostStepped, H100)", "qwen2.5-7b", "grpo",
     {"generate": 40.86, "ref": 43.77, "actor_update": 57.29}),
    ("7b 80GB row's flags with --generation_copy (H100)", "qwen2.5-7b", "grpo",
     {"generate": 42.91, "ref": 45.81, "actor_update": 61.46}),
    ("7b 80GB row's flags with --generation_copy built on the meta device (H200)", "qwen2.5-7b", "grpo",
     {"generate": 38.34, "ref": 45.81, "actor_update": 60.36}),
    ("tied embedding and head in CPU memory (1.5b, HostStepped, H100)", "qwen2.5-1.5b", "grpo",
     {"generate": 8.10, "ref": 6.02, "actor_update": 7.91}),
    ("1.5b 12GB row's flags with --generation_copy (H100)", "qwen2.5-1.5b", "grpo",
     {"generate": 7.67, "ref": 6.45, "actor_update": 9.36}),
    # the QLoRA rows since the logprob Function (their JSONs in benchmarks/results/stop48_h100/, stop49_h100/): the
    # reference passes 10-12% above the count of eager layers before 2026-12-06's night, within 2% since
    ("7b_qlora_12gb, one-matrix o_proj (H100)", "qwen2.5-7b", "grpo",
     {"generate": 9.29, "ref": 7.40, "actor_update": 9.77}),
    ("7b_qlora_12gb, float32 statistics (H100)", "qwen2.5-7b", "grpo",
     {"generate": 9.57, "ref": 7.68, "actor_update": 10.06}),
    ("7b_qlora_24gb, float32 statistics (H100)", "qwen2.5-7b", "grpo",
     {"generate": 19.21, "ref": 9.00, "actor_update": 17.22}),
]]


def script_args(algo, argv, with_explicit=False):
    """The training script's Args parsed from argv, checked as the script checks them (and, with
    with_explicit, the names of the flags argv set)."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import importlib

    from utils.cli import parse_args

    module = importlib.import_module("train_grpo" if algo == "grpo" else "train_ppo")
    args, explicit = parse_args(module.Args, argv)
    module.check_args(args, 1, explicit)
    return (args, explicit) if with_explicit else args


def main(argv=None):
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    script_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b",
                        help=f"a workload shape ({', '.join(SHAPES)}), a hub id or a local folder (its config.json)")
    parser.add_argument("--algo", default="grpo", choices=["grpo", "ppo"])
    parser.add_argument("--gpu_memory", help="a card as sold (24GB: its usable 21 GiB) or a budget (21GiB); default: "
                        "the first visible GPU's memory")
    parser.add_argument("--gpu", choices=list(GPUS), help="whose rates the time estimate uses; default: the visible "
                        "GPU's, else h200 (the others are datasheet rates scaled, not measured)")
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--gpus_per_process", type=int, help="GPUs each process may place roles on (--ref_device "
                        "cuda:1 ...); default: the visible GPUs / --num_processes, 1 without GPUs")
    parser.add_argument("--measured", action="store_true", help="estimates vs the measured H200 runs (memory and "
                        "step time, fitted and held out), and exit")
    parser.add_argument("--workload", action="store_true", help="use W-GRPO's (or W-PPO's) batch and lengths "
                        "(benchmarks/README.md)")
    opts = parser.parse_args(argv)
    if opts.num_processes < 1 or (opts.gpus_per_process is not None and opts.gpus_per_process < 1):
        parser.error("--num_processes and --gpus_per_process must be at least 1")
    if opts.measured:
        print_measured()
        return
    workload = (WORKLOAD_GRPO if opts.algo == "grpo" else WORKLOAD_PPO) if opts.workload else []
    base = workload + script_argv
    base = base if any(a == "--model_name_or_path" for a in base) else base + ["--model_name_or_path", opts.model]
    try:
        shape = load_shape(opts.model)
        gpu_bytes = parse_memory(opts.gpu_memory) if opts.gpu_memory else None
    except ValueError as e:  # one line, as the scripts answer bad input
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    args, explicit = script_args(opts.algo, base, with_explicit=True)
    import torch

    if gpu_bytes is None:
        if not torch.cuda.is_available():
            parser.error("no GPU visible: give --gpu_memory (e.g. 24GB, a card as sold, or 21GiB)")
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    gpu = GPUS[opts.gpu] if opts.gpu else gpu_of(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    gpus = opts.gpus_per_process if opts.gpus_per_process is not None else owned_gpus(opts.num_processes)
    print(report(shape, estimate(shape, args, opts.algo, opts.num_processes), gpu_bytes,
                 estimate_time(shape, args, opts.algo, opts.num_processes, gpu), gpu))
    added, reasons, final = plan(shape, args, opts.algo, gpu_bytes, opts.num_processes,
                                 parse=lambda extra: apply_flags(args, extra), gpus_per_process=gpus,
                                 explicit=explicit, gpu=gpu)
    fits = final["peak_reserved"] <= FIT_FRACTION * gpu_bytes
    print("\nplan:" if added else "\nplan: fits as it is" if fits else "\nplan: nothing fits")
    for line in reasons:
        print("  " + line)
    if added:
        print(f"add: {' '.join(added)}\n  -> estimated peak reserved {final['peak_reserved'] / GIB:.1f} GiB, step "
              f"{final['time']['step']:.1f} s (" + ", ".join(f"{p} {t:.2f}" for p, t in final["time"]["phases"].items())
              + ")" + "".join(f"; {d}: {u / GIB:.1f} GiB" for d, u in final["other_gpus"].items()))


def as_measured(flags=None, row=None):
    """estimate's keywords for a measured run, as the code was when it ran: a BUDGET_RUNS row's own marks
    (copy_shared=True: the generation copy held the policy's bf16 tensors; updates_apart=True: PPO's actor and
    critic updated one after the other; critic_moments_whole_phase=True: a swapped critic's moments on the GPU for
    its whole update; logits_fused=True: the logprobs and entropy through utils/ops.py's Function), or for a run given
    by its flags, those of the BUDGET_RUNS rows with the same flags; a run without the first two was measured before
    those changes."""
    rows = [row] if row is not None else [r for r in BUDGET_RUNS if r["flags"] == list(flags)]
    return dict(copy_shares=any(r.get("copy_shared", False) for r in rows),
                updates_apart=any(r.get("updates_apart", False) for r in rows),
                swapped_moments_for_step=not any(r.get("critic_moments_whole_phase", False) for r in rows),
                # only a row's own mark: a run given by its flags alone was measured before 2026-12-06
                logits_fused=row is not None and row.get("logits_fused", False))


def time_as_measured(row=None):
    """estimate_time's keywords for a measured run: its GPU (a BUDGET_RUNS row's gpu, else the H200) and, unless
    its row says copy_fused=True, the generation copy unfused (every run before 2026-12-05); unless it says
    logits_fused=True, the logprobs as before utils/ops.py's Function (every run before 2026-12-06); unless it says
    float32_kernel=True, a float32 policy's decoding products through autocast (every run before 2026-12-07)."""
    row = row or {}
    return dict(gpu=GPUS[row.get("gpu", "h200")], copy_fused=row.get("copy_fused", False),
                logits_fused=row.get("logits_fused", False), float32_kernel=row.get("float32_kernel", False))


def measured_rows():
    """(set, algo, shape, flags, measured GiB or None, measured step s or None, estimate's keywords as the code
    was then, estimate_time's): every run the planner is checked against (H200, and H100 where a row says so)."""
    out = []
    for rows, kind, algo in ((MEASURED, "fit", "grpo"), (HELD_OUT, "held out", "grpo"),
                             (HELD_OUT_PPO, "held out", "ppo")):
        out += [(kind, algo, shape, flags, gib, None, as_measured(flags), time_as_measured())
                for shape, flags, gib in rows]
    for rows, kind in ((TIME_FIT, "fit"), (TIME_HELD_OUT, "held out")):
        out += [("old code" if flags in TIME_SUPERSEDED else kind, algo, shape, flags.split(), None, step,
                 as_measured(flags.split()), time_as_measured())
                for shape, algo, flags, step, _ in rows]
    out += [("old code" if row.get("superseded") else "fit" if row.get("fitted")
             else "time out" if row["row"] in HEAD_APART_FIT else "held out", row["algo"],
             row["shape"], row["flags"],
             row["peak_reserved_gib"], row["step_time_s"], as_measured(row=row), time_as_measured(row))
            for row in BUDGET_RUNS]
    return out


def print_measured():
    print(f"{'shape':<14}{'est GiB':>9}{'meas GiB':>9}{'error':>7}{'est s':>8}{'meas s':>8}{'error':>7}  "
          f"{'set':<9}flags")
    held = []  # (memory within 10%, time within 25% (None where not measured), what ran) of each held-out run
    for kind, algo, shape_name, flags, gib, step, then, time_then in measured_rows():
        args = script_args(algo, (WORKLOAD_GRPO if algo == "grpo" else WORKLOAD_PPO) + list(flags))
        shape = load_shape(shape_name)
        est_gib = estimate(shape, args, algo, **then)["peak_reserved"] / GIB
        est_s = estimate_time(shape, args, algo, **time_then)["step"]
        cells = [f"{est_gib:>9.2f}", f"{gib:>9.2f}" if gib else f"{'':>9}",
                 f"{est_gib / gib - 1:>+7.0%}" if gib else f"{'':>7}", f"{est_s:>8.2f}",
                 f"{step:>8.2f}" if step else f"{'':>8}", f"{est_s / step - 1:>+7.0%}" if step else f"{'':>7}"]
        on = "" if time_then["gpu"] is GPUS["h200"] else f" (on the {time_then['gpu']['name']})"
        print(f"{shape_name:<14}" + "".join(cells) + f"  {kind:<9}{algo.upper()} {' '.join(flags)}{on}")
        if kind in ("held out", "time out"):
            measured = " / ".join(([f"{gib:.2f} GiB"] if gib else []) + ([f"{step:.2f} s"] if step else []))
            held.append((abs(est_gib / gib - 1) <= 0.10 if gib and kind == "held out" else None,
                         abs(est_s / step - 1) <= 0.25 if step else None,
                         f"{shape_name} {est_gib:.2f} GiB / {est_s:.2f} s estimated against {measured}"))
    memory, times = [h[0] for h in held if h[0] is not None], [h[1] for h in held if h[1] is not None]
    print(f"held out, today's code: memory within 10% in {sum(memory)} of {len(memory)} runs, step time within 25% in "
          f"{sum(times)} of {len(times)} (runs marked `old code` measured a code path changed since, BUDGET_RUNS' "
          f"`superseded`: listed, not counted; `time out`: memory fitted, step time held out)")
    for memory_in, time_in, what in held:
        if memory_in is False or time_in is False:
            print(f"  outside: {what}")


if __name__ == "__main__":
    main()
