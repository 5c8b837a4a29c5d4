"""Optimizers and learning-rate schedules from flags."""

import torch

from utils.base import STEP_SLICE

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


OPTIMIZERS = ("adamw_torch", "adamw_8bit", "paged_adamw_8bit", "adamw_4bit")


def build_optimizer(model, learning_rate, weight_decay=0.0, optim="adamw_torch", betas=(0.9, 0.999), eps=1e-8,
                    engine_master_weights=False):
    """AdamW over the trainable parameters, with the state precision of --optim. No weight decay
    on biases and norm weights (1-D tensors), as in most LLM fine-tuning recipes.

    adamw_torch: torch's AdamW (fused kernel when every parameter is on a GPU); adamw_8bit /
    paged_adamw_8bit: bitsandbytes, 8-bit block-quantised moments; adamw_4bit: torchao, 4-bit.
    bf16 weights: an AdamW update of lr 1e-6 on a weight of 0.02 is below bf16's resolution and a
    plain bf16 step rounds it away, so bf16 parameters step through torchao's AdamW variants
    with stochastic rounding (unbiased: the expected weight moves as an fp32 one would).
    engine_master_weights: DeepSpeed keeps fp32 master weights and hands them to this optimizer,
    so it is torch's AdamW whatever the model's dtype."""
    kwargs = dict(lr=learning_rate, betas=betas, eps=eps)
    offload = getattr(model, "lean_rl_param_offload", None)  # --param_offload: those weights step on the CPU
    host = {id(p): p for _, m in (offload.modules if offload else []) for p in m.parameters(recurse=False)
            if p.requires_grad and not engine_master_weights}
    groups = _decay_groups([p for p in model.parameters() if p.requires_grad and id(p) not in host], weight_decay)
    if host:
        inner = _build(groups, optim, kwargs, engine_master_weights) if groups else None
        return HostStepped(inner, list(host.values()), weight_decay, **kwargs)
    return _build(groups, optim, kwargs, engine_master_weights)


def _decay_groups(params, weight_decay):
    """Parameter groups: weight decay on matrices, none on biases and norm weights (1-D); empty groups left out."""
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _build(groups, optim, kwargs, engine_master_weights):
    params = [p for g in groups for p in g["params"]]
    if engine_master_weights:  # DeepSpeed steps its own fp32 copy of the weights: a plain AdamW over it
        return torch.optim.AdamW(groups, **kwargs)
    if any(p.dtype == torch.bfloat16 for p in params):
        if optim == "paged_adamw_8bit":
            from utils.cli import UsageError

            raise UsageError("--optim paged_adamw_8bit with bf16 weights: bitsandbytes has no stochastic rounding, so "
                             "updates below bf16's resolution would be lost; use --optim adamw_8bit (torchao, "
                             "stochastic rounding) or --torch_dtype float32")
        import torchao.optim

        cls = {"adamw_torch": torchao.optim._AdamW, "adamw_8bit": torchao.optim.AdamW8bit,
               "adamw_4bit": torchao.optim.AdamW4bit}[optim]
        return sliced_step(cls)(groups, **kwargs, bf16_stochastic_round=True)
    if optim == "adamw_torch":
        on_cuda = all(p.is_cuda for p in params)
        return torch.optim.AdamW(groups, **kwargs, fused=on_cuda or None)
    if optim in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if optim == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return cls(groups, **kwargs)
    if optim == "adamw_4bit":
        import torchao.optim

        return sliced_step(torchao.optim.AdamW4bit)(groups, **kwargs)
    raise ValueError(f"unknown optimizer {optim}; expected one of {OPTIMIZERS}")


