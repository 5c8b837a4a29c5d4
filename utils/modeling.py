"""Loading models and tokenizers: hub ids or local folders through `from_pretrained`, or the
embedded tiny model when no path is given."""

import importlib.util

import torch

from utils.cli import UsageError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_tokenizer(model_name_or_path, trust_remote_code=False):
    """The model's tokenizer (or the toy one), left-padding, with a pad token."""
    from transformers import AutoTokenizer

    if model_name_or_path is None:
        from utils import toy

        tokenizer = toy.build_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # prompts are left-padded for generation
    return tokenizer


def load_causal_lm(model_name_or_path, tokenizer, dtype, attn_implementation="sdpa", trust_remote_code=False,
                   disable_dropout=True, seed=0):
    """A causal LM from `from_pretrained` (hub id or local folder), or the toy model for None."""
    from transformers import AutoModelForCausalLM

    if model_name_or_path is None:
        from utils import toy

        model = toy.build_model(tokenizer, seed=seed, attn_implementation=attn_implementation)
        model = model.to(torch.float32 if dtype == "auto" else dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_name_or_path, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    if disable_dropout:  # dropout would make the policy ratio noisy (old vs new logprobs)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def eos_token_ids(tokenizer, model) -> list:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


@torch.no_grad()
def param_fingerprint(model) -> tuple:
    """(sum, sum of squares) of every parameter in float64: equal on ranks holding equal weights."""
    total, squares = 0.0, 0.0
    for p in model.parameters():
        p64 = p.detach().double()
        total += p64.sum().item()
        squares += (p64 * p64).sum().item()
    return (total, squares)
