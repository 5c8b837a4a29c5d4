"""Sampling completions with `generate` and marking where each one ends."""

import copy
import types
from contextlib import contextmanager, nullcontext

import torch

from utils import decode_attention
from utils.base import CAPTURED_BACKENDS, static_cache_len
from utils.memory import fake_oom_check
from utils.modeling import uncompiled_blocks
from utils.offload import resident, side_stream
from utils.ops import compiled_or_eager, pad_cat
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


def sample_from(logits, generator=None, uniform=None):
    """One token per row from softmax(logits), by the Gumbel-max trick: argmax(logits + Gumbel
    noise) is distributed as softmax(logits), with no host synchronisation (unlike multinomial's
    checks). `uniform` [B, V]: the float32 draws in [0, 1) to use (drawn here when None)."""
    if uniform is None:
        uniform = torch.rand(logits.shape, device=logits.device, generator=generator)
    return (logits - torch.log(-torch.log(uniform.clamp(min=1e-20)))).argmax(dim=-1)


@torch.no_grad()
def static_cache_generate(model, input_ids, attention_mask, max_new_tokens, temperature, top_p, top_k, eos_token_ids,
                          pad_token_id, step_mode="eager", greedy=False, check_every=16, return_logprobs=False,
                          prefill_chunk_size=None, kv_cache_dtype="auto", share_prompt_cache=False):
    """--generation_backend static / cudagraph / compiled: the same sampling as `generate`
    (sampling_logits) from a static KV cache, so every decoding step has the same shapes and the
    step can be replayed as one CUDA graph (step_mode cudagraph: the eager step captured;
    compiled: the torch.compile'd step captured; on a CPU, eager and compiled-without-graph). No
    host synchronisation per token: whether every row has finished is asked every `check_every`
    steps. prefill_chunk_size (--prefill_chunk_size): the prompts go into the cache that many positions
    per forward; kv_cache_dtype fp8 (--kv_cache_dtype): the cache holds float8 codes (_fp8_kv_class);
    share_prompt_cache (--share_prompt_cache): each distinct prompt prefilled once, its keys and values held
    once (SharedPrompt). Returns the new tokens [B, N] (pad after a row's first EOS), N <= max_new_tokens, and
    with return_logprobs each one's logprob [B, N] as the step sampled it (see _pick; 0 after EOS)."""
    if share_prompt_cache and kv_cache_dtype == "fp8":
        raise ValueError("--share_prompt_cache is not yet implemented with --kv_cache_dtype fp8")
    cache_len = static_cache_len(input_ids.shape[1], max_new_tokens)
    with packed_gqa_decoding(model, any_implementation=share_prompt_cache), \
            float32_weights_through_kernel(model) if step_mode != "eager" else nullcontext():
        tokens, logprobs = _static_loop(model, input_ids, attention_mask, max_new_tokens,
                                        (temperature, top_k, top_p, greedy), eos_token_ids, pad_token_id, step_mode,
                                        check_every, cache_len, prefill_chunk_size, kv_cache_dtype, share_prompt_cache)
    return (tokens, logprobs) if return_logprobs else tokens


def _static_loop(model, input_ids, attention_mask, max_new_tokens, sampling, eos_token_ids, pad_token_id, step_mode,
                 check_every, cache_len, prefill_chunk_size=None, kv_cache_dtype="auto", share_prompt=False):
    B, P = input_ids.shape
    device = input_ids.device
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding
    eos = torch.tensor(eos_token_ids, device=device)
    if share_prompt:
        # --share_prompt_cache: the prompts go once each into a cache of their own (SharedPrompt), the completions into
        # the decoding cache from its position 0; row b's first token is drawn from its prompt's last logits
        prompt_ids, prompt_mask, prompt_row = distinct_prompts(input_ids, attention_mask)  # [U, P] x2, [B]
        completion_len = static_cache_len(0, max_new_tokens)
        cache, step, shared = _decoder(model, B, completion_len, sampling, step_mode, device, kv_cache_dtype,
                                       (prompt_ids.shape[0], static_cache_len(P, 0)))
        extra = shared.keep.shape[0] - prompt_ids.shape[0]  # a kept decoder's prompt rows beyond this rollout's:
        if extra:  # filled with its first prompt (prefilled, never read)
            prompt_ids = torch.cat([prompt_ids, prompt_ids[:1].expand(extra, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[:1].expand(extra, -1)])
        shared.keep.zero_()
        shared.keep[:, :P] = prompt_mask.bool()
        shared.row.copy_(prompt_row)
        logits = _prefill(model, prompt_ids, prompt_mask, shared.cache, prefill_chunk_size)[prompt_row]  # [B, V]
        mask = torch.zeros(B, completion_len, dtype=torch.long, device=device)  # [B, completion positions]
        first = 0  # the decoding cache's position of the first new token
    else:
        cache, step, _ = _decoder(model, B, cache_len, sampling, step_mode, device, kv_cache_dtype)
        mask = torch.zeros(B, cache_len, dtype=torch.long, device=device)  # [B, cache_len]
        mask[:, :P] = attention_mask
        logits = _prefill(model, input_ids, mask, cache, prefill_chunk_size)
        first = P
    token, logprob = _pick(logits, *sampling)
    cache_positions = torch.arange(first, first + max_new_tokens, device=device)  # sliced per step: no host copy
    position = positions[:, -1:] + 1
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        logprobs.append(logprob.masked_fill(finished, 0.0))
        finished = finished | torch.isin(token, eos)
        if t == max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool(finished.all())):
            break
        mask[:, first + t] = 1
        token, logprob = step(token, position, cache_positions[t:t + 1], mask)
        position = position + 1
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1)


def _prefill(model, input_ids, mask, cache, prefill_chunk_size=None):
    """The prompts input_ids [B, P] (left-padded; mask [B, >= P] over the cache's positions) into `cache`,
    `chunk` positions per forward (each chunk's queries see the cache up to their own position) -> the last
    position's logits [B, V]. Only the last position goes through the LM head ([B, 1, V], not [B, P, V] logits). It
    is picked by index (a copy, [B, 1, H] row-major), not by transformers' slice of the last position: that view
    kept the chunk's stride, so F.linear could not fold it into one matrix and ran B one-row products over the
    LM head broadcast B times (aten::bmm; CPU test)."""
    P, device = input_ids.shape[1], input_ids.device
    positions = (mask[:, :P].cumsum(dim=1) - 1).clamp(min=0)  # left padding
    chunk = min(prefill_chunk_size or P, P)
    for start in range(0, P, chunk):
        end = min(start + chunk, P)
        logits = model(input_ids=input_ids[:, start:end], attention_mask=mask[:, :end],
                       position_ids=positions[:, start:end], past_key_values=cache,
                       cache_position=torch.arange(start, end, device=device), use_cache=True,
                       logits_to_keep=torch.tensor([end - start - 1], device=device)).logits[:, -1]
    return logits