class HostStepped(torch.optim.Optimizer):
    """--param_offload: the trained weights kept in CPU memory (utils/offload.py ParamOffload) step on the CPU through
    torch's fused CPU AdamW, with float32 moments and, for bf16 weights, a float32 master copy in host memory, which
    the bf16 weight takes rounded to nearest after each step (ZeRO-Offload's CPU Adam does the same); every other
    weight steps through `inner`, the --optim's optimizer. torchao's compiled 8-bit step ran ~70x slower per
    parameter on a CPU (41 ns against 0.6, 2 cores) and held a 7b update 6 s over its estimate. The math of those
    weights is AdamW's in float32 whatever --optim says: the same as adamw_torch's for float32 weights, more
    precise than quantised moments or stochastic rounding. param_groups are `inner`'s then the host's (one
    schedule sets both); `state` is `inner`'s (what --optimizer_offload moves); state_dict holds both and the
    master copies, so a resume is exact."""

    def __init__(self, inner, host_params, weight_decay, lr, betas, eps):
        self.inner, self.host_params = inner, host_params
        # float32 weights step in place; bf16 ones through a float32 master copy
        self.masters = [p if p.dtype == torch.float32 else p.detach().float() for p in host_params]
        self.host = torch.optim.AdamW(_decay_groups(self.masters, weight_decay), lr=lr, betas=betas, eps=eps,
                                      fused=True)
        super().__init__(self.masters, dict(lr=lr))  # Optimizer's hooks and bookkeeping; groups replaced below
        self._link()
        self.defaults = inner.defaults if inner else self.host.defaults

    def _link(self):
        """param_groups: the inner optimizer's, then the host's (the same dicts: one schedule sets both); state: the
        inner's. Again after a load, which makes new groups and a new state dict in both."""
        self.param_groups = (self.inner.param_groups if self.inner else []) + self.host.param_groups
        self.state = self.inner.state if self.inner else {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure) if self.inner else (closure() if closure else None)
        for param, master in zip(self.host_params, self.masters):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        self.host.step()
        for param, master in zip(self.host_params, self.masters):
            if master is not param:
                param.copy_(master)  # rounded to nearest
                master.grad = None
        return loss

    def zero_grad(self, set_to_none=True):
        if self.inner:
            self.inner.zero_grad(set_to_none)
        for param in self.host_params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    def state_dict(self):
        return {"inner": self.inner.state_dict() if self.inner else None, "host": self.host.state_dict(),
                "masters": [m for m, p in zip(self.masters, self.host_params) if m is not p]}

    def load_state_dict(self, state_dict):
        if "host" not in state_dict:
            from utils.cli import UsageError

            raise UsageError("the checkpoint's optimizer state was saved before --param_offload stepped its weights "
                             "on the CPU (HostStepped), so this version cannot resume it exactly; start a new run")
        if self.inner:
            self.inner.load_state_dict(state_dict["inner"])
        self.host.load_state_dict(state_dict["host"])
        saved = iter(state_dict["masters"])
        for master, param in zip(self.masters, self.host_params):
            if master is not param:
                master.copy_(next(saved))
        self._link()


# torchao steps each parameter in one compiled call whose temporaries (the float32 moments and weight, the int64
# codes while re-quantising the moments) come to about 24 bytes per element (H200): 12 GiB at once for a 7b
# embedding, more than its 4-bit moments. Parameters above STEP_SLICE (utils/base.py, 2**26) elements are stepped
# one slice at a time (a multiple of every block size, so each quantisation block lies in one slice): the same
# arithmetic element for element, the temporaries bounded by the slice (1.5 GiB), as a 7b MLP matrix's are.


