"""Optimizers and learning-rate schedules from flags."""

import torch

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


def build_optimizer(model, learning_rate, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8):
    """AdamW over the trainable parameters (fused kernel on CUDA). No weight decay on biases
    and norm weights (1-D tensors), as in most LLM fine-tuning recipes."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=eps, fused=on_cuda or None)


def build_scheduler(optimizer, name, num_training_steps, warmup_steps):
    """transformers' schedule `name` with linear warmup over `warmup_steps` optimizer steps."""
    from transformers import get_scheduler

    if name == "constant" and warmup_steps > 0:
        name = "constant_with_warmup"
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=num_training_steps)
