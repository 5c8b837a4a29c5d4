"""Names and arithmetic that the runtime modules and the planner (utils/plan.py) both need: the
generation backends, the static KV cache's length, GPU memory sizes and card budgets, which GPUs a
process owns, the optimizer step's slice. It imports nothing of this project, so the planner can read flags and shapes without
loading any runtime code."""

import re

GIB = 1024**3

GENERATION_BACKENDS = ("auto", "hf", "static", "cudagraph", "compiled")  # --generation_backend's choices
CAPTURED_BACKENDS = ("cudagraph", "compiled")  # --generation_backend values that replay a CUDA graph


# the --prefill_chunk_size the planner tries and --auto_reduce_micro_batch sets before halving rollout slices
PREFILL_CHUNK = 64


def defined_once(ready, define):
    """Whether a Triton kernel module's `define()` (its kernel and torch op) ran without an ImportError (no
    Triton here): run at the first call only, the answer kept in the module's list `ready`."""
    if not ready:
        try:
            define()
            ready.append(True)
        except ImportError:
            ready.append(False)
    return ready[0]


def static_cache_len(prompt_len, max_new_tokens, multiple=128) -> int:
    """The static KV cache's length: prompt + new tokens rounded up to `multiple`, so that prompts of
    nearby lengths share one cache shape (and one captured graph)."""
    return -(-(prompt_len + max_new_tokens) // multiple) * multiple


# rows per forward of a reward model (utils/rewards.py RewardModel, whatever the training micro-batch)
REWARD_BATCH_ROWS = 16


# torchao's optimizers step a parameter above this many elements one slice at a time (utils/optim.py), so
# the step's temporaries (24 bytes an element measured alone; the planner counts 16, fitted with what else is
# live then) are bounded by the slice
STEP_SLICE = 1 << 26


# Cards as sold (GB = 1e9 bytes) -> what one process's caching allocator can use on them (GiB): the
# card's memory less the CUDA context, cuBLAS workspaces and graphs (0.7-1.5 GiB, measured on H200s
# and read off these cards' totals). `--gpu_memory 24GB` plans for, and caps the allocator at, 21 GiB.
CARD_BUDGETS_GIB = {12: 10.5, 16: 14.0, 24: 21.0, 32: 28.5, 40: 36.0, 48: 43.0, 80: 73.0, 94: 86.0, 141: 131.0}
CARD_OVERHEAD_GIB = 1.5  # a card size not in the table: its GiB less this


def parse_memory(text: str) -> int:
    """An allocator budget in bytes from `--gpu_memory`: a card size as sold (`24GB`: a 24 GB card, of
    which the allocator gets CARD_BUDGETS_GIB[24] = 21 GiB), or the budget itself in GiB (`21GiB`, or a
    bare `21`). Raises ValueError with the flag's message."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GiB|GB|G)?\s*", str(text), flags=re.I)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--gpu_memory {text!r}: expected a card size as sold such as 24GB or 80GB, or an allocator "
                         "budget such as 21GiB")
    value, unit = float(match.group(1)), (match.group(2) or "GiB").lower()
    if unit == "gb":
        usable = CARD_BUDGETS_GIB.get(value if value != int(value) else int(value))
        if usable is None:
            usable = value * 1e9 / GIB - CARD_OVERHEAD_GIB
            if usable <= 0:
                raise ValueError(f"--gpu_memory {text!r}: a card this small leaves nothing after the CUDA context "
                                 f"(~{CARD_OVERHEAD_GIB} GiB)")
        return int(usable * GIB)
    return int(value * GIB)


def describe_memory(text: str) -> str:
    """`24GB` -> '21.0 GiB (a 24 GB card)'; `21GiB` -> '21.0 GiB'."""
    budget = parse_memory(text) / GIB
    return f"{budget:.1f} GiB" + (f" (a {text.strip()[:-2].strip()} GB card)" if text.strip().lower().endswith("gb")
                                  else "")


def own_gpus(local_rank: int, local_processes: int, num_gpus: int) -> list:
    """Physical GPU ids that a process owns (utils/placement.py's docstring): with at least as many
    processes as GPUs, GPU rank % count; else every local_processes-th GPU from its rank."""
    if num_gpus == 0:
        return []
    if local_processes >= num_gpus:
        return [local_rank % num_gpus]
    return list(range(local_rank, num_gpus, local_processes))


COMPILE_MIN_PARAMS = 100_000_000  # --generation_backend auto compiles the decoding step from this size up


def resolve_generation_backend(requested, device_type, actor_kind="device", engine="single", param_offload=False,
                               generation_copy=False, num_params=None, kv_cache_dtype="auto",
                               share_prompt_cache=False):
    """--generation_backend auto -> (backend, why): the captured decoding step wherever the policy's
    weights stay at fixed addresses on one CUDA device (compiled from COMPILE_MIN_PARAMS parameters up,
    since compiling takes about a minute; cudagraph, the same step uncompiled, below), `static` on a GPU
    where they move, `hf` (transformers' generate) elsewhere, or `static` there too with --kv_cache_dtype
    fp8 (this project's cache holds the fp8 codes) or --share_prompt_cache (one copy of each prompt's keys and
    values). Any other value is returned as is."""
    if requested != "auto":
        return requested, None
    fp8 = (" (static, not hf: --kv_cache_dtype fp8 needs this project's static cache)" if kv_cache_dtype == "fp8" else
           " (static, not hf: --share_prompt_cache needs this project's static cache)" if share_prompt_cache else "")
    if device_type != "cuda":
        return ("static" if fp8 else "hf"), f"the policy is on {device_type}, not a CUDA GPU (captured steps need CUDA graphs){fp8}"
    if engine in ("zero3", "fsdp2"):
        return ("static" if fp8 else "hf"), f"under {engine} the policy's weights are gathered anew for each rollout{fp8}"
    if actor_kind == "balanced":
        return "static", "the policy's layers live on several GPUs (a captured step reads fixed addresses)"
    if param_offload and not generation_copy:
        return "static", "--param_offload copies weights to the GPU anew at each use (add --generation_copy to capture)"
    if num_params is not None and num_params < COMPILE_MIN_PARAMS:
        return "cudagraph", (f"the policy's weights stay on the GPU; {num_params / 1e6:.0f}M parameters is too small "
                             "for compiling the step (about a minute) to pay off")
    return "compiled", "the policy's weights stay on the GPU: its decoding step compiled and captured"


def unshareable_attention(config):
    """Why the shared prompt's decoding step cannot read the attention of the model `config` describes (a config
    object or a config.json's dict; None: no config): sliding windows (`layer_types` naming sliding_attention, or
    `sliding_window` set where `use_sliding_window` is not false) or softcapped logits; None where it can."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    if "sliding_attention" in (get("layer_types") or []) or (
            get("use_sliding_window", True) and get("sliding_window") is not None):
        return "the model has sliding-window attention"
    return "the model softcaps its attention" if get("attn_logit_softcapping") else None


def resolve_share_prompt_cache(requested, backend, device_type, group, kv_cache_dtype="auto", actor_kind="device",
                               attn_implementation="sdpa", unshareable=None, attention_interface=True):
    """--share_prompt_cache unset (None) -> (on, why): on where rows share a prompt (GRPO's groups of `group` =
    --num_generations > 1) and the decoding step is captured (`backend` resolved: cudagraph or compiled) on one CUDA
    GPU (each process's), with keys and values in bf16 (not --kv_cache_dtype fp8) and an attention the shared step
    reads: transformers' sdpa or eager called through its attention interface (`attention_interface`: the model
    class's _supports_attention_backend; remote code that computes attention itself would never see the shared
    prompt), no sliding window and no softcapping (`unshareable`: unshareable_attention of the model's config, as
    the scripts read it and the planner's Shape keeps it). The static step (sharing there not measured on a GPU; the
    CPU's) keeps it off unless asked for. Same tokens and logprobs up to float rounding; a smaller cache and prefill.
    A set true/false is returned as is, why None."""
    if requested is not None:
        return requested, None
    off = ("each prompt has one completion" if group <= 1 else
           f"the {backend} backend's decoding step is not captured" if backend not in CAPTURED_BACKENDS
           or device_type != "cuda" else
           "--kv_cache_dtype fp8" if kv_cache_dtype == "fp8" else
           "the policy's layers live on several GPUs" if actor_kind == "balanced" else
           f"the model's {attn_implementation} attention" if attn_implementation not in ("sdpa", "eager") else
           "the model computes its attention outside transformers' attention interface" if not attention_interface
           else unshareable)
    if off:
        return False, off
    return True, (f"each of the {group} completions of a prompt reads one copy of its keys and values (a smaller "
                  "cache, one prefill per prompt)")
