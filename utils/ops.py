"""Tensor operations both scripts share: per-token logprobs and entropy of completions, and
masked reductions. Stateless."""

import torch

from utils.memory import fake_oom_check
from utils.placement import model_input_device


def _row_stats(logits, targets, temperature):
    """logits [..., V], targets [...] -> per row, in float32: logsumexp, the target's logit, and E_p[z] (z: the logits
    over the temperature; entropy = logsumexp - E_p[z]). One read of the logits when compiled."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    top = z.amax(-1, keepdim=True)
    e = torch.exp(z - top)
    total = e.sum(-1)
    lse = top.squeeze(-1) + torch.log(total)
    return lse, z.gather(-1, targets.unsqueeze(-1)).squeeze(-1), (e * z).sum(-1) / total


def _logit_grad(logits, targets, lse, ent, g_logprob, g_entropy, temperature):
    """The gradient of logprob = z[target] - lse and entropy = lse - E_p[z] (z = logits / temperature) with respect
    to the logits, given their gradients [...]: d logprob/dz = onehot - p, d entropy/dz = -p * (z - lse + entropy)."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    p = torch.exp(z - lse.unsqueeze(-1))
    grad = -p * g_logprob.unsqueeze(-1)
    if g_entropy is not None:
        grad = grad - g_entropy.unsqueeze(-1) * p * (z - (lse - ent).unsqueeze(-1))
    onehot = torch.arange(z.shape[-1], device=z.device) == targets.unsqueeze(-1)
    grad = torch.where(onehot, grad + g_logprob.unsqueeze(-1), grad)
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits.dtype)


def compiled_or_eager(fn, what, fallback, dynamic=False, options=None):
    """torch.compile'd `fn` (inductor `options`, if any), or `fn` itself if compiling it fails at its first call (an
    architecture or operator inductor cannot handle): a warning naming `what` (fallback: (the feature, how it then
    runs)), and the run goes on with that part uncompiled (same numbers, uncompiled kernels). Out of memory is not a
    compile failure and is raised."""
    compiled = torch.compile(fn, fullgraph=False, dynamic=dynamic, options=options)
    chosen = []

    def call(*args):
        if not chosen:
            try:
                out = compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # noqa: BLE001 (any compiler error)
                import warnings

                warnings.warn(f"{fallback[0]}: torch.compile failed on {what} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0][:200] if str(error) else ''}); running it uncompiled "
                              f"({fallback[1]}) instead")
                chosen.append(fn)
                return fn(*args)
            chosen.append(compiled)
            return out
        return chosen[0](*args)

    return call


COMPILE_LOGPROBS = True  # on a CUDA GPU: _row_stats and _logit_grad each one Triton kernel or two (torch.compile)
_COMPILED = {}


def _fused(fn, tensor):
    if not (COMPILE_LOGPROBS and tensor.is_cuda):
        return fn
    if fn not in _COMPILED:  # dynamic: one kernel for every chunk and micro-batch shape
        _COMPILED[fn] = compiled_or_eager(fn, fn.__name__, ("logprobs_and_entropy", "its passes as separate kernels"),
                                          dynamic=True)
    return _COMPILED[fn]


