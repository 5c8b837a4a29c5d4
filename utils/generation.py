"""Sampling completions with `generate` and marking where each one ends."""

import torch

from utils.placement import model_input_device


def build_generation_config(max_new_tokens, temperature, top_p, top_k, pad_token_id, eos_token_ids):
    """A fresh sampling config: nothing inherited from the model's own generation_config
    (repetition penalties, forced tokens...) changes the distribution the loss assumes."""
    from transformers import GenerationConfig

    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k > 0 else None,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids,
        use_cache=True,
    )


@torch.no_grad()
def generate_completions(model, prompt_ids, prompt_mask, generation_config, eos_token_ids):
    """Sample one completion per row of `prompt_ids` [B, P] (left-padded).

    Returns completion_ids [B, C] (right-padded with the pad id after the first EOS),
    completion_mask [B, C] (1 up to and including the first EOS) and is_truncated [B]
    (no EOS within max_new_tokens), all on the device of `prompt_ids`."""
    device = model_input_device(model)
    was_training = model.training
    model.eval()  # KV cache on, and no gradient-checkpointing warnings
    try:
        sequences = model.generate(input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                                   generation_config=generation_config)
    finally:
        model.train(was_training)
    completion_ids = sequences[:, prompt_ids.shape[1] :].to(prompt_ids.device)
    return completion_ids_and_mask(completion_ids, eos_token_ids, generation_config.pad_token_id)


def completion_ids_and_mask(completion_ids, eos_token_ids, pad_token_id):
    """Mask each row up to and including its first EOS; pad what follows."""
    length = completion_ids.shape[1]
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device)
    completion_mask = (positions[None, :] <= first_eos[:, None]).long()  # [B, C]
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_token_id)
    return completion_ids, completion_mask, ~has_eos