def distinct_prompts(input_ids, attention_mask):
    """--share_prompt_cache: (prompt_ids [U, P], prompt_mask [U, P], prompt_row [B]) of the left-padded prompts
    input_ids [B, P]: one prompt row per run of consecutive equal rows (GRPO's --num_generations rows of one prompt,
    which generate_completions' slices keep together), row b's prompt at prompt_ids[prompt_row[b]]. Runs, not every
    distinct prompt: U is the slice's count of groups from one rollout to the next (a captured step keeps its
    shapes), two groups of one prompt apart in the slice being two; side by side they are one run, fewer rows,
    which the kept decoder serves (_decoder)."""
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)  # [B, 2P]: a prompt is ids and mask
    starts = torch.ones(len(rows), dtype=torch.bool, device=rows.device)  # [B]: the first row of each run
    starts[1:] = (rows[1:] != rows[:-1]).any(dim=1)
    return input_ids[starts], attention_mask[starts], starts.cumsum(dim=0) - 1


class SharedPrompt:
    """--share_prompt_cache: the rollout's prompts' keys and values, one row per distinct prompt, for the decoding
    steps' attention (packed_gqa_attention, passed as the model's `shared_prompt` keyword, which transformers hands
    to the attention function): cache (a StaticCache of U rows x the prompt's positions), keep [U, Lp] bool (the
    positions each prompt holds: its left padding and the rounding up are not), row [B] int64 (the prompt row of each
    decoding row). Static tensors, filled in place by each rollout (a captured step reads their addresses)."""

    def __init__(self, cache, keep, row):
        self.cache, self.keep, self.row = cache, keep, row


PACKED_GQA = "lean_rl_packed_gqa_sdpa"  # the attention implementation's registered name


def packed_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                         **kwargs):
    """transformers' SDPA attention, except for one query token with grouped key/value heads
    (decoding, GQA models: Qwen2, Llama 3): the query heads that share a key/value head become
    that head's rows, query [B, Hq, 1, D] -> [B, Hkv, Hq/Hkv, D], so the cache is read as it is.
    transformers' SDPA path with a mask (as a static cache needs) copies every layer's keys and
    values Hq/Hkv times first (`repeat_kv`: about 17 GB written per step at qwen2.5-1.5b, 128 rows,
    768 positions, computed); transformers 5.24 packs like this outside torch.compile only. Same
    numbers. On an H200 the 1.5b step went from 7.4 to 3.5 ms (compiled, bf16). On a CUDA GPU with
    Triton, the packed product runs in utils/decode_attention.py's kernel, which reads only the cache
    positions the mask keeps (SDPA reads all `cache_len`). With a `shared_prompt` keyword (a SharedPrompt,
    --share_prompt_cache) a decoding step attends to its row's prompt in that cache and to its own completion here,
    one softmax over both (shared_prompt_attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    shared = kwargs.pop("shared_prompt", None)
    if shared is not None:
        if q_len != 1 or attention_mask is None or dropout or kwargs.get("softcap") is not None:
            raise ValueError("--share_prompt_cache: a decoding step's attention takes one query token and the "
                             "static cache's mask, without dropout or softcapping")
        if kwargs.get("sliding_window") is not None:  # the window would count from the completion's first position
            raise ValueError(f"--share_prompt_cache does not support sliding-window attention (layer "
                             f"{module.layer_idx} of this model has a window of {kwargs['sliding_window']})")
        layer = shared.cache.layers[module.layer_idx]
        out = shared_prompt_attention(query.reshape(batch, heads // groups, groups, dim), layer.keys, layer.values,
                                      shared.keep, shared.row, key, value, attention_mask[:, 0, 0, :],
                                      dim ** -0.5 if scaling is None else scaling)
        return out.reshape(batch, 1, heads, dim), None
    mask_shared = attention_mask is None or attention_mask.shape[1] == 1
    if (q_len != 1 or groups == 1 or not mask_shared or dropout or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    packed = _as_autocast_casts(query.reshape(batch, heads // groups, groups, dim), key)  # query head h reads
    # key/value head h // groups
    if decode_attention.usable(packed, key, attention_mask):
        out = decode_attention.decode_attention(packed, key, value, attention_mask[:, 0, 0, :],
                                                dim ** -0.5 if scaling is None else scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                               scale=scaling)
    # [B, 1, Hq, D], row-major: the same numbers as [B, Hq, 1, D] transposed. Under inductor that transposed view
    # kept D as the stride of the length-1 token dimension (.contiguous() is a no-op on it), so an op inductor cannot
    # see into (bitsandbytes' 4-bit/8-bit product of o_proj) got a [B, 1, Hq * D] that F.linear could not fold into
    # one matrix: B one-row products over the weight broadcast B times (aten::bmm; 7b QLoRA, 64 rows: 218 us a layer
    # against ~9 alone, 6.1 ms of a 25.0 ms step; H100, 2026-12-06). Eager reshapes restore the stride
    return out.reshape(batch, 1, heads, dim), None


def shared_prompt_attention(query, prompt_key, prompt_value, prompt_keep, prompt_row, key, value, keep, scale):
    """--share_prompt_cache's attention of one decoding step: query [B, Hkv, G, D] (the G query heads of each
    key/value head) over row b's prompt, prompt_key and prompt_value [U, Hkv, Lp, D] at row prompt_row[b] ([B])
    with prompt_keep [U, Lp] bool, and its completion so far, key and value [B, Hkv, L, D] with keep [B, L] bool, in
    one softmax -> [B, Hkv, G, D]. On a CUDA GPU with Triton utils/decode_attention.py's kernel reads each part in
    place; elsewhere the prompt rows are gathered, laid before the completion's positions and SDPA runs over both:
    the same numbers as the unshared cache's SDPA, whose positions hold the same keys in another order."""
    keep = keep.bool()
    query = _as_autocast_casts(query, key)
    if decode_attention.usable(query, key, keep[:, None, None, :]) and prompt_key.dtype == query.dtype:
        return decode_attention.decode_attention_shared(query, prompt_key, prompt_value, prompt_keep, prompt_row,
                                                        key, value, keep, scale)
    key = torch.cat([prompt_key[prompt_row], key], dim=2)
    value = torch.cat([prompt_value[prompt_row], value], dim=2)
    keep = torch.cat([prompt_keep[prompt_row], keep], dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep[:, None, None, :],
                                                            scale=scale)


