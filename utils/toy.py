"""The embedded default: a tiny model and a tokenizer built in code, and a toy task with a
verifiable reward, so that the scripts run offline on a CPU in minutes.

- Tokenizer: one token per printable ASCII character (plus `####`, the GSM8K answer marker),
  with <pad>, <eos> and <unk>. Any text round-trips, so user datasets also work with it.
- Model: a Llama-architecture decoder of about 0.1M parameters with random weights, seeded.
  (Llama rather than Qwen2: transformers maps a saved Qwen2 folder to Qwen2Tokenizer, which
  drops the spaces of this character tokenizer.)
- Task: prompts `3+4=`, answers `7` (both operands 0..4). The built-in `accuracy` reward grades
  it exactly as it grades GSM8K: the last number in the completion must equal the answer.
"""

import random
import string

TOY_OPERAND_MAX = 4
_SPECIALS = ["<pad>", "<eos>", "<unk>"]


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline
    vocab = {token: i for i, token in enumerate(_SPECIALS + chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one char each
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", model_max_length=256
    )
    tokenizer.add_tokens(["####"])
    return tokenizer


def _config(tokenizer, hidden_size, num_layers, **extra):
    """A tiny Llama config whose vocabulary is exactly the tokenizer's (so every sampled id decodes)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=tokenizer.model_max_length,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def _seeded(build, seed):
    """build() with a fixed seed: the same weights on every rank, the global RNG untouched. Built
    whole even under DeepSpeed ZeRO-3, where transformers would partition sub-models at
    construction (and skip their random init), so the toy models are the same under every engine;
    DeepSpeed shards them when the script prepares them."""
    import torch
    from transformers.integrations import deepspeed as hf_deepspeed

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    saved, hf_deepspeed._hf_deepspeed_config_weak_ref = hf_deepspeed._hf_deepspeed_config_weak_ref, None
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            return build()
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2, attn_implementation="sdpa"):
    """The tiny causal LM (the policy)."""
    from transformers import LlamaForCausalLM

    config = _config(tokenizer, hidden_size, num_layers, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                     tie_word_embeddings=True)
    config._attn_implementation = attn_implementation
    model = _seeded(lambda: LlamaForCausalLM(config), seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_sequence_classifier(tokenizer, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A tiny reward model / critic body (sequence classification, one label)."""
    from transformers import LlamaForSequenceClassification

    config = _config(tokenizer, hidden_size, num_layers, num_labels=1)
    return _seeded(lambda: LlamaForSequenceClassification(config), seed)


def build_dataset(num_prompts: int = 2000, seed: int = 0):
    """`prompt`/`answer` rows such as {"prompt": "3+4=", "answer": "7"}."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for _ in range(num_prompts):
        a, b = rng.randint(0, TOY_OPERAND_MAX), rng.randint(0, TOY_OPERAND_MAX)
        rows["prompt"].append(f"{a}+{b}=")
        rows["answer"].append(str(a + b))
    return Dataset.from_dict(rows)
