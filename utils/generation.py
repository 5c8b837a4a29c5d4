"""Sampling completions with `generate` and marking where each one ends."""

import torch

from utils.memory import fake_oom_check
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
def generate_completions(model, prompt_ids, prompt_mask, generation_config, eos_token_ids, batch_size=None):
    """Sample one completion per row of `prompt_ids` [B, P] (left-padded), `batch_size` rows at
    a time (--generation_batch_size: a smaller KV cache; default all at once).

    Returns completion_ids [B, C] (right-padded with the pad id after the first EOS),
    completion_mask [B, C] (1 up to and including the first EOS) and is_truncated [B]
    (no EOS within max_new_tokens), all on the device of `prompt_ids`."""
    from utils.offload import resident

    device = model_input_device(model)
    pad = generation_config.pad_token_id
    batch_size = batch_size or prompt_ids.shape[0]
    was_training = model.training
    # eval: no dropout. But bitsandbytes repacks 4-bit weights for CPU inference on eval(), and
    # the repacked path has no backward (QLoRA on CPU would then train on cut gradients), so a
    # 4-bit model on the CPU generates in train mode (no_grad keeps the KV cache on either way).
    if not (getattr(model, "is_loaded_in_4bit", False) and device.type == "cpu"):
        model.eval()
    slices = []
    try:
        with resident(model):  # --param_offload: one GPU copy of the offloaded weights for the whole phase
            for start in range(0, prompt_ids.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                fake_oom_check(prompt_ids[rows].shape[0])
                sequences = model.generate(input_ids=prompt_ids[rows].to(device),
                                           attention_mask=prompt_mask[rows].to(device),
                                           generation_config=generation_config)
                slices.append(sequences[:, prompt_ids.shape[1]:].to(prompt_ids.device))
    finally:
        model.train(was_training)
    width = max(s.shape[1] for s in slices)  # slices stop when their own rows finish
    completion_ids = torch.cat([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=pad) for s in slices])
    return completion_ids_and_mask(completion_ids, eos_token_ids, pad)


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