def _as_autocast_casts(query, key):
    """A float32 query beside bf16 or fp16 keys under CUDA autocast to that dtype (a float32 policy decoding: RoPE's
    product with float32 cos/sin leaves the query float32, the cache holds the values' dtype, _store_keys_as_values)
    in the keys' dtype, as autocast casts SDPA's inputs: the decoding kernel can then take the step (it takes one
    dtype; before 2026-12-07 such steps ran SDPA over every cache position). Anything else as it is."""
    if (query.dtype == torch.float32 and key.dtype in (torch.bfloat16, torch.float16) and query.is_cuda
            and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == key.dtype):
        return query.to(key.dtype)
    return query


@contextmanager
def packed_gqa_decoding(model, any_implementation=False):
    """A model on transformers' SDPA attention runs packed_gqa_attention for the rollout (its
    masks made as SDPA's); any other attention implementation is left alone, unless any_implementation
    (--share_prompt_cache, whose decoding steps need packed_gqa_attention: the rollout then runs SDPA)."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != "sdpa" and not any_implementation:
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
    AttentionMaskInterface.register(PACKED_GQA, sdpa_mask)
    config._attn_implementation = PACKED_GQA
    try:
        yield
    finally:
        config._attn_implementation = implementation


FLOAT32_KERNEL_DEVICES = ("cuda",)  # where float32_weights_through_kernel applies (tests add "cpu": autocast's way)


@contextmanager
def float32_weights_through_kernel(model):
    """A float32 policy decoding under bf16 autocast (the default numerics, no --generation_copy): inside the rollout
    each plain Linear with a float32 weight of at least utils/int8.py's FLOAT32_KERNEL_MIN_WEIGHTS on a CUDA GPU with
    Triton sends its decoding products (<= KERNEL_MAX_ROWS rows, no grad, bf16 autocast) to lean_rl::float32_mm, which
    reads the float32 weight in its own kernel instead of autocast's bf16 cast of it at every step, where that was
    faster at the shape's first call (utils/int8.py gives the measurements); a prefill of up to KERNEL_MAX_ROWS
    positions in all too. Anything else (a larger prefill, a training pass, no autocast) runs Linear's own forward.
    Put back after the rollout. Used by the compiled and captured decoding steps only (the eager step,
    --generation_backend static, would pay the op's dispatch at every product of every step: not measured); a layer
    whose forward was already replaced (an offload hook's) is left alone."""
    from utils import int8

    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dtype == torch.float32
              and m.weight.device.type in FLOAT32_KERNEL_DEVICES
              and m.weight.numel() >= int8.FLOAT32_KERNEL_MIN_WEIGHTS
              and "forward" not in m.__dict__]  # a forward of someone else's (offload, hooks) is left alone
    if layers and "cuda" in {m.weight.device.type for m in layers} and not int8._triton_ready():
        layers = [m for m in layers if m.weight.device.type != "cuda"]
    for layer in layers:
        layer.forward = types.MethodType(_float32_decoding_forward, layer)
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _float32_decoding_forward(self, x):
    from utils.int8 import KERNEL_MAX_ROWS, float32_weight_linear

    device = x.device.type
    if (x.numel() // x.shape[-1] <= KERNEL_MAX_ROWS and not torch.is_grad_enabled()
            and torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16):
        return float32_weight_linear(x, self.weight, self.bias)
    return torch.nn.Linear.forward(self, x)


def _pick(logits, temperature, top_k, top_p, greedy, uniform=None):
    """(token [B], its logprob [B]): the token drawn from sampling_logits, and its logprob under
    softmax(logits / temperature) before top-k / top-p, the distribution the training forward
    computes (utils/ops.py completion_logprobs), so that the two differ by numerics only (the
    rollout correction's pi_rollout; one logsumexp over the vocabulary per step). `uniform`: the
    Gumbel draws (sample_from), drawn here when None."""
    scaled = logits.float() / temperature  # [B, V]
    token = scaled.argmax(dim=-1) if greedy else sample_from(sampling_logits(scaled, 1.0, top_k, top_p),
                                                              uniform=uniform)
    logprob = scaled.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return token, logprob


# inductor options of the compiled decoding step's forward (None: inductor's defaults). The step's matrix products
# at 128 rows ran at about half the bandwidth floor (H100 profile of the 1.5b 24GB row, 2026-12-06: 0.95 s of a
# 2.03 s rollout in cuBLAS kernels reading 3.1 GB a step); benchmarks/decode_step.py --max_autotune sets
# {"max_autotune": True} (inductor's GEMM autotuning over its Triton templates and cuBLAS) to measure whether that
# helps. Measured (H100, 2026-12-06, 1.5b float32 policy with its copy, 128 rows): not worth it. The first rollout
# autotuned for over 4 minutes (38-52 s per matrix shape, single-process) and was stopped there; for the LM head
# (0.18 ms of the 3.44 ms step) cuBLAS was already the best of 21 choices (0.1830 ms, the best Triton 0.1827); the
# per-layer products' best Triton choices (e.g. down 0.0325 against cuBLAS's 0.0399 ms) were timed on their own,
# in L2. The GPU test (greedy tokens equal the defaults') passed. Not used by the training scripts
DECODE_COMPILE_OPTIONS = None
# what a compile failure in the decoding step falls back to (compiled_or_eager's warning)
GENERATION_FALLBACK = "--generation_backend compiled", "as --generation_backend cudagraph runs it"
_CAPTURED_BEFORE = set()  # (model class, device, _decoder's key) of every decoding step captured in this process


def _decoder(model, batch, cache_len, sampling, step_mode, device, kv_cache_dtype="auto", prompt_cache=None):
    """(static KV cache, decoding step(token [B], position [B, 1], cache_position [1], mask [B, L])
    -> (next token [B], its logprob [B]), SharedPrompt or None) for `model`. prompt_cache (--share_prompt_cache):
    (prompt rows U, prompt positions Lp): the steps also attend to a SharedPrompt's cache of U rows x Lp positions.
    A captured or compiled pair is kept on the model for its next rollouts (the caches emptied each time): the graph
    replays into the same cache tensors and nothing is compiled or captured again, for the price of the cache staying
    allocated between rollouts. The eager step gets a fresh cache each call (freed with it)."""
    from transformers import StaticCache

    graph = step_mode in CAPTURED_BACKENDS and device.type == "cuda"
    keep = graph or step_mode == "compiled"
    key = (batch, cache_len, sampling, step_mode, kv_cache_dtype, prompt_cache)
    held = model.__dict__.pop("_lean_rl_decoder", None)  # another shape: the old cache is freed before the new one
    # a kept SharedPrompt with at least the prompt rows asked for serves (its extra rows filled, never read)
    fits = held is not None and (held[0] == key or (
        prompt_cache is not None and held[0][:5] == key[:5] and held[0][5] is not None
        and held[0][5][1] == prompt_cache[1] and held[0][5][0] >= prompt_cache[0]))
    if keep and fits:
        model.__dict__["_lean_rl_decoder"] = held
        _, cache, step, shared = held
        cache.reset()  # zeros and position 0: stale keys and values never meet the mask as NaN * 0
        if shared is not None:
            shared.cache.reset()
        return cache, step, shared
    del held
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    if kv_cache_dtype == "fp8":
        for layer in cache.layers:  # float8 codes + scales in the layer's own (uint8) buffers
            layer.__class__ = _fp8_kv_class(type(layer))
    else:
        _store_keys_as_values(cache)  # autocast may start only inside the forward (accelerate wraps it)
    shared, extra = None, {}
    if prompt_cache is not None:
        rows, length = prompt_cache
        shared = SharedPrompt(StaticCache(config=model.config, max_cache_len=length),
                              torch.zeros(rows, length, dtype=torch.bool, device=device),
                              torch.zeros(batch, dtype=torch.long, device=device))
        _store_keys_as_values(shared.cache)
        extra = {"shared_prompt": shared}  # handed by transformers to the attention function (packed_gqa_attention)

    def forward(token, position, cache_position, mask):
        return model(input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache,
                     cache_position=cache_position, use_cache=True, logits_to_keep=1, **extra).logits[:, -1]

    pick = _pick
    if step_mode == "compiled":  # fused kernels (the graph is captured below); the random draw stays eager
        forward = compiled_or_eager(forward, "the model's forward", GENERATION_FALLBACK, options=DECODE_COMPILE_OPTIONS)
        # the pick's passes over the [B, V] float32 logits (scale, Gumbel noise, argmax, logsumexp) fused: eager they
        # were ~0.3 ms of the 1.5b workload's 3.5 ms step (an H200 profile, 2026-12-03, 128 rows); the same draws
        pick = compiled_or_eager(_pick, "the token pick", GENERATION_FALLBACK)

    def step(token, position, cache_position, mask):
        logits = forward(token, position, cache_position, mask)  # [B, V]
        uniform = None if sampling[3] else torch.rand(logits.shape, device=logits.device)  # greedy: no draws
        return pick(logits, *sampling, uniform)

    if graph:
        # captured again (--empty_cache_between_phases drops the decoder after each rollout): its compiles, autotuning
        # and cuBLAS workspaces exist, so one warm-up run before the capture (the first capture of a shape runs 3;
        # each was ~17 ms of a 1.5b rollout's start, H200 profile 2026-12-06)
        step = _captured(model, cache, step, batch, cache_len, device,
                         warmup=1 if (type(model), device, key) in _CAPTURED_BEFORE else 3, shared=shared)
        _CAPTURED_BEFORE.add((type(model), device, key))
    if keep:
        model.__dict__["_lean_rl_decoder"] = (key, cache, step, shared)  # lives (and dies) with the model
    return cache, step, shared


def _captured(model, cache, step, batch, cache_len, device, warmup=3, shared=None):
    """`step` recorded once as a CUDA graph (torch.cuda.graph) and replayed at every decoding
    step: one launch instead of one per kernel (torch.compile's own CUDA-graph trees re-recorded
    this step at every token under transformers 5.17). The inputs are copied into the graph's own
    buffers, the output copied out. The cache is filled by a one-token prefill so that its
    tensors exist, warmed up on a side stream (cuBLAS workspaces, compilation), captured, then
    emptied: its tensors keep their addresses, which the graph reads and writes. A SharedPrompt's cache is filled
    and emptied the same way."""
    token = torch.zeros(batch, dtype=torch.long, device=device)
    position = torch.ones(batch, 1, dtype=torch.long, device=device)
    mask = torch.zeros(batch, cache_len, dtype=torch.long, device=device)
    mask[:, :2] = 1
    model(input_ids=token[:, None], attention_mask=mask[:, :1], position_ids=position - 1, past_key_values=cache,
          cache_position=torch.arange(1, device=device), use_cache=True, logits_to_keep=1)
    if shared is not None:
        rows = shared.keep.shape[0]
        model(input_ids=token[:rows, None], attention_mask=mask[:rows, :1], position_ids=position[:rows] - 1,
              past_key_values=shared.cache, cache_position=torch.arange(1, device=device), use_cache=True,
              logits_to_keep=1)
    inputs = (token, position, torch.ones(1, dtype=torch.long, device=device), mask)
    side = side_stream(device)  # one per device, shared by every capture
    side.wait_stream(torch.cuda.current_stream(device))
    # the warm-up's draws (and any autotuning's) taken from a fork of the generator, put back after the capture: the
    # rollout's samples then start where the generator stood, however many warm-ups ran (3 at a shape's first capture,
    # 1 after), so the same seed samples the same tokens whether or not the shape was captured before (a resumed run
    # recaptures what an uninterrupted one kept)
    with torch.random.fork_rng(devices=[device]):
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step(*inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step(*inputs)
    cache.reset()
    if shared is not None:
        shared.cache.reset()

    def replay(*new_inputs):
        for buffer, value in zip(inputs, new_inputs):
            buffer.copy_(value)
        graph.replay()
        return tuple(o.clone() for o in output)  # (token, logprob)

    replay.graph = graph  # keeps the graph (and its memory pool) alive with the step
    return replay


def _store_keys_as_values(cache):
    """Under autocast (--mixed_precision bf16 over float32 weights), RoPE leaves the keys in float32
    and the values in bf16; transformers 5.17's StaticCache sizes both buffers by the keys' dtype and
    then cannot store the values. Attention casts both to bf16 under autocast anyway, so the keys
    are stored in the values' dtype: the same numbers as `generate`'s cache, half its key bytes.
    Without autocast both have one dtype and nothing changes. Done by the layers' class, not by a
    per-layer closure: torch.compile keeps the functions it traced alive, and a closure holding
    its layer kept a dropped cache's tensors allocated (--empty_cache_between_phases freed nothing)."""
    for layer in cache.layers:
        layer.__class__ = _keys_as_values_class(type(layer))


_KEYS_AS_VALUES = {}


def _keys_as_values_class(cls):
    if cls not in _KEYS_AS_VALUES:
        def update(self, key_states, value_states, *args, **kwargs):
            return cls.update(self, key_states.to(value_states.dtype), value_states, *args, **kwargs)
        _KEYS_AS_VALUES[cls] = type(cls.__name__, (cls,), {"update": update, "__module__": cls.__module__})
    return _KEYS_AS_VALUES[cls]


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
_FP8_KV = {}


def fp8_codes(states):
    """[..., D] keys or values -> [..., D + 4] uint8: each vector's float8 e4m3 codes (scaled so that
    its largest magnitude is FP8_MAX) and the float32 scale's four bytes, so that the static cache's
    own buffers (sized and copied by whatever dtype and last dimension they are given, in any
    transformers version) hold both."""
    states = states.float()
    scale = states.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / FP8_MAX  # [..., 1]
    # the scale's bytes by shifts of its int32 bits, not a float32 -> uint8 view: inductor cannot lower
    # a view between element sizes of a strided [..., 1] (measured: --generation_backend compiled fell back)
    bits = scale.view(torch.int32)
    scale_bytes = torch.cat([(bits >> shift) & 0xFF for shift in (0, 8, 16, 24)], dim=-1).to(torch.uint8)
    return torch.cat([(states / scale).to(FP8).view(torch.uint8), scale_bytes], dim=-1)  # little-endian scale


def from_fp8_codes(data, dtype):
    """fp8_codes' [..., D + 4] uint8 -> [..., D] in `dtype` (all-zero bytes, an empty position, give 0)."""
    dim = data.shape[-1] - 4
    scale_bytes = data[..., dim:].to(torch.int32)  # [..., 4]
    bits = (scale_bytes[..., 0:1] | (scale_bytes[..., 1:2] << 8) | (scale_bytes[..., 2:3] << 16)
            | (scale_bytes[..., 3:4] << 24))
    return data[..., :dim].view(FP8).to(dtype) * bits.view(torch.float32).to(dtype)


def _fp8_kv_class(cls):
    """--kv_cache_dtype fp8: a static cache layer class that stores fp8_codes and returns the whole
    layer dequantised to the values' dtype for attention (one layer's bf16 keys and values exist at a
    time). Done by the layers' class, as _keys_as_values_class is (see there why)."""
    if cls not in _FP8_KV:
        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = cls.update(self, fp8_codes(key_states), fp8_codes(value_states), *args, **kwargs)
            return from_fp8_codes(keys, value_states.dtype), from_fp8_codes(values, value_states.dtype)
        _FP8_KV[cls] = type(cls.__name__, (cls,), {"update": update, "__module__": cls.__module__})
    return _FP8_KV[cls]


@torch.no_grad()
def generate_completions(model, prompt_ids, prompt_mask, generation_config, eos_token_ids, batch_size=None,
                         backend="hf", keep_decoder=True, from_copy=False, return_logprobs=False,
                         prefill_chunk_size=None, kv_cache_dtype="auto", copy_dtype="bfloat16", copy_in_place=False,
                         share_prompt_cache=False):
    """Sample one completion per row of `prompt_ids` [B, P] (left-padded), `batch_size` rows at
    a time (--generation_slice_size: a smaller KV cache; default all at once; the slices grouped by
    prompt length), with `generate`
    (backend hf) or static_cache_generate (static; cudagraph: its decoding step replayed as one
    CUDA graph; compiled: compiled, then replayed as one CUDA graph). keep_decoder=False
    (--empty_cache_between_phases): those two drop their KV cache and graph after the rollout,
    so the next phases get that memory back, and capture them again at the next rollout.
    from_copy (--generation_copy): generate from generation_copy(model) instead (dropped after
    the rollout too with keep_decoder=False; copy_dtype int8: --generation_copy_dtype; copy_in_place:
    --generation_copy_in_place, the adapters merged into the base for the rollout and the exact base put
    back after it, also when the rollout fails). prefill_chunk_size
    (--prefill_chunk_size): the prompts
    are prefilled that many positions per forward (hf: generate's own prefill_chunk_size);
    kv_cache_dtype fp8 (--kv_cache_dtype): the static backends' cache holds float8 codes (not hf);
    share_prompt_cache (--share_prompt_cache): the static backends prefill each slice's distinct prompts once and
    keep their keys and values once (not hf).

    Returns completion_ids [B, C] (right-padded with the pad id after the first EOS),
    completion_mask [B, C] (1 up to and including the first EOS) and is_truncated [B]
    (no EOS within max_new_tokens), all on the device of `prompt_ids`; with return_logprobs also
    sampling_logprobs [B, C] (float32, 0 on padding): each sampled token's logprob under the
    numerics that sampled it, at the sampling temperature and before top-k / top-p, as the training
    forward computes it (the rollout correction's pi_rollout). No extra forward: the static loops
    take it from the logits they sample from, `generate` through _SampledLogprobs."""
    if backend == "hf" and (kv_cache_dtype == "fp8" or share_prompt_cache):
        raise ValueError(f"{'--kv_cache_dtype fp8' if kv_cache_dtype == 'fp8' else '--share_prompt_cache'} needs a "
                         "static-cache backend, not hf")
    chunked_config = None  # generate's own chunked prefill, for slices longer than the chunk
    if backend == "hf" and prefill_chunk_size:
        chunked_config = copy.copy(generation_config)
        chunked_config.prefill_chunk_size = prefill_chunk_size
    policy = model
    if from_copy:
        try:
            model = generation_copy(policy, copy_dtype, copy_in_place)
        except BaseException:
            restore_merged_base(policy)
            raise
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
    # slices of similar prompt lengths (longest first), each without the left padding all its rows
    # share: shorter prefills and caches; the rows go back to their order at the end
    order = prompt_mask.sum(dim=1).argsort(descending=True, stable=True) if batch_size < len(prompt_ids) else None
    try:
        # --param_offload: the weights on the GPU for the phase; --torch_compile's blocks run eagerly
        with resident(policy) if not from_copy else nullcontext(), uncompiled_blocks(model):
            for start in range(0, prompt_ids.shape[0], batch_size):
                rows = slice(start, start + batch_size) if order is None else order[start:start + batch_size]
                fake_oom_check(prompt_ids[rows].shape[0])
                ids, mask = prompt_ids[rows].to(device), prompt_mask[rows].to(device)
                if order is not None:
                    keep = int(mask.sum(dim=1).max())
                    ids, mask = ids[:, ids.shape[1] - keep:], mask[:, mask.shape[1] - keep:]
                if backend == "hf":
                    from transformers import LogitsProcessorList

                    config = chunked_config if chunked_config and prefill_chunk_size < ids.shape[1] else generation_config
                    recorder = _SampledLogprobs(generation_config.temperature or 1.0)
                    new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                         logits_processor=LogitsProcessorList([recorder]))[:, ids.shape[1]:]
                    new_logprobs = recorder.finish(new)
                else:
                    if backend in CAPTURED_BACKENDS and device.type != "cuda":
                        import warnings

                        warnings.warn(f"--generation_backend {backend} needs a GPU (CUDA graphs); using static")
                    gc = generation_config
                    step_mode = {"static": "eager"}.get(backend, backend) if device.type == "cuda" else "eager"
                    new, new_logprobs = static_cache_generate(
                        model, ids, mask, gc.max_new_tokens, gc.temperature, gc.top_p or 1.0, gc.top_k or 0,
                        eos_token_ids, gc.pad_token_id, step_mode=step_mode, return_logprobs=True,
                        prefill_chunk_size=prefill_chunk_size, kv_cache_dtype=kv_cache_dtype,
                        share_prompt_cache=share_prompt_cache)
                slices.append((new.to(prompt_ids.device), new_logprobs.float().to(prompt_ids.device)))
    finally:
        model.train(was_training)
        if from_copy:
            restore_merged_base(policy)  # --generation_copy_in_place: the exact base back before any training pass
        if not keep_decoder:
            model.__dict__.pop("_lean_rl_decoder", None)
            policy.__dict__.pop("_lean_rl_generation_copy", None)
    # slices stop when their own rows finish: padded on the right to the widest
    completion_ids = pad_cat([ids for ids, _ in slices], value=pad)
    sampling_logprobs = pad_cat([lp for _, lp in slices])
    if order is not None:
        back = order.argsort().to(completion_ids.device)
        completion_ids, sampling_logprobs = completion_ids[back], sampling_logprobs[back]
    completion_ids, completion_mask, is_truncated = completion_ids_and_mask(completion_ids, eos_token_ids, pad)
    if not return_logprobs:
        return completion_ids, completion_mask, is_truncated
    return completion_ids, completion_mask, is_truncated, sampling_logprobs * completion_mask


class _SampledLogprobs:
    """A logits processor for `generate` that records each sampled token's logprob under
    softmax(logits / temperature). generate runs the processors it is given before its own
    temperature, top-k and top-p warpers, so this one sees the model's raw float32 logits of each
    step; the token drawn from them is known at the next call (the last column of input_ids), or,
    for the last one, from generate's output (finish). Holds one step's [B, V] scaled logits, not
    all of them (output_logits=True would keep max_new_tokens x [B, V] floats: 40 GB at qwen2.5's
    vocabulary, 128 rows, 512 tokens)."""

    def __init__(self, temperature):
        self.temperature = temperature
        self.logprobs, self.pending = [], None

    def _take(self, token):
        scaled, lse = self.pending
        return scaled.gather(-1, token[:, None].to(scaled.device)).squeeze(-1) - lse

    def __call__(self, input_ids, scores):
        if self.pending is not None:
            self.logprobs.append(self._take(input_ids[:, -1]))
        scaled = scores.float() / self.temperature  # [B, V]
        self.pending = (scaled, torch.logsumexp(scaled, dim=-1))
        return scores

    def finish(self, new_tokens):
        """new_tokens [B, N] (generate's output after the prompt) -> their logprobs [B, N]; steps
        generate ran and then undid (its deferred stop checks) are dropped."""
        n = new_tokens.shape[1]
        if len(self.logprobs) < n:
            self.logprobs.append(self._take(new_tokens[:, -1]))
        self.pending = None
        return torch.stack(self.logprobs[:n], dim=1)


@torch.no_grad()
def generation_copy(policy, dtype="bfloat16", in_place=False):
    """--generation_copy: a plain bf16 model of the policy's architecture, on the policy's input
    device, kept with the policy and refreshed in place before each rollout (fixed addresses, so a
    captured decoding graph stays valid): LoRA adapters merged into their base weights (W + the
    adapter's delta, peft's get_delta_weight), 4-bit and 8-bit weights dequantised (peft's
    dequantize_module_weight), everything else cast. Generation then reads full bf16 matrices once
    per step instead of dequantising 4-bit blocks or adding the adapter's path at every layer,
    and runs in bf16 throughout; the training forward keeps its own numerics. Costs one bf16 copy
    of the model's weights in memory. dtype int8 (--generation_copy_dtype): every Linear of the copy
    (the LM head too) holds the merged weight as int8 codes with a bf16 scale per output row
    (utils.int8.Int8Linear), the embedding and norms stay bf16: about half the bytes. Either copy is
    built on the meta device and only the tensors it holds of its own are then made on the device, so
    building it never holds more than the copy (the int8 copy: never a bf16 copy; its buffers, RoPE's
    frequencies, are the policy's).

    A parameter the copy would only copy (a module without an adapter whose tensor is already a plain
    bf16 tensor on the copy's device: QLoRA's embedding, norms and LM head, every weight of a
    --torch_dtype bfloat16 policy) is the policy's own storage instead, so the copy costs nothing for it
    (7b QLoRA: 1.0 GiB for the embedding, 1.0 more for the LM head of a bf16 copy); an optimizer step on
    the policy is then seen as it happens, which is what a refresh would copy. Such storage must stay put
    (a captured graph reads its address): a later call refuses to go on if it moved.

    in_place (--generation_copy_in_place; LoRA on a bf16 base on the copy's device): the adapted modules'
    weights are shared too, so the copy holds no weight of its own (7b: 15.2 GB less than a bf16 copy). Each
    refresh writes W + delta into the base's own storage (the bf16 copy's numerics exactly) after keeping the
    exact base once in CPU memory (pinned on a GPU: 13 GiB at 7b); restore_merged_base puts it back, bit for
    bit, after the rollout (generate_completions does, also when the rollout fails).

    With FUSE_PROJECTIONS (the default), projections of one input that the copy holds in its own
    storage (q/k/v, gate/up) become one product (_fuse_projections): one matrix product per group and decoding
    step instead of three or two small ones."""
    from copy import deepcopy

    from transformers import AutoModelForCausalLM
    from peft.utils.integrations import dequantize_module_weight

    from utils.int8 import Int8Linear

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    sources = dict(base.named_modules())
    copy = policy.__dict__.get("_lean_rl_generation_copy")
    if in_place and dtype != "bfloat16":
        raise ValueError("an in-place generation copy is bf16: the int8 copy holds codes of its own")
    if policy.__dict__.get("_lean_rl_merged"):
        raise RuntimeError("the policy's base still holds the merged adapters of the last rollout (restore_merged_base "
                           "was not called); merging again would add the adapters twice")
    if copy is None:
        config = deepcopy(base.config)
        config.__dict__.pop("quantization_config", None)
        device = model_input_device(policy)
        # on the meta device, then only the tensors the copy holds of its own made on the device: built there
        # whole, a bf16 copy held all of its weights until the policy's own replaced them (7b: 15.2 GB for a
        # moment at each rollout with --empty_cache_between_phases, which builds the copy again every time).
        # No weight initialisation: every parameter is overwritten below (initialising a 1.5b model took 30.5 s
        # on a 2-core CPU); the buffers, e.g. RoPE's, are the policy's
        with torch.device("meta"), _no_init_weights():
            copy = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if dtype == "int8":
            _materialise_int8(copy, sources, device)
        else:  # every tensor the policy's where it can be (in place: the adapted bases too); the rest made here
            _materialise(copy, sources, device, in_place)
        _share_policy_tensors(copy, sources, device, in_place)
        if dtype == "bfloat16" and FUSE_PROJECTIONS:
            _fuse_projections(copy)
        copy.eval().requires_grad_(False)
        policy.__dict__["_lean_rl_generation_copy"] = copy  # not a submodule: outside state_dict and optimizer

    def merged_weight(source, layer):  # [out, in]: the dequantised base weight, + each active adapter's delta
        value = dequantize_module_weight(layer)
        if layer is not source:  # float32 sums (no float32 copy of unadapted weights: 2 GiB for 7b's LM head)
            value = value.to(torch.float32)
            for adapter in source.active_adapters:
                if adapter in source.lora_A:
                    value = value + source.get_delta_weight(adapter).to(torch.float32)
        return value

    merges = []  # in place: (the copy's parameter = the base's storage, its module in the policy, the layer)
    for name, module in copy.named_modules():
        own = dict(module.named_parameters(recurse=False))
        if not own and not isinstance(module, Int8Linear):
            continue
        source = sources[name]
        # the module under peft's LoRA wrapper, or the module itself
        layer = source.base_layer if hasattr(source, "base_layer") and hasattr(source, "lora_A") else source
        if isinstance(module, Int8Linear):
            module.refresh(merged_weight(source, layer), getattr(layer, "bias", None))
            continue
        for pname, param in own.items():
            if pname in getattr(module, "_lean_rl_shared", ()):
                if param.data_ptr() != getattr(layer, pname).data_ptr():
                    raise RuntimeError(f"the generation copy holds the policy's own {name}.{pname}, whose storage "
                                       "has moved since (a captured decoding step would read the old address)")
                if pname == "weight" and layer is not source:  # an adapted base shared: only in place
                    merges.append((name, param, source, layer))
                continue
            param.copy_(merged_weight(source, layer) if pname == "weight" and hasattr(layer, "weight")
                        else getattr(layer, pname))
    if merges:
        backups = policy.__dict__.setdefault("_lean_rl_base_backup", {})  # the exact frozen base, kept once
        merged = []
        for name, param, source, layer in merges:
            if name not in backups:
                backups[name] = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=param.is_cuda)
                backups[name].copy_(param)
            policy.__dict__["_lean_rl_merged"] = merged  # before the first write: a failure restores what was written
            value = merged_weight(source, layer)  # float32, a new tensor (read from the base before it is written)
            merged.append((param, backups[name]))  # before its write: restoring an unwritten tensor is harmless
            param.copy_(value)
    return copy


