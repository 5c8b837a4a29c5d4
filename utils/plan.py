"""Memory planner: the GPU memory a run will need, per role, component and phase, estimated from
the model's config alone (no weights loaded), and the cheapest set of memory flags that fits.

    python -m utils.plan --model qwen2.5-7b --gpu_memory 48GiB                 # a workload shape
    python -m utils.plan --model Qwen/Qwen2.5-1.5B-Instruct --algo ppo -- --use_lora
    python -m utils.plan --model qwen2.5-1.5b --measured                       # vs the H200 runs

Arguments after `--` are the training script's flags (the same parser, so the same names and
defaults). The estimate is per process and counts what the scripts allocate: weights, gradients
and optimizer state of each role, the KV cache and prefill of generation, activations (all
layers, or only each layer's input under checkpointing, plus one layer recomputed), the LM head's
logits with their fp32 copies, and the bf16 copies autocast makes of fp32 weights during a
forward. Reserved memory is allocated memory plus the allocator's slack (a fitted fraction).
The coefficients marked `fitted` were fitted to the H200 runs of benchmarks/memory.py
(MEASURED below; `--measured` prints estimate against measurement for each)."""

import math
import sys
from dataclasses import dataclass

from utils.base import CAPTURED_BACKENDS, GIB, own_gpus, parse_memory, static_cache_len  # noqa: F401 (re-exported)

# the workload shapes (../shared/workloads.md); benchmarks/memory.py builds its models from these
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
LOGIT_BYTES, LOGIT_BYTES_NO_GRAD = 14, 10
RESERVED_SLACK = 0.08
PREFILL_BYTES = 12


# the embedded tiny model of utils/toy.py (Llama: no q/k/v biases); tests/test_plan.py checks it against
# the model toy.build_model builds
TOY_SHAPE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


@dataclass
class Shape:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    tied: bool
    qkv_bias: bool = True  # Qwen2 has biases on q, k, v; Llama only with attention_bias

    @classmethod
    def from_config(cls, config):
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        qwen2 = (get("model_type") or "qwen2") == "qwen2"
        return cls(get("vocab_size"), get("hidden_size"), get("intermediate_size"), get("num_hidden_layers"),
                   get("num_attention_heads"), get("num_key_value_heads") or get("num_attention_heads"),
                   bool(get("tie_word_embeddings", False)), bool(get("attention_bias", qwen2)))

    @property
    def head_dim(self):
        return self.hidden // self.heads

    @property
    def linear_params(self):  # the decoder layers' Linear weights: what bitsandbytes quantises
        kv = self.kv_heads * self.head_dim
        return self.layers * (2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.inter)

    @property
    def embedding_params(self):
        return self.vocab * self.hidden

    @property
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
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    return Shape.from_config(getattr(config, "text_config", config))


def _optimizer_bytes_per_param(optim, weight_bytes):
    if optim == "adamw_torch":
        return 2 * weight_bytes  # two moments in the weights' dtype (fp32; bf16 for torchao's SR AdamW)
    return {"adamw_8bit": 2.03, "paged_adamw_8bit": 2.03, "adamw_4bit": 1.06}[optim]  # measured, with scales


def _frozen_bytes(shape, params, quant):
    """A frozen model's weights: bf16, or the decoder Linears at `quant` bytes (4/8-bit) and the rest bf16."""
    return (shape.linear_params * quant + (params - shape.linear_params) * 2) if quant else params * 2


def owned_gpus(num_processes) -> int:
    """The GPUs each process owns (utils/placement.py: with several processes, --ref_device cuda:1
    names a process's own second GPU): the last rank's count, the fewest; 1 without GPUs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return max(1, len(own_gpus(num_processes - 1, num_processes, count)))


def kv_bytes_per_token(shape) -> int:
    """The KV cache of one token: keys and values of every layer, in bf16."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * 2


def _other_gpu(device) -> bool:
    """A role placed on a GPU other than the process's first (cuda:0 in the planner's terms)."""
    return bool(device) and device.startswith("cuda:") and device != "cuda:0"


