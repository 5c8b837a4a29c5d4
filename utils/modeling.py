"""Loading models and tokenizers: hub ids or local folders through `from_pretrained`, or the
embedded tiny model when no path is given."""

import difflib
import importlib.util
import os
from contextlib import contextmanager

import torch

from utils.cli import UsageError
from utils.placement import normalize_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_mixed_precision(name: str) -> str:
    """--mixed_precision auto -> bf16 on a GPU that supports it, else no."""
    if name == "auto":
        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return name


def frozen_dtype(mixed_precision: str, train_dtype):
    """Frozen roles (reference, reward) are not trained: load them in the autocast dtype."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, train_dtype)


def check_attn_implementation(name: str, on_cuda: bool):
    """flash_attention_2 needs the flash-attn package (built against CUDA) and a GPU."""
    if name != "flash_attention_2":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise UsageError(
            "--attn_implementation flash_attention_2: the flash-attn package is not installed "
            "(it only builds with CUDA: pip install flash-attn --no-build-isolation); "
            "use --attn_implementation sdpa (the default, PyTorch's fused attention)"
        )
    if not on_cuda:
        raise UsageError("--attn_implementation flash_attention_2 needs a CUDA GPU; use sdpa on CPU")


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached_repos() -> list:
    from huggingface_hub import constants

    try:
        names = os.listdir(constants.HF_HUB_CACHE)
    except OSError:
        return []
    return sorted(n[len("models--"):].replace("--", "/") for n in names if n.startswith("models--"))


def check_model_path(path, flag, files=("config.json", "adapter_config.json")):
    """A model path must be a folder holding one of `files`, or a hub id that is in the local
    cache or, online, on the hub; else one line naming the flag (before anything loads, and
    without transformers' retries when the hub cannot be reached)."""
    if path is None:
        return
    if os.path.isdir(path):
        if files and not any(os.path.isfile(os.path.join(path, f)) for f in files):
            raise UsageError(f"{flag} {path}: the folder has no {' or '.join(files)} (not a saved model)")
        return
    if os.path.exists(path):
        raise UsageError(f"{flag} {path}: is a file; give a model folder or a hub id (org/name)")
    looks_local = path.startswith((os.sep, ".", "~")) or path.count("/") > 1 or path.endswith("/")
    from huggingface_hub import model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        looks_local = True
    if looks_local:
        raise UsageError(f"{flag} {path}: folder does not exist")
    for name in ("config.json", "tokenizer_config.json", "adapter_config.json"):
        if isinstance(try_to_load_from_cache(path, name), str):
            return  # in the local cache
    close = difflib.get_close_matches(path, _cached_repos(), n=1)
    hint = f" (cached: {close[0]}?)" if close else ""
    if _offline():
        raise UsageError(f"{flag} {path}: no such folder, and not in the offline cache (HF_HUB_OFFLINE=1){hint}")
    try:
        model_info(path, timeout=10)
    except GatedRepoError:
        return  # from_pretrained says what to do (log in, accept the terms)
    except RepositoryNotFoundError:
        raise UsageError(f"{flag} {path}: no such folder, and no such model on the hub (or it is private: "
                         f"`huggingface-cli login`){hint}") from None
    except Exception as e:  # no network, DNS, timeout: from_pretrained would retry for a minute
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"{flag} {path}: no such folder, not in the local cache, and the hub cannot be reached "
                         f"({type(e).__name__}: {reason}){hint}; download it first or set HF_HUB_OFFLINE=1") from None


def check_model_paths(args):
    """Every model and tokenizer path the flags name (check_model_path), before any model loads."""
    check_model_path(args.model_name_or_path, "--model_name_or_path")
    check_model_path(args.tokenizer_name_or_path, "--tokenizer_name_or_path", files=())
    check_model_path(args.reward_model_name_or_path, "--reward_model_name_or_path")
    check_model_path(getattr(args, "critic_model_name_or_path", None), "--critic_model_name_or_path")


def check_same_vocabulary(path, flag, tokenizer, trust_remote_code=False):
    """A model that reads the policy's token ids (the critic) must share its vocabulary."""
    if path is None:
        return
    from transformers import AutoTokenizer

    try:
        other = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return  # no tokenizer in that folder: nothing to compare (the model's config is checked at load)
    if other.get_vocab() != tokenizer.get_vocab():
        raise UsageError(f"{flag} {path}: its tokenizer differs from the policy's; this model reads the policy's "
                         "token ids, so it must share its vocabulary (a reward model with another tokenizer belongs "
                         "in --reward_model_name_or_path)")


def load_tokenizer(model_name_or_path, trust_remote_code=False, tokenizer_name_or_path=None):
    """The model's tokenizer (or --tokenizer_name_or_path, or the toy one), left-padding, with a
    pad token."""
    from transformers import AutoTokenizer

    model_name_or_path = tokenizer_name_or_path or model_name_or_path
    if model_name_or_path is None:
        from utils import toy

        tokenizer = toy.build_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded for generation
    return tokenizer