@torch.no_grad()
def restore_merged_base(policy):
    """After an in-place generation copy's rollout: the exact base weights back from their CPU copy (a
    no-op when nothing is merged). Asynchronous from pinned memory, ordered before the next pass on the stream."""
    for param, backup in policy.__dict__.pop("_lean_rl_merged", None) or ():
        param.copy_(backup, non_blocking=param.is_cuda)


def _shareable(source, pname, shape, device, in_place=False):
    """The policy's tensor for the copy's parameter `pname` of `source`'s module when the copy may hold it
    as it is (no adapter on the module, a plain bf16 tensor of `shape` on the copy's `device`), else None.
    in_place: an adapted module's base tensor too (its weight then merged in place at each refresh)."""
    if hasattr(source, "lora_A") or hasattr(source, "base_layer"):
        if not (in_place and hasattr(source, "lora_A") and hasattr(source, "base_layer")):
            return None
        source = source.base_layer
    tensor = source._parameters.get(pname)
    if (tensor is None or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or type(tensor.data) is not torch.Tensor
            or tensor.dtype != torch.bfloat16):
        return None  # quantised (bitsandbytes' Params4bit, Int8Params), a DTensor shard, float32, or absent
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return tensor if tensor.shape == shape and tensor.device == device else None


def _share_policy_tensors(copy, sources, device, in_place=False):
    """Each of the copy's parameters that _shareable finds becomes the policy's storage (a new Parameter
    over it, so requires_grad_ on the copy leaves the policy's alone); the module remembers which."""
    for name, module in copy.named_modules():
        for pname, param in list(module._parameters.items()):
            tensor = None if param is None else _shareable(sources[name], pname, param.shape, device, in_place)
            if tensor is not None:
                module._parameters[pname] = torch.nn.Parameter(tensor.detach(), requires_grad=False)
                module._lean_rl_shared = getattr(module, "_lean_rl_shared", ()) + (pname,)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Llama, Qwen2, Mistral names