class _LogprobsFromLogits(torch.autograd.Function):
    """logits [..., V] -> (logprob of targets [...], entropy [...] or zeros), float32, with a backward written out
    (_logit_grad): it keeps the logits as they came (bf16 under autocast) and two floats a row, no float32 copy,
    log-softmax or probabilities. The graph autograd builds instead (a float32 cast, gather, logsumexp, softmax for
    the entropy, each a pass over [tokens, vocab] and its backward) took about 0.5 s of the 1.5b update's 3.0 s
    (H200 profile, 2026-12-06)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy):
        lse, picked, mean_z = _fused(_row_stats, logits)(logits, targets, temperature)
        ent = lse - mean_z if entropy else torch.zeros_like(lse)
        if entropy in (None, "metric"):
            ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(logits, targets, lse, ent)
        ctx.temperature, ctx.entropy = temperature, entropy
        return picked - lse, ent

    @staticmethod
    def backward(ctx, g_logprob, g_entropy):
        logits, targets, lse, ent = ctx.saved_tensors
        if g_logprob is None:
            g_logprob = torch.zeros_like(lse)
        if ctx.entropy in (None, "metric"):
            g_entropy = None
        grad = _fused(_logit_grad, logits)(logits, targets, lse, ent, g_logprob.float(),
                                           None if g_entropy is None else g_entropy.float(), ctx.temperature)
        return grad, None, None, None


def logprobs_and_entropy(logits, targets, temperature=1.0, entropy=None):
    """logits [..., V] (any float dtype; the math in float32), targets [...] -> logprob of each target and, with
    `entropy` ("metric": without gradient; "grad" or "checkpointed": with it, nothing more kept), the entropy of
    softmax(logits / temperature), else zeros; both [...] float32."""
    return _LogprobsFromLogits.apply(logits, targets.to(logits.device), float(temperature), entropy)


def completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0, entropy=None,
                        chunk_size=0):
    """Logprobs of the last `num_completion_tokens` tokens of `input_ids` under `model`.

    input_ids, attention_mask: [B, P + C] (prompts left-padded, completions right-padded).
    Logits are divided by the sampling temperature, so the logprobs are those of the
    distribution the completions were sampled from. Only the C + 1 last positions go through
    the LM head (`logits_to_keep`); with `chunk_size` > 0 they go `chunk_size` tokens at a time,
    recomputed in backward, so the [B, C, vocab] logits never exist (--logprob_chunk_size).
    entropy: None, "metric" (no gradient), "grad", or "checkpointed" (with gradient; the same as "grad" now that
    logprobs_and_entropy keeps no probabilities). Returns logprobs [B, C] and entropy [B, C] (or None), on the device
    `input_ids` came from, wherever the model is placed.
    """
    fake_oom_check(input_ids.shape[0])
    home = input_ids.device
    device = model_input_device(model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() numbers them
    targets = input_ids[:, -num_completion_tokens:]
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                  logits_to_keep=num_completion_tokens + 1, use_cache=False)
    if chunk_size:
        head = output_head(model)
        projection = head_projection(head)

        def head_forward(hidden):  # [B, C + 1, H] -> [B, C + 1, 2]: (logprob, entropy) per position
            project = projection()  # inside the forward: FSDP2 swaps the gathered weight in only then
            out = chunked_logprobs(project, hidden[:, :-1], targets, temperature, chunk_size, entropy)
            return torch.nn.functional.pad(out, (0, 0, 0, 1))

        with replaced_forward(head, head_forward):
            out = model(**inputs).logits[:, :-1]
        logprobs, ent = out[..., 0], (out[..., 1] if entropy else None)
    else:
        logits = model(**inputs).logits[:, :-1, :]  # [B, C, V]: position t predicts token t + 1
        logprobs, ent = logprobs_and_entropy(logits, targets, temperature, entropy)
        ent = ent if entropy else None
    return logprobs.to(home), (ent.to(home) if ent is not None else None)


def _chunk_logprobs(project, hidden, targets, temperature, entropy):
    return logprobs_and_entropy(project(hidden), targets, temperature, entropy)  # logits [n, V] -> 2 x [n]


def chunked_logprobs(project, hidden, targets, temperature, chunk_size, entropy=None):
    """hidden [B, C, H] -> [B, C, 2] (logprob of `targets` [B, C], entropy or 0), through the
    LM head `project` chunk_size tokens at a time; with gradients each chunk's logits are
    recomputed in backward instead of stored."""
    from torch.utils.checkpoint import checkpoint

    B, C, H = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(B * C, H), targets.reshape(B * C).to(hidden.device)
    parts = []
    for start in range(0, B * C, chunk_size):
        h, t = flat_hidden[start:start + chunk_size], flat_targets[start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(torch.stack(checkpoint(_chunk_logprobs, project, h, t, temperature, entropy,
                                                use_reentrant=False), -1))
        else:
            parts.append(torch.stack(_chunk_logprobs(project, h, t, temperature, entropy), -1))
    return torch.cat(parts).view(B, C, 2)


def output_head(model):
    """The LM head (output embeddings) under DDP and PEFT wrappers; refuses heads whose logits
    are transformed after the projection (the chunked path would skip that)."""
    from utils.cli import UsageError

    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise UsageError(f"--logprob_chunk_size: this model transforms its logits after the LM head ({name}); "
                             "use --logprob_chunk_size 0")
    head = inner.get_output_embeddings()
    if head is None:
        raise UsageError("--logprob_chunk_size: the model has no output embeddings (get_output_embeddings)")
    return head


def head_projection(head):
    """A function, called inside the model's forward, that returns hidden -> logits of the LM head.
    A plain Linear is applied with its weight fetched once per forward (from the CPU under
    --param_offload; the gathered weight under FSDP2, which registers it only during the forward);
    anything else through its forward as it is now: a LoRA-wrapped head, or one with accelerate
    hooks (an offloaded reference: its weight is on `meta` until the hook loads it)."""
    is_plain = isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward
    hooked = "forward" in head.__dict__ and not hasattr(head, "lean_rl_fetch")
    if not is_plain or hooked:
        forward = head.forward
        return lambda: forward
    fetch = getattr(head, "lean_rl_fetch", lambda p: p)

    def projection():
        weight, bias = fetch(head.weight), fetch(head.bias)
        return lambda hidden: torch.nn.functional.linear(hidden, weight, bias)
    return projection


class replaced_forward:
    """Context: `module.forward` is `fn` inside, restored (an instance override included) after."""

    def __init__(self, module, fn):
        self.module, self.fn = module, fn

    def __enter__(self):
        self.saved = self.module.__dict__.get("forward")
        self.module.forward = self.fn

    def __exit__(self, *exc):
        if self.saved is not None:
            self.module.forward = self.saved
        else:
            del self.module.forward


def completion_values(value_model, input_ids, attention_mask, num_completion_tokens):
    """Critic values V(s_t) for the last `num_completion_tokens` tokens: the value head on the
    hidden state of the position before each token (aligned with completion_logprobs).

    value_model: utils.modeling.ValueModel (possibly DDP-wrapped). Returns [B, C] float32 on the
    device `input_ids` came from."""
    fake_oom_check(input_ids.shape[0])
    home = input_ids.device
    device = model_input_device(value_model)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    values = value_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return values[:, -(num_completion_tokens + 1) : -1].float().to(home)


class MicroBatch:
    """Rows of the step's batch for one forward pass, and the column window that holds their
    tokens (left prompt padding and right completion padding that no row needs are cut)."""

    def __init__(self, rows, start, stop, num_completion_tokens, total_completion_tokens):
        self.rows, self.start, self.stop = rows, start, stop
        self.c, self.C = num_completion_tokens, total_completion_tokens

    def window(self, tensor):
        """[B, P + C] (input_ids, attention_mask) -> [b, window] of this micro-batch's rows."""
        return tensor[self.rows, self.start:self.stop]

    def take(self, tensor):
        """[B, ...] per-row tensors (advantages [B]) -> this micro-batch's rows."""
        return tensor[self.rows]

    def completion(self, tensor):
        """[B, C] per-completion-token tensors (masks, old logprobs) -> [b, c]."""
        return tensor[self.rows, :self.c]

    def pad(self, values):
        """[b, c] per-completion-token values -> [b, C] (zeros where every row is padding)."""
        return torch.nn.functional.pad(values, (0, self.C - self.c))


