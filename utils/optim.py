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


def clip_and_step(accelerator, model, optimizer, scheduler, max_grad_norm, loss):
    """Clip the gradient norm, then step, unless the loss or the norm is not finite (then the
    gradients are dropped). `loss` is this process's summed loss for the step (a tensor).
    Returns (grad_norm tensor, stepped)."""
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
    loss = accelerator.reduce(loss.detach().clone(), reduction="sum")
    finite = bool(torch.isfinite(grad_norm) and torch.isfinite(loss))
    # fp16: the grad scaler skips overflowing steps itself, so it must see every step
    if finite or accelerator.scaler is not None:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.detach().float(), finite


class NonFiniteGuard:
    """Counts updates skipped for a non-finite loss or gradient norm; aborts (exit 1, with the
    last checkpoint left as it is) after `max_in_a_row` consecutive ones."""

    def __init__(self, max_in_a_row, total=0):
        self.max_in_a_row, self.in_a_row, self.total = max_in_a_row, 0, total

    def record(self, finite, step, what="update"):
        import warnings

        if finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        warnings.warn(f"step {step}: non-finite loss or gradient norm; {what} skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.max_in_a_row:
            from utils.cli import fail

            fail(f"aborting at step {step}: {self.in_a_row} consecutive updates had a non-finite loss or gradient "
                 "norm. Check the rewards for inf/nan, lower --learning_rate, or raise --max_skipped_steps. "
                 "The last checkpoint is untouched.", code=1)