def quantization_kwargs(quantization, compute_dtype, device, skip_modules=None) -> dict:
    """from_pretrained arguments for --load_in_4bit (quantization '4bit': NF4, double quantisation, computing in
    `compute_dtype`; '4bit_unnested': the blocks' statistics kept in float32, --use_bnb_nested_quant false) or
    --load_in_8bit ('8bit'), loaded straight onto `device` (a bitsandbytes model cannot be moved after loading);
    {} for no quantisation. Non-quantised weights (embeddings, norms, heads) load in `compute_dtype`."""
    if quantization is None:
        return {}
    from transformers import BitsAndBytesConfig

    compute_dtype = torch.bfloat16 if compute_dtype in ("auto", None) else compute_dtype
    if quantization in ("4bit", "4bit_unnested"):
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_use_double_quant=quantization == "4bit",
                                    bnb_4bit_compute_dtype=compute_dtype, llm_int8_skip_modules=skip_modules)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip_modules)
    device = normalize_device(device)  # a bare "cuda" (--actor_device cuda): from_pretrained refuses a None index
    return dict(quantization_config=config, dtype=compute_dtype,
                device_map={"": device.index if device.type == "cuda" else "cpu"})


def quantization_of(args, trained=False):
    """'4bit' / '4bit_unnested' (--use_bnb_nested_quant false) / '8bit' / None for a model: frozen ones always
    follow --load_in_*, trained ones only with --use_lora (QLoRA)."""
    if trained and not args.use_lora:
        return None
    if args.load_in_4bit:
        return "4bit" if args.use_bnb_nested_quant else "4bit_unnested"
    return "8bit" if args.load_in_8bit else None


def is_quantized(model) -> bool:
    inner = getattr(model, "model", model) if not hasattr(model, "is_loaded_in_4bit") else model
    return bool(getattr(inner, "is_loaded_in_4bit", False) or getattr(inner, "is_loaded_in_8bit", False)
                or getattr(inner, "is_quantized", False))


def load_causal_lm(model_name_or_path, tokenizer, dtype, attn_implementation="sdpa", trust_remote_code=False,
                   disable_dropout=True, seed=0, quantization=None, device=None):
    """A causal LM from `from_pretrained` (hub id or local folder), or the toy model for None;
    `quantization` ('4bit', '8bit') loads it quantised onto `device`."""
    from transformers import AutoModelForCausalLM

    if model_name_or_path is None:
        from utils import toy

        model = toy.build_model(tokenizer, seed=seed, attn_implementation=attn_implementation)
        model = model.to(torch.float32 if dtype == "auto" else dtype)
    else:
        kwargs = dict(dtype=dtype) | quantization_kwargs(quantization, dtype, device)
        model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, **kwargs
        )
    if disable_dropout:  # dropout would make the policy ratio noisy (old vs new logprobs)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


class ValueModel(torch.nn.Module):
    """A critic: a sequence-classification model (one label) whose `score` head is applied at
    every position, so forward returns one value per token [B, T]."""

    def __init__(self, model):
        super().__init__()
        self.model = model  # e.g. LlamaForSequenceClassification
        self.config = model.config

    def forward(self, input_ids, attention_mask, position_ids=None):
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # PEFT
        backbone = getattr(inner, inner.base_model_prefix)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return inner.score(hidden).squeeze(-1)

    def gradient_checkpointing_enable(self, **kwargs):
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        inner.gradient_checkpointing_enable(**kwargs)

    @property
    def _no_split_modules(self):  # what a device_map must keep whole (decoder layers)
        return getattr(self.model, "_no_split_modules", None)


def load_value_model(model_name_or_path, tokenizer, dtype, attn_implementation="sdpa", trust_remote_code=False,
                     disable_dropout=True, seed=0, lora=None, quantization=None, device=None):
    """The critic as a ValueModel: from a reward-model checkpoint, or from a causal LM (its
    weights plus a new scalar head); None: the toy actor's weights plus a head."""
    from transformers import AutoModelForSequenceClassification

    if model_name_or_path is None:
        from utils import toy

        model = toy.build_sequence_classifier(tokenizer, seed=seed)
        actor = toy.build_model(tokenizer, seed=seed)  # the same weights as the toy actor
        model.model.load_state_dict(actor.model.state_dict())
        model.config._attn_implementation = attn_implementation
        model = model.to(torch.float32 if dtype == "auto" else dtype)
    else:
        kwargs = dict(dtype=dtype) | quantization_kwargs(quantization, dtype, device, skip_modules=["score"])
        model = AutoModelForSequenceClassification.from_pretrained(
            model_name_or_path, num_labels=1, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code, **kwargs
        )
    if disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if lora:
        model = apply_lora(model, task_type="SEQ_CLS", **lora)
    return ValueModel(model)


def apply_lora(model, r, alpha, dropout, target_modules, task_type="CAUSAL_LM"):
    """Wrap `model` with trainable LoRA adapters (PEFT); its own weights are frozen. For
    SEQ_CLS (the critic) PEFT also trains the value head in full. Under autocast the adapters skip
    PEFT's cast of their input (skip_input_casts_under_autocast)."""
    from peft import LoraConfig, get_peft_model

    targets = target_modules if target_modules == "all-linear" else [t.strip() for t in target_modules.split(",")]
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type)
    model = get_peft_model(model, config)
    skip_input_casts_under_autocast(model)
    return model