FUSE_PROJECTIONS = True  # H100, 1.5b fp32 copy, 128 rows: 3.84 -> 3.48 ms per decoding step (benchmarks/decode_step.py)
# inputs of more tokens than this (a prefill) take each projection's own product: the fused product of a 128 x 256
# prefill held gate's and up's outputs as one tensor until both were used, 0.55 GiB more at 1.5b (H100, the budget
# row's generate phase: 13.85 -> 14.40 GiB allocated); decoding steps (one token a row) are where fusing pays
FUSE_MAX_TOKENS = 1024


class _Stash:
    """A fused group's input and product, from its first projection's call to its last one's."""
    input = output = None


class _GroupFirst(torch.nn.Linear):
    """The first projection of a fused group: the product of the input with the whole group's weight (its rows
    are the group's weights one after the other: each projection's weight is a view of it), kept for the others;
    returns its own columns."""

    def forward(self, x):
        if x.numel() > FUSE_MAX_TOKENS * self.in_features:  # a prefill: its own product, as unfused
            self._lean_rl_stash.input = self._lean_rl_stash.output = None  # nothing stale for the others
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = torch.nn.functional.linear(x, self._lean_rl_group_weight, self._lean_rl_group_bias)
        self._lean_rl_stash.input, self._lean_rl_stash.output = x, out
        return out[..., :self.out_features]