def plan_micro_batches(attention_mask, num_completion_tokens, rows=None, batch_size=None, max_tokens=None,
                       num_batches_at_least=None):
    """Split `rows` (default: all rows of attention_mask [B, P + C]) into micro-batches.

    Fixed (batch_size): consecutive groups of batch_size rows. Token budget (max_tokens,
    --use_dynamic_bsz): rows sorted by length, packed greedily so that rows x (longest prompt +
    longest completion) <= max_tokens; `num_batches_at_least(n) -> int` lets all processes agree
    on one count (the largest), reached by splitting the biggest micro-batches. Either way the
    losses are summed with global normalisers, so the plan does not change the math.
    Reads the lengths once (one host sync)."""
    C = num_completion_tokens
    P = attention_mask.shape[1] - C
    device = attention_mask.device
    if rows is None:
        rows = torch.arange(attention_mask.shape[0], device=device)
    lengths = torch.stack([attention_mask[rows, :P].sum(1), attention_mask[rows, P:].sum(1)], 1).tolist()
    order = list(range(len(rows)))
    if max_tokens is None:
        groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    else:
        order.sort(key=lambda i: -(lengths[i][0] + lengths[i][1]))
        groups, current = [], []
        for i in order:
            candidate = current + [i]
            cost = len(candidate) * (max(lengths[j][0] for j in candidate) + max(lengths[j][1] for j in candidate))
            if current and cost > max_tokens:
                groups.append(current)
                candidate = [i]
            current = candidate
        groups.append(current)
        target = num_batches_at_least(len(groups)) if num_batches_at_least else len(groups)
        while len(groups) < target:  # split the largest splittable group
            big = max((g for g in groups if len(g) > 1), key=len)
            groups.remove(big)
            groups += [big[:len(big) // 2], big[len(big) // 2:]]
    plan = []
    for group in groups:
        prompt_len = max(max(lengths[i][0] for i in group), 1)
        completion_len = max(max(lengths[i][1] for i in group), 1)
        plan.append(MicroBatch(rows[torch.tensor(group, device=device)], P - prompt_len, P + completion_len,
                               completion_len, C))
    return plan


@torch.no_grad()
def batched_completion_logprobs(model, input_ids, attention_mask, plan, temperature, chunk_size=0, entropy=False):
    """completion_logprobs without gradients over the micro-batches of `plan` -> [B, C]
    (zeros in the columns past a micro-batch's longest completion); with `entropy` also the
    per-token entropy [B, C] from the same forward."""
    B, C = input_ids.shape[0], plan[0].C
    out = torch.zeros(B, C, device=input_ids.device)
    entropies = torch.zeros(B, C, device=input_ids.device) if entropy else None
    for mb in plan:
        logprobs, ent = completion_logprobs(model, mb.window(input_ids), mb.window(attention_mask), mb.c, temperature,
                                            entropy="metric" if entropy else None, chunk_size=chunk_size)
        out[mb.rows] = mb.pad(logprobs)
        if entropy:
            entropies[mb.rows] = mb.pad(ent)
    return (out, entropies) if entropy else out


def pad_cat(tensors, value=0, left=False):
    """Concatenate [n_i, L_i] tensors along the rows, each padded with `value` to the widest L (on
    the left: left-padded prompts); tensors of other shapes are concatenated as they are."""
    if tensors[0].dim() != 2 or len({t.shape[1] for t in tensors}) == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0) if left else (0, width - t.shape[1]), value=value)
                      for t in tensors])


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