def skip_input_casts_under_autocast(model):
    """PEFT keeps the adapters of a bf16 base in float32 and casts each adapted Linear's input to
    float32 before them (a float32 copy of the input, and a cast of its gradient back, in every forward
    and backward); under autocast their matmuls cast it straight back to bf16, so the copy changes no
    number (bf16 -> float32 -> bf16 is exact both ways). While autocast is on, each LoRA layer of
    `model` skips it (PEFT's own `cast_input_dtype_enabled` switch, read when the layer runs); without
    autocast it casts as PEFT does. bitsandbytes' LoRA layers already skip it under autocast. Measured
    on an H200 (2026-12-02, tests/gpu: 6144 tokens, r16, bf16 base under autocast, one Linear's forward +
    backward, with PEFT's cast -> without): 7b's k/v projection 702 -> 646 us, q/o 898 -> 729, gate/up
    3193 -> 2912, down 3859 -> 2834; the 7b LoRA 24GB budget row's update 11.96 -> 10.21 s."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer) and type(module) not in _AUTOCAST_CASTS.values():
            module.__class__ = _autocast_cast_class(type(module))


_AUTOCAST_CASTS = {}


def _autocast_cast_class(cls):
    """`cls` with cast_input_dtype_enabled read as (PEFT's setting) and (autocast off on CUDA and CPU)."""
    if cls not in _AUTOCAST_CASTS:
        def get(self):
            return (self.__dict__.get("cast_input_dtype_enabled", True)
                    and not (torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")))

        def put(self, value):  # PEFT's own setting (peft.helpers.disable_input_dtype_casting writes it)
            self.__dict__["cast_input_dtype_enabled"] = value

        _AUTOCAST_CASTS[cls] = type(cls.__name__, (cls,), {"cast_input_dtype_enabled": property(get, put),
                                                           "__module__": cls.__module__})
    return _AUTOCAST_CASTS[cls]


def lora_kwargs(args):
    """The LoRA settings from the flags, or None without --use_lora."""
    if not args.use_lora:
        return None
    return dict(r=args.lora_r, alpha=args.lora_alpha, dropout=args.lora_dropout, target_modules=args.lora_target_modules)


def is_peft_model(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def eos_token_ids(tokenizer, model) -> list:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def check_replicas_in_sync(accelerator, model):
    """DDP keeps replicas equal; check it once at the end (each rank prints its fingerprint)."""
    if accelerator.num_processes == 1:
        return
    from utils.cli import fail

    fingerprint = param_fingerprint(accelerator.unwrap_model(model))
    print(f"[rank {accelerator.process_index}] final weights fingerprint: {fingerprint}", flush=True)
    everyone = accelerator.gather(torch.tensor([fingerprint], dtype=torch.float64, device=accelerator.device))
    if not torch.all(everyone == everyone[0]):
        fail(f"ranks ended with different weights: {everyone.tolist()}", code=1)


@torch.no_grad()
def param_fingerprint(model) -> tuple:
    """(sum, sum of squares) of every parameter in float64: equal on ranks holding equal weights."""
    total, squares = 0.0, 0.0
    for p in model.parameters():
        p64 = p.detach().double()
        total += p64.sum().item()
        squares += (p64 * p64).sum().item()
    return (total, squares)


def compile_repeated_blocks(model) -> int:
    """--torch_compile: regional compilation, in place. Every block of the model's repeated layer
    list (its decoder layers: a ModuleList of one class) gets torch.compile through Module.compile,
    so one compilation serves all of them and the weights, state_dict keys and optimizer stay as
    they are. Returns how many blocks were compiled.

    Compiled with dynamic shapes from the first call (dynamic=True; parameters keep their static
    shapes): at its default, torch.compile specialises on the first batch and sequence length, then
    compiles again, dynamic, at the first new one (the second step's reference and update, 7-8 s once
    per run at 1.5b and 7b on an H100, 2026-12-07) and once more at a new batch size."""
    from accelerate.utils.other import is_repeated_blocks

    def visit(module):
        if is_repeated_blocks(module) and len(module) > 1:
            for block in module:
                block.compile(dynamic=True)
            return len(module)
        return sum(visit(child) for child in module.children())

    return visit(model)


@contextmanager
def uncompiled_blocks(model):
    """The blocks that compile_repeated_blocks compiled run eagerly inside this context (the
    rollout). Decoding with a KV cache gives each layer its own guards (its cache layer's state):
    the first H200 run with --torch_compile hit torch.compile's recompile limit (8) in its first
    rollout, warning about the cache, and its 1.5b update then took 4.32 s against 3.68 s without
    --torch_compile. The decoding step has its own compilation (--generation_backend compiled)."""
    blocks = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
    compiled = [m._compiled_call_impl for m in blocks]
    for m in blocks:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in zip(blocks, compiled):
            m._compiled_call_impl = impl