class _GroupNext(torch.nn.Linear):
    """A later projection of a fused group: its columns of the first projection's product of the same input."""

    def forward(self, x):
        stash = self._lean_rl_stash
        if stash.input is None and x.numel() > FUSE_MAX_TOKENS * self.in_features:  # a prefill, as the first
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if stash.input is not x:
            raise RuntimeError("a fused projection of the generation copy was called before its group's first "
                               f"({type(self).__name__} on another input): this model calls its projections in "
                               "another order; please report it (the copy's FUSED_GROUPS assume q, k, v and gate, up)")
        out = stash.output[..., self._lean_rl_start:self._lean_rl_start + self.out_features]
        if self._lean_rl_last:
            stash.input = stash.output = None
        return out


def _fuse_projections(copy):
    """Each FUSED_GROUPS group of a module of the copy (plain bf16 Linears of one input size, each holding
    storage of the copy's own, none the policy's) -> one [sum of outputs, input] weight whose row blocks are
    the projections' weights (views: generation_copy's refresh writes each as before) and one product per call:
    decoding at 128 rows, q/k/v were three small products per layer (0.45 ms of a 1.5b step's 3.07 ms of
    kernels on an H200, 2026-12-03) and gate/up two. The same products, column for column (up to the matrix
    kernel's summation order). The group's weight is the projections' own storage where _materialise laid them out
    one after the other (no memory of its own); else (a size off FLAT_ALIGN, a bias of the policy's) a new tensor.
    Inputs of more than FUSE_MAX_TOKENS tokens (prefills) take each projection's own product."""
    for module in copy.modules():
        for names in FUSED_GROUPS:
            group = [getattr(module, name, None) for name in names]
            if not all(type(p) is torch.nn.Linear for p in group):
                continue
            if any("weight" in getattr(p, "_lean_rl_shared", ()) for p in group):
                continue  # the policy's own storage: a fused copy would cost memory
            has_bias = group[0].bias is not None
            if (len({p.in_features for p in group}) != 1 or any((p.bias is not None) != has_bias for p in group)
                    or len({(p.weight.dtype, p.weight.device) for p in group}) != 1):
                continue
            weight = _joined([p.weight.detach() for p in group])  # [sum of outputs, in]
            bias = _joined([p.bias.detach() for p in group]) if has_bias else None
            stash, start = _Stash(), 0
            for i, p in enumerate(group):
                # a bias that was the policy's (LoRA on a bf16 base adapts the weight only) becomes the copy's own
                # rows of the fused bias, written at each refresh like the weight
                if "bias" in getattr(p, "_lean_rl_shared", ()):
                    p._lean_rl_shared = tuple(n for n in p._lean_rl_shared if n != "bias")
                end = start + p.out_features
                p.weight = torch.nn.Parameter(weight[start:end], requires_grad=False)
                if has_bias:
                    p.bias = torch.nn.Parameter(bias[start:end], requires_grad=False)
                p._lean_rl_stash = stash
                if i == 0:
                    p.__class__ = _GroupFirst
                    # plain attributes, outside parameters and buffers (the copy's refresh and state_dict see
                    # each projection's own view only)
                    p.__dict__["_lean_rl_group_weight"], p.__dict__["_lean_rl_group_bias"] = weight, bias
                else:
                    p.__class__ = _GroupNext
                    p._lean_rl_start, p._lean_rl_last = start, i == len(group) - 1
                start = end