def _state_slice(state, start, stop):
    """Elements [start, stop) of a flattened optimizer state: a view (writes reach the state)."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    if isinstance(state, OptimState4bit):  # two 4-bit codes per byte, one scale per block
        bs = state.block_size
        return OptimState4bit(state.codes[start // 2:stop // 2], state.scale[start // bs:stop // bs], state.qmap,
                              state.signed, (stop - start,), dtype=state.dtype)
    if isinstance(state, OptimState8bit):
        codes, bs = state.codes.view(-1), state.block_size
        return OptimState8bit(codes[start:stop], state.scale[start // bs:stop // bs], state.qmap, state.signed,
                              dtype=state.dtype)
    return state.view(-1)[start:stop]


def sliced_step(cls):
    """torchao's AdamW class `cls` with a step that takes parameters above STEP_SLICE elements one slice at a time
    (torchao's own per-parameter update, torchao.optim.adam.single_param_adam, on each slice)."""
    import torchao.optim.adam as adam
    from torch.distributed.tensor import DTensor

    class Sliced(cls):
        @torch.no_grad()
        def step(self, closure=None):
            step_slice = STEP_SLICE
            large = [p for g in self.param_groups for p in g["params"] if p.grad is not None
                     and p.numel() > step_slice and not isinstance(p, DTensor) and p.is_contiguous()]
            if not large:
                return super().step(closure)
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            grads = {p: p.grad for p in large}
            for p in large:  # torchao's step skips them; its state is made here
                p.grad = None
            super().step()
            compiled = torch.compile(adam.single_param_adam, fullgraph=True, dynamic=False)
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    for p in group["params"]:
                        if p not in grads:
                            continue
                        p.grad, state = grads[p], self.state[p]
                        if len(state) == 0:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                            if group["amsgrad"]:
                                state["max_exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1
                        flat_p, flat_grad = p.detach().view(-1), p.grad.reshape(-1)  # the weight's view: written in place
                        for start in range(0, p.numel(), step_slice):
                            stop = min(start + step_slice, p.numel())
                            moments = [None if state.get(k) is None else _state_slice(state[k], start, stop)
                                       for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
                            compiled(flat_p[start:stop], flat_grad[start:stop], state["step"], *moments,
                                     group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"],
                                     group["eps"], self.is_adamw, self.bf16_stochastic_round and p.dtype is torch.bfloat16)
            return loss

    Sliced.__name__ = Sliced.__qualname__ = cls.__name__  # checkpoints and messages name torchao's class
    return Sliced


def state_tensors(optimizer):
    """The tensors that hold the optimizer's state (moments, step counts, quantisation scales);
    for torchao's quantised state subclasses, their real buffers."""
    for state in optimizer.state.values():
        for value in state.values():
            if hasattr(value, "__tensor_flatten__"):
                yield from (getattr(value, name) for name in value.__tensor_flatten__()[0])
            elif isinstance(value, torch.Tensor):
                yield value


def optimizer_state_bytes(optimizer) -> int:
    """Bytes held by the optimizer's state tensors."""
    return sum(t.numel() * t.element_size() for t in state_tensors(optimizer))


def build_scheduler(optimizer, name, num_training_steps, warmup_steps):
    """The learning-rate schedule `name` (SCHEDULERS) as transformers' get_scheduler computes it: a linear warmup over
    `warmup_steps` optimizer steps, then constant, linear decay to 0 at `num_training_steps`, or a half cosine to 0.
    Written here as torch's LambdaLR because importing transformers' schedules imports its trainer's dependencies
    (peft, bitsandbytes: over a second at every start); tests/test_optim.py checks it against get_scheduler."""
    import math

    decay = max(1, num_training_steps - warmup_steps)

    def factor(step):
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        if name in ("constant", "constant_with_warmup"):
            return 1.0
        if name == "linear":
            return max(0.0, (num_training_steps - step) / decay)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / decay)))  # cosine, half a cycle

    if name not in SCHEDULERS:
        raise ValueError(f"unknown schedule {name}; expected one of {SCHEDULERS}")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_and_step(accelerator, model, optimizer, scheduler, max_grad_norm, loss):
    """Clip the gradient norm, then step, unless the loss or the norm is not finite (then the
    gradients are dropped). `loss` is this process's summed loss for the step (a tensor).
    Returns (grad_norm tensor, stepped)."""
    deepspeed = hasattr(model, "get_global_grad_norm")  # a DeepSpeed engine
    if deepspeed:  # it clipped and stepped at the last micro-batch's backward (utils.engines.backward)
        norm = model.get_global_grad_norm()
        grad_norm = torch.tensor(float("nan") if norm is None else float(norm), device=loss.device)
    elif accelerator.is_fsdp2:  # accelerate's clip compares parameter lists, which fails with two models (PPO)
        accelerator.unscale_gradients()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # a DTensor
    else:
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))
    loss = accelerator.reduce(loss.detach().clone(), reduction="sum")
    finite = bool(torch.isfinite(grad_norm) and torch.isfinite(loss))
    # fp16: the grad scaler skips overflowing steps itself, so it must see every step; DeepSpeed has
    # stepped already (it skips only fp16 overflows), so the schedule moves on with it
    if finite or accelerator.scaler is not None or deepspeed:
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