def estimate(shape: Shape, args, algo="grpo", num_processes=1) -> dict:
    """Bytes per component and per phase for one process. `args`: the script's Args (flags).
    Roles placed on another GPU (`--ref_device cuda:1`, `--critic_device cuda:1`) are left out of the
    phases (the first GPU's) and counted in `other_gpus`: {device: estimated peak reserved bytes}."""
    P, C = args.max_prompt_length, args.max_completion_length
    T = P + C
    if algo == "grpo":
        rows = args.prompts_per_step // num_processes * args.num_generations
    else:
        rows = args.prompts_per_step // num_processes
    gen_rows = min(args.generation_slice_size or rows, rows)
    mixed = args.mixed_precision != "no"  # auto is bf16 on a GPU
    train_bytes = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}[args.torch_dtype]
    quant = 0.52 if args.load_in_4bit else 1.02 if args.load_in_8bit else None  # bytes per quantised weight
    roles = ["actor"] + (["critic"] if algo == "ppo" else [])
    offloaded = 0
    if args.param_offload:
        policy = {p.strip() for p in args.offload_policy.split(",")}
        offloaded = shape.embedding_params * (("embedding" in policy) + ("lm_head" in policy and not shape.tied))
    comp = {}
    for role in roles:
        head = shape.embedding_params if role == "actor" and not shape.tied else shape.hidden  # value head
        role_params = shape.params - (0 if role == "actor" else (0 if shape.tied else shape.embedding_params)) + (
            0 if role == "actor" else head)
        on_gpu = role_params - (offloaded if role == "actor" else min(offloaded, shape.embedding_params))
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
    cache_len = T if args.generation_backend == "hf" else static_cache_len(P, C)  # the static cache is rounded up
    comp["generate/kv_cache"] = gen_rows * cache_len * kv_bytes_per_token(shape)
    comp["generate/copy"] = shape.params * 2 if args.generation_copy else 0  # --generation_copy: bf16 weights
    # what a rollout leaves allocated for the next one (a captured decoder's KV cache, the copy), unless
    # --empty_cache_between_phases drops them
    kept = 0 if args.empty_cache_between_phases else comp["generate/copy"] + (
        comp["generate/kv_cache"] if args.generation_backend in CAPTURED_BACKENDS else 0)
    comp["generate/prefill"] = gen_rows * P * shape.hidden * PREFILL_BYTES + gen_rows * shape.vocab * 8
    # micro-batch of the update and the no-grad passes
    if args.use_dynamic_bsz:
        tokens = min(args.max_token_len_per_gpu // T, rows) * T
    else:
        tokens = min(args.per_device_train_batch_size, rows) * T
    positions = tokens // T * (C + 1)
    layer_act = tokens * (LAYER_ACT_HIDDEN * shape.hidden + LAYER_ACT_INTER * shape.inter)
    residual_bytes = 4 if train_bytes == 4 and not args.use_lora else 2
    if args.use_gradient_checkpointing:
        saved = 0 if args.activation_offload else shape.layers * tokens * shape.hidden * residual_bytes
        comp["update/activations"] = saved + layer_act
    else:
        comp["update/activations"] = shape.layers * layer_act
    chunk = min(args.logprob_chunk_size or positions, positions)
    comp["update/logits"] = chunk * shape.vocab * LOGIT_BYTES + positions * shape.hidden * 4
    if args.logprob_chunk_size and not args.use_lora:  # the head's weight gradient, summed over chunks
        comp["update/logits"] += 2 * shape.vocab * shape.hidden * train_bytes
    comp["ref/logits"] = chunk * shape.vocab * LOGIT_BYTES_NO_GRAD + layer_act // 2

    other = {}  # another GPU -> its peak: the role's state plus its own pass
    if reward_elsewhere:
        other[args.reward_device] = reward_state + comp["ref/logits"] // 4  # no LM head: hidden states only
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
    static = sum(comp[f"{r}/weights"] + comp[f"{r}/optimizer"] for r in here) + comp["ref/weights"] \
        + comp["reward/weights"]
    grads = sum(comp[f"{r}/gradients"] for r in here)
    casts = comp["actor/autocast_copies"]
    phases = {
        "generate": static + comp["generate/kv_cache"] + comp["generate/prefill"] + comp["generate/copy"]
        + (0 if args.generation_copy else casts),
        "ref": static + kept + (0 if ref_elsewhere else comp["ref/logits"]) + swapped_ref
        + (shape.embedding_params * 2 if args.ref_device == "offload" else 0),
        "actor_update": static + kept + grads + max(casts + comp["update/activations"],
                                                    comp["update/activations"] + comp["update/logits"]),
    }
    if reward_state and args.reward_device == "swap":  # the reward model on the GPU for its phase only
        phases["reward"] = static + kept + reward_state + comp["ref/logits"] // 4
    if algo == "ppo" and not critic_elsewhere:
        phases["critic_update"] = static + kept + grads + comp["update/activations"] + positions * shape.hidden * 4
    peak_allocated = max(phases.values())
    return dict(components=comp, phases=phases, peak_allocated=peak_allocated,
                other_gpus={device: used * (1 + RESERVED_SLACK) for device, used in other.items()},
                peak_reserved=peak_allocated * (1 + RESERVED_SLACK),
                host_bytes=offloaded * (train_bytes * 2 + _optimizer_bytes_per_param(args.optim, train_bytes))
                + (shape.params * 2 if args.ref_device in ("offload", "swap") else 0)
                + (reward_state if args.reward_device in ("offload", "swap", "cpu") else 0),
                tokens_per_micro_batch=tokens, rows=rows)


# levers the planner may add, cheapest first: (flags, why, applies?) -- LoRA changes the method, so
# it is only suggested, never applied
LEVERS = [
    (["--logprob_chunk_size", "1024"], "the LM head's logits 1024 tokens at a time", lambda a: not a.logprob_chunk_size),
    (["--use_gradient_checkpointing"], "keep only each layer's input for backward",
     lambda a: not a.use_gradient_checkpointing),
    (["--torch_dtype", "bfloat16"], "bf16 weights and gradients (stochastic-rounding optimizer)",
     lambda a: a.torch_dtype == "float32" and not a.use_lora),
    (["--optim", "adamw_8bit"], "8-bit optimizer moments", lambda a: a.optim == "adamw_torch"),
    (["--ref_device", "swap"], "the reference in CPU memory, on the GPU for its phase only",
     lambda a: a.ref_device is None and not a.use_lora),
    (["--ref_device", "offload"], "the reference in CPU memory, streamed layer by layer (slow)",
     lambda a: a.ref_device in (None, "swap") and not a.use_lora),
    (["--activation_offload"], "checkpointed layer inputs in pinned CPU memory",
     lambda a: a.use_gradient_checkpointing and not a.activation_offload),
    (["--optim", "adamw_4bit"], "4-bit optimizer moments", lambda a: a.optim in ("adamw_torch", "adamw_8bit")),
    (["--use_dynamic_bsz", "--max_token_len_per_gpu", "4096"], "micro-batches of at most 4096 tokens",
     lambda a: not a.use_dynamic_bsz and a.per_device_train_batch_size * (a.max_prompt_length + a.max_completion_length) > 4096),
    (["--generation_slice_size", "32"], "rollouts 32 at a time (smaller KV cache)",
     lambda a: (a.generation_slice_size or 1 << 30) > 32),
    (["--param_offload", "--offload_policy", "embedding,lm_head"], "embeddings and LM head in CPU memory",
     lambda a: not a.param_offload),
]


def plan(shape, args, algo, gpu_bytes, num_processes=1, parse=None, gpus_per_process=1):
    """Placement, then levers: with more than one GPU per process, the frozen reference (and the
    PPO critic) go to GPUs of their own first, as they cost no time and change no math; then levers
    are added (cheapest first, in passes until none helps) until the estimated peak reserved fits in
    90% of gpu_bytes; a later choice of the same flag (--optim) replaces the earlier.
    `parse(extra flags) -> args`. Returns (flags added, lines of reasoning, final estimate)."""
    headroom = 0.9 * gpu_bytes
    chosen, reasons = {}, []  # first flag -> the flags that set it
    current = estimate(shape, args, algo, num_processes)
    free_gpus = [f"cuda:{i}" for i in range(1, gpus_per_process)]
    movable = [("critic", "the critic's weights, gradients, optimizer state and update")] if algo == "ppo" else []
    movable.append(("ref", "the reference's weights and its logprob pass"))
    if args.reward_model_name_or_path:
        movable.append(("reward", "the reward model's weights and its scoring pass"))
    for role, what in movable:
        if current["peak_reserved"] <= headroom or not free_gpus:
            break
        if getattr(args, f"{role}_device", None) is not None or (role == "ref" and args.use_lora):
            continue  # placed by the user, or (LoRA) the reference is the policy itself
        flags = [f"--{role}_device", free_gpus.pop(0)]
        trial_flags = {**chosen, flags[0]: flags}
        trial = parse([f for group in trial_flags.values() for f in group])
        after = estimate(shape, trial, algo, num_processes)
        if after["peak_reserved"] < current["peak_reserved"]:
            there = after["other_gpus"][flags[1]]
            reasons.append(f"{' '.join(flags)}: {what} on a GPU of their own ({there / GIB:.1f} GiB there): "
                           f"{current['peak_reserved'] / GIB:.1f} -> {after['peak_reserved'] / GIB:.1f} GiB here")
            chosen, args, current = trial_flags, trial, after
    progress = True
    while current["peak_reserved"] > headroom and progress:
        progress = False
        for flags, why, applies in LEVERS:
            if current["peak_reserved"] <= headroom:
                break
            if not applies(args):
                continue
            trial_flags = {**chosen, flags[0]: flags}
            trial = parse([f for group in trial_flags.values() for f in group])
            after = estimate(shape, trial, algo, num_processes)
            if after["peak_reserved"] < current["peak_reserved"]:
                reasons.append(f"{' '.join(flags)}: {why}: {current['peak_reserved'] / GIB:.1f} -> "
                               f"{after['peak_reserved'] / GIB:.1f} GiB")
                chosen, args, current, progress = trial_flags, trial, after, True
    if current["peak_reserved"] > headroom:
        reasons.append(f"still {current['peak_reserved'] / GIB:.1f} GiB > {headroom / GIB:.1f} GiB (90% of the GPU): "
                       + ("use --use_lora (with --load_in_4bit for QLoRA), " if not args.use_lora else "")
                       + "more GPUs (accelerate launch, DeepSpeed/FSDP configs), or a smaller batch")
    for device, used in current["other_gpus"].items():
        if used > headroom:
            reasons.append(f"{device} would need {used / GIB:.1f} GiB, more than 90% of it")
    return [f for group in chosen.values() for f in group], reasons, current


def apply_flags(args, flags):
    """A copy of `args` with command-line style `flags` set (`--name value` or a bare `--name`
    for True), and the offload shorthands turned into placements, as the scripts' checks do."""
    import copy

    args = copy.copy(args)
    i = 0
    while i < len(flags):
        name = flags[i][2:]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            current = getattr(args, name)
            value = flags[i + 1]
            setattr(args, name, int(value) if isinstance(current, int) and not isinstance(current, bool)
                    or (current is None and value.isdigit()) else value)
            i += 2
        else:
            setattr(args, name, True)
            i += 1
    for role in ("ref", "reward"):
        if getattr(args, f"{role}_offload", False):
            setattr(args, f"{role}_device", "offload")
    return args


def run_planner(args, algo, num_processes, device, is_main=True):
    """--plan / --auto_memory in the scripts: print the estimate and the plan; exit after --plan;
    return the flags to add for --auto_memory. Before any model loads."""
    from utils.cli import UsageError

    if args.gpu_memory:
        gpu_bytes = parse_memory(args.gpu_memory)
    elif str(device).startswith("cuda"):
        import torch

        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    else:
        raise UsageError("--plan / --auto_memory: no GPU here to plan for; give --gpu_memory (e.g. 80GiB)")
    shape = load_shape(args.model_name_or_path)
    gpus = owned_gpus(num_processes) if str(device).startswith("cuda") else 1
    added, reasons, final = plan(shape, args, algo, gpu_bytes, num_processes, parse=lambda f: apply_flags(args, f),
                                 gpus_per_process=gpus)
    if is_main:
        print(report(shape, estimate(shape, args, algo, num_processes), gpu_bytes))
        print("plan: " + ("fits as it is" if not added else " ".join(added)) + "".join("\n  " + r for r in reasons)
              + f"\nestimated peak reserved with the plan: {final['peak_reserved'] / GIB:.1f} GiB", flush=True)
    if args.plan:
        sys.exit(0)
    return added


def report(shape, est, gpu_bytes=None) -> str:
    lines = [f"model: {shape.params / 1e9:.2f}B parameters ({shape.layers} layers, hidden {shape.hidden}, vocab "
             f"{shape.vocab}); micro-batch {est['tokens_per_micro_batch']} tokens; {est['rows']} completions "
             "per process per step", f"{'component':<28}{'GiB':>9}"]
    lines += [f"{name:<28}{value / GIB:>9.2f}" for name, value in est["components"].items() if value]
    lines += [f"{'phase peak (allocated)':<28}{'GiB':>9}"]
    lines += [f"{name:<28}{value / GIB:>9.2f}" for name, value in est["phases"].items()]
    lines.append(f"peak reserved (estimated): {est['peak_reserved'] / GIB:.2f} GiB"
                 + (f" of {gpu_bytes / GIB:.0f} GiB" if gpu_bytes else "")
                 + f"; host memory for offloading: {est['host_bytes'] / GIB:.1f} GiB")
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
WORKLOAD_GRPO = ["--prompts_per_step", "16", "--num_generations", "8", "--max_prompt_length", "256",
                 "--max_completion_length", "512", "--beta", "0.04", "--model_name_or_path", "x"]
# W-PPO (actor, critic and reference of one shape), measured 2026-12-01 with benchmarks/throughput.py --script ppo
HELD_OUT_PPO = [
    ("qwen2.5-1.5b", "--use_gradient_checkpointing --torch_dtype bfloat16 --optim adamw_8bit --logprob_chunk_size 1024 "
     "--generation_backend compiled".split(), 28.12),
]
WORKLOAD_PPO = ["--prompts_per_step", "128", "--max_prompt_length", "256", "--max_completion_length", "512",
                "--ppo_epochs", "1", "--model_name_or_path", "x"]


def script_args(algo, argv):
    """The training script's Args parsed from argv, checked as the script checks them."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import importlib

    from utils.cli import parse_args

    module = importlib.import_module("train_grpo" if algo == "grpo" else "train_ppo")
    args, explicit = parse_args(module.Args, argv)
    module.check_args(args, 1, explicit)
    return args


def main(argv=None):
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    script_argv = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b", help="a workload shape name, hub id or local folder")
    parser.add_argument("--algo", default="grpo", choices=["grpo", "ppo"])
    parser.add_argument("--gpu_memory", help="e.g. 80GiB; default: the first visible GPU's")
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--gpus_per_process", type=int, help="GPUs each process may place roles on (--ref_device "
                        "cuda:1 ...); default: the visible GPUs / --num_processes, 1 without GPUs")
    parser.add_argument("--measured", action="store_true", help="estimate vs the measured H200 runs, and exit")
    parser.add_argument("--workload", action="store_true", help="use W-GRPO's batch and lengths (workloads.md)")
    opts = parser.parse_args(argv)
    if opts.num_processes < 1 or (opts.gpus_per_process is not None and opts.gpus_per_process < 1):
        parser.error("--num_processes and --gpus_per_process must be at least 1")
    if opts.measured:
        print(f"{'shape':<14}{'estimated GiB':>14}{'measured GiB':>14}{'error':>8}  {'set':<9}flags")
        for rows, kind, algo, workload in ((MEASURED, "fit", "grpo", WORKLOAD_GRPO),
                                           (HELD_OUT, "held out", "grpo", WORKLOAD_GRPO),
                                           (HELD_OUT_PPO, "held out", "ppo", WORKLOAD_PPO)):
            for shape_name, flags, measured in rows:
                est = estimate(load_shape(shape_name), script_args(algo, workload + flags), algo)["peak_reserved"]
                est /= GIB
                print(f"{shape_name:<14}{est:>14.2f}{measured:>14.2f}{(est / measured - 1):>+8.0%}  {kind:<9}"
                      f"{algo.upper()} {' '.join(flags)}")
        return
    base = (WORKLOAD_GRPO if opts.workload else []) + script_argv
    base = base if any(a == "--model_name_or_path" for a in base) else base + ["--model_name_or_path", opts.model]
    args = script_args(opts.algo, base)
    shape = load_shape(opts.model)
    if opts.gpu_memory:
        gpu_bytes = parse_memory(opts.gpu_memory)
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("no GPU visible: give --gpu_memory (e.g. 80GiB)")
        gpu_bytes = torch.cuda.get_device_properties(0).total_memory
    gpus = opts.gpus_per_process if opts.gpus_per_process is not None else owned_gpus(opts.num_processes)
    print(report(shape, estimate(shape, args, opts.algo, opts.num_processes), gpu_bytes))
    added, reasons, final = plan(shape, args, opts.algo, gpu_bytes, opts.num_processes,
                                 parse=lambda extra: apply_flags(args, extra), gpus_per_process=gpus)
    print("\nplan:" if added else "\nplan: fits as it is")
    for line in reasons:
        print("  " + line)
    if added:
        print(f"add: {' '.join(added)}  -> estimated peak reserved {final['peak_reserved'] / GIB:.1f} GiB"
              + "".join(f"; {d}: {u / GIB:.1f} GiB" for d, u in final["other_gpus"].items()))


if __name__ == "__main__":
    main()