def _materialise_int8(copy, sources, device):
    """A copy built on the meta device -> every Linear an Int8Linear on `device`, the rest as _materialise."""
    from utils.int8 import Int8Linear

    for name, module in list(copy.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(module, child_name, Int8Linear(child.in_features, child.out_features, child.bias is not None,
                                                       device=device))
    _materialise(copy, sources, device)


def _materialise(copy, sources, device, in_place=False):
    """The meta parameters of a copy built on the meta device -> empty tensors on `device` (filled by
    generation_copy; those the copy will hold as the policy's own, _shareable's, left on the meta device until
    _share_policy_tensors), the buffers the policy's. Parameters that are one tensor in the policy (an LM head
    tied to the embedding), neither adapted, are one tensor in the copy too: a copy built without weight
    initialisation is not tied, and held a tied 1.5b's embedding twice (0.47 GB).

    The tensors made are views of one flat allocation per dtype and rank, in the modules' order, each
    starting at a multiple of FLAT_ALIGN elements: one allocation instead of one per tensor (338 at 1.5b,
    ~27 ms of a rollout's start when --empty_cache_between_phases hands the memory back, H200 profile
    2026-12-06), and a fused group's projections (q, k, v; gate, up), one after the other there, are one
    tensor without a copy (_joined)."""
    made, todo = {}, []  # id of the policy's tensor -> the copy's (meta) parameter; each parameter to make, once
    for name, module in copy.named_modules():
        source = sources[name]
        for pname, param in list(module._parameters.items()):
            if param is None or not param.is_meta or _shareable(source, pname, param.shape, device, in_place) is not None:
                continue
            tensor = None if hasattr(source, "lora_A") else source._parameters.get(pname)
            if tensor is None or id(tensor) not in made or made[id(tensor)].shape != param.shape:
                made[id(tensor)] = param  # meta for now
                todo.append(param)
            module._parameters[pname] = made[id(tensor)]
    flat, offsets = {}, []  # (dtype, matrix?) -> elements so far; each tensor's offset there
    for param in todo:
        key = (param.dtype, param.dim() > 1)
        offsets.append(flat.get(key, 0))
        flat[key] = offsets[-1] + -(-param.numel() // FLAT_ALIGN) * FLAT_ALIGN
    flat = {key: torch.empty(size, dtype=key[0], device=device) for key, size in flat.items()}
    real = {}  # meta parameter -> its view of the flat allocation
    for param, offset in zip(todo, offsets):
        view = flat[(param.dtype, param.dim() > 1)][offset:offset + param.numel()].view(param.shape)
        real[id(param)] = torch.nn.Parameter(view, requires_grad=False)
    for name, module in copy.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and id(param) in real:
                module._parameters[pname] = real[id(param)]
        for bname, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[bname] = sources[name]._buffers[bname].detach().clone().to(device)


FLAT_ALIGN = 64  # elements (128 bytes in bf16): each of the copy's own tensors starts aligned in its flat allocation


def _joined(tensors):
    """The concatenation of `tensors` (of one shape but the first dimension) along their first dimension: a view of
    their storage when they lie one after the other in it, as _materialise lays out a group's projections (no copy),
    else a new tensor (torch.cat)."""
    first, end = tensors[0], tensors[0].storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != end or t.shape[1:] != first.shape[1:]):
            return torch.cat(tensors)
        end += t.numel()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _no_init_weights():
    """transformers' no_init_weights (transformers.initialization in 5.x, modeling_utils before)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


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
