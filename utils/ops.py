"""Tensor operations both scripts share: per-token logprobs and entropy of completions, and
masked reductions. Stateless."""

import torch

from utils.placement import model_input_device


def selective_log_softmax(logits, index):
    """log_softmax(logits)[..., index] without materialising the full log-softmax.

    logits: [B, T, V] (any float dtype; computed in fp32), index: [B, T] -> [B, T] fp32."""
    logits = logits.float()
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits):
    """Entropy of softmax(logits) along the last axis, in fp32: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0,
                        with_entropy=False):
    """Logprobs of the last `num_completion_tokens` tokens of `input_ids` under `model`.

    input_ids, attention_mask: [B, P + C] (prompts left-padded, completions right-padded).
    Logits are divided by the sampling temperature, so the logprobs are those of the
    distribution the completions were sampled from. Only the C + 1 last positions' logits are
    computed (`logits_to_keep`). Returns logprobs [B, C] and, if asked, entropy [B, C] (no grad),
    on the device `input_ids` came from, wherever the model is placed.
    """
    home = input_ids.device
    device = model_input_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers them
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_completion_tokens + 1,
        use_cache=False,
    ).logits
    logits = logits[:, -(num_completion_tokens + 1) : -1, :]  # position t predicts token t + 1
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = selective_log_softmax(logits, input_ids[:, -num_completion_tokens:].to(logits.device))
    if not with_entropy:
        return logprobs.to(home), None
    with torch.no_grad():
        entropy = entropy_from_logits(logits)
    return logprobs.to(home), entropy.to(home)


def completion_values(value_model, input_ids, attention_mask, num_completion_tokens):
    """Critic values V(s_t) for the last `num_completion_tokens` tokens: the value head on the
    hidden state of the position before each token (aligned with completion_logprobs).

    value_model: utils.modeling.ValueModel (possibly DDP-wrapped). Returns [B, C] float32 on the
    device `input_ids` came from."""
    home = input_ids.device
    device = model_input_device(value_model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    values = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return values[:, -(num_completion_tokens + 1) : -1].float().to(home)


@torch.no_grad()
def batched_completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature, batch_size):
    """completion_logprobs without gradients, `batch_size` rows at a time -> [B, C]."""
    chunks = []
    for start in range(0, input_ids.shape[0], batch_size):
        rows = slice(start, start + batch_size)
        chunks.append(completion_logprobs(model, input_ids[rows], attention_mask[rows], num_completion_tokens,
                                          temperature)[0])
    return torch.cat(chunks)


def masked_sum(values, mask, dim=None):
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values, mask, dim=None):
    """Mean of `values` where `mask` is 1 (over everything, or along `dim`); 0 where mask is empty."""
    return masked_sum(values, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def masked_whiten(values, mask, shift_mean=True, all_reduce=None):
    """(x - mean) / std over the entries where mask is 1 (std with Bessel's correction); with
    shift_mean=False the mean is added back. `all_reduce(tensor) -> tensor` sums statistics over
    processes so every rank whitens with the same, global, mean and std."""
    reduce = all_reduce or (lambda t: t)
    stats = reduce(torch.stack([masked_sum(values, mask), mask.sum()]).float())
    mean, count = stats[0] / stats[1], stats[1]
    centered_sq = reduce(masked_sum((values - mean) ** 2, mask).float().reshape(1))[0]
    var = centered_sq / (count - 1).clamp(min=1)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
