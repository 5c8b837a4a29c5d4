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


def sampling_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
    """What `generate` samples from, as its logits processors do it, in their order: temperature,
    then top-k, then top-p (nucleus: the smallest set of tokens whose probability reaches top_p, at
    least one). logits [B, V] -> float32 logits with the removed tokens at -inf."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1] = False  # keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    return logits


def sample_from(logits, generator=None):
    """One token per row from softmax(logits), by the Gumbel-max trick: argmax(logits + Gumbel
    noise) is distributed as softmax(logits), with no host synchronisation (unlike multinomial's
    checks)."""
    uniform = torch.rand(logits.shape, device=logits.device, generator=generator).clamp_(min=1e-20)
    return (logits - torch.log(-torch.log(uniform))).argmax(dim=-1)


@torch.no_grad()
def static_cache_generate(model, input_ids, attention_mask, max_new_tokens, temperature, top_p, top_k, eos_token_ids,
                          pad_token_id, compile_step=False, greedy=False, check_every=16):
    """--generation_backend static / compiled: the same sampling as `generate` (sampling_logits)
    from a static KV cache, so every decoding step has the same shapes: with compile_step the
    step is compiled once (torch.compile, CUDA graphs) and replayed. No host synchronisation per
    token: whether every row has finished is asked every `check_every` steps. Returns the new
    tokens [B, N] (pad after a row's first EOS), N <= max_new_tokens."""
    from transformers import StaticCache

    B, P = input_ids.shape
    device = input_ids.device
    cache = StaticCache(config=model.config, max_cache_len=P + max_new_tokens)
    _store_keys_as_values(cache)  # autocast may start only inside the forward (accelerate wraps it)
    mask = torch.cat([attention_mask, attention_mask.new_zeros(B, max_new_tokens)], dim=1)  # [B, P + N]
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding
    eos = torch.tensor(eos_token_ids, device=device)

    def pick(logits):
        return logits.argmax(dim=-1) if greedy else sample_from(sampling_logits(logits, temperature, top_k, top_p))

    def decode_step(token, position, cache_position, mask):
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache,
                       cache_position=cache_position, use_cache=True, logits_to_keep=1).logits[:, -1]
        return pick(logits)

    step = decode_step
    if compile_step:
        compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=False)

        def step(*inputs):  # the CUDA graph's outputs are overwritten by its next replay: copy the token out
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*inputs).clone()
    # prefill: only the last position goes through the LM head ([B, 1, V], not [B, P, V] logits)
    logits = model(input_ids=input_ids, attention_mask=mask[:, :P], position_ids=positions, past_key_values=cache,
                   cache_position=torch.arange(P, device=device), use_cache=True, logits_to_keep=1).logits[:, -1]
    token = pick(logits)
    cache_positions = torch.arange(P, P + max_new_tokens, device=device)  # sliced per step: no host-to-device copy
    position = positions[:, -1:] + 1
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens = []
    for t in range(max_new_tokens):
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        finished = finished | torch.isin(token, eos)
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):
            break
        mask[:, P + t] = 1
        token = step(token, position, cache_positions[t:t + 1], mask)
        position = position + 1
    return torch.stack(tokens, dim=1)


def _store_keys_as_values(cache):
    """Under autocast (--mixed_precision bf16 over float32 weights), RoPE leaves the keys in float32
    and the values in bf16; transformers 5.17's StaticCache sizes both buffers by the keys' dtype and
    then cannot store the values. Attention casts both to bf16 under autocast anyway, so the keys
    are stored in the values' dtype: the same numbers as `generate`'s cache, half its key bytes.
    Without autocast both have one dtype and nothing changes."""
    for layer in cache.layers:
        def update(key_states, value_states, *args, _update=layer.update, **kwargs):
            return _update(key_states.to(value_states.dtype), value_states, *args, **kwargs)
        layer.update = update


@torch.no_grad()
def generate_completions(model, prompt_ids, prompt_mask, generation_config, eos_token_ids, batch_size=None,
                         backend="hf"):
    """Sample one completion per row of `prompt_ids` [B, P] (left-padded), `batch_size` rows at
    a time (--generation_batch_size: a smaller KV cache; default all at once), with `generate`
    (backend hf) or static_cache_generate (static; compiled: its decoding step compiled).

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
                ids, mask = prompt_ids[rows].to(device), prompt_mask[rows].to(device)
                if backend == "hf":
                    new = model.generate(input_ids=ids, attention_mask=mask,
                                         generation_config=generation_config)[:, ids.shape[1]:]
                else:
                    if backend == "compiled" and device.type != "cuda":
                        import warnings

                        warnings.warn("--generation_backend compiled needs a GPU (CUDA graphs); using static")
                    gc = generation_config
                    new = static_cache_generate(model, ids, mask, gc.max_new_tokens, gc.temperature, gc.top_p or 1.0,
                                                gc.top_k or 0, eos_token_ids, gc.pad_token_id,
                                                compile_step=backend == "compiled" and device.type == "cuda")
                slices.append(new.to(prompt_ids.device))
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
