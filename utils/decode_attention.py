"""Attention of one decoding step over the static KV cache, in a Triton kernel that reads only the positions
the step can see (utils/generation.py's packed_gqa_attention calls it on a CUDA GPU; elsewhere, or without
Triton, torch's SDPA runs as before).

A static cache holds every row's keys and values at all `cache_len` positions (the prompt, the tokens so far
and the empty rest); SDPA with the step's mask reads all of them: at the W-GRPO workload's 768 positions a
rollout's mean step needs 512. Here one program per (row, key/value head) takes the query heads that share
that key/value head as the rows of a small matrix product (grouped-query attention read as it is stored),
finds the first and last position its mask keeps, and streams only the blocks between them with an online
softmax in float32. Where (rows x key/value heads) programs are too few to keep every multiprocessor reading
(qwen2.5-1.5b's 2 key/value heads: 256 programs at 128 rows on 132 multiprocessors), the kept positions are
split into `splits` parts, one program each (flash-decoding's split), whose float32 partial maxima, sums and
outputs a second kernel combines in a fixed order: deterministic, and the same softmax up to float32
summation order. The probabilities are rounded to the values' dtype before their product with the values, as
flash attention does: the same numbers as SDPA up to bf16 rounding and summation order (tests/gpu checks them
against SDPA, split and unsplit).
"""
import torch

from utils.base import defined_once

BLOCK_N, NUM_WARPS, NUM_STAGES = 32, 4, 3  # positions per loop step, and the launch: the fastest of 18 at 7b
# (H200, 2026-12-02, tests/gpu: 37.9 us a layer against 46.4 with blocks of 64; SDPA 84.5)
PROGRAMS_PER_SM = 4  # split the positions until (rows x key/value heads x splits) reaches this many per SM
MAX_SPLITS = 1  # 1: unsplit. Splitting lost wherever measured (H100, 2026-12-05, 128 rows: 1.5b 29.3 us a layer
# unsplit, 31.9-38.2 split 2-8 ways; README, decoding attention); benchmarks/decode_step.py --attention_splits 8
_READY = []
_SMS = []  # the GPU's multiprocessor count, read once
LAUNCH = []  # launch(query, key, value, keep, scale, block_n, num_warps, num_stages, splits) once the kernel is defined


def ready():
    """Whether the kernel and its op are defined (Triton importable); defined at first use."""
    return defined_once(_READY, _define_kernel)


def decode_attention(query, key, value, keep, scale):
    """query [B, Hkv, G, D] (the G query heads of each key/value head), key and value [B, Hkv, L, D], keep
    [B, L] bool (the positions each row attends to) -> [B, Hkv, G, D] in the query's dtype."""
    return torch.ops.lean_rl.decode_attention(query, key, value, keep, float(scale))


def decode_attention_shared(query, prompt_key, prompt_value, prompt_keep, prompt_row, key, value, keep, scale):
    """--share_prompt_cache: query [B, Hkv, G, D] over two parts of the cache in one softmax: the prompt part,
    prompt_key and prompt_value [U, Hkv, Lp, D] with prompt_keep [U, Lp] bool, of which row b reads row
    prompt_row[b] ([B] int64), and the completion part, key and value [B, Hkv, L, D] with keep [B, L] bool, its own
    -> [B, Hkv, G, D] in the query's dtype. Each part is one program per (row, key/value head) as above, their
    float32 partial softmaxes combined in a fixed order (as splits are): the same numbers as decode_attention over
    the two parts laid end to end, up to float32 summation order."""
    return torch.ops.lean_rl.decode_attention_shared(query, prompt_key, prompt_value, prompt_keep, prompt_row, key,
                                                     value, keep, float(scale))


def default_splits(programs, device):
    """How many parts each (row, key/value head)'s positions are split into: doubled until the programs reach
    PROGRAMS_PER_SM per multiprocessor, at most MAX_SPLITS (1 where there are that many already)."""
    if not _SMS:
        _SMS.append(torch.cuda.get_device_properties(device).multi_processor_count)
    splits = 1
    while programs * splits < PROGRAMS_PER_SM * _SMS[0] and splits < MAX_SPLITS:
        splits *= 2
    return splits


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, keep_ptr, row_ptr, o_ptr, m_ptr, l_ptr, L, scale, part0,
                                sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b, skeep_l,
                                so_b, so_h, so_g, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                                L_POW2: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                                PARTS: tl.constexpr, HAS_ROWS: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        if HAS_ROWS:  # --share_prompt_cache's prompt part: query row b reads the keys, values and mask of row_ptr[b]
            kb = tl.load(row_ptr + b)
        else:
            kb = b
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
        # the first and last position this row keeps: only the blocks between them are read
        every = tl.arange(0, L_POW2)
        kept = tl.load(keep_ptr + kb * skeep_b + every * skeep_l, mask=every < L, other=0) != 0
        end = tl.max(tl.where(kept, every, -1), axis=0) + 1
        first = tl.min(tl.where(kept, every, L_POW2), axis=0)
        begin = (first // BLOCK) * BLOCK
        if SPLITS > 1:  # this program's share of the kept blocks (an empty share leaves m -inf, l 0)
            per = tl.cdiv(tl.cdiv(tl.maximum(end - begin, 0), BLOCK), SPLITS) * BLOCK
            begin = begin + tl.program_id(2) * per
            end = tl.minimum(begin + per, end)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for start in range(begin, end, BLOCK):
            pos = start + n
            inside = pos < end
            keep = (tl.load(keep_ptr + kb * skeep_b + pos * skeep_l, mask=inside, other=0) != 0) & inside
            k = tl.load(k_ptr + kb * sk_b + h * sk_h + pos[:, None] * sk_l + d[None, :], mask=inside[:, None],
                        other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, BLOCK] float32
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing kept yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kb * sv_b + h * sv_h + pos[:, None] * sv_l + d[None, :], mask=inside[:, None],
                        other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if PARTS == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=g[:, None] < G)
        else:  # float32 partials [B, Hkv, PARTS, G_PAD] (m, l) and [B, Hkv, PARTS, G_PAD, D] (acc), unnormalised;
            # this program's part: its split, after part0 parts written by other launches (the prompt's, shared)
            part = (b * tl.num_programs(1) + h) * PARTS + part0 + tl.program_id(2)
            tl.store(m_ptr + part * G_PAD + g, m_i)
            tl.store(l_ptr + part * G_PAD + g, l_i)
            tl.store(o_ptr + (part * G_PAD + g[:, None]) * D + d[None, :], acc)

    @triton.jit
    def decode_attention_combine(part_ptr, m_ptr, l_ptr, o_ptr, so_b, so_h, so_g,
                                 G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
        # the splits' partial softmaxes rescaled to their common maximum and added, in split order
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        first = (b * tl.num_programs(1) + h) * SPLITS
        m_max = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            m_max = tl.maximum(m_max, tl.load(m_ptr + (first + s) * G_PAD + g))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        l_sum = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            weight = tl.exp(tl.load(m_ptr + (first + s) * G_PAD + g) - m_safe)  # an empty split: exp(-inf) = 0
            l_sum += weight * tl.load(l_ptr + (first + s) * G_PAD + g)
            acc += weight[:, None] * tl.load(part_ptr + ((first + s) * G_PAD + g[:, None]) * D + d[None, :])
        out = acc / l_sum[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g[:, None] < G)

    def launch(query, key, value, keep, scale, block=None, num_warps=None, num_stages=None, splits=None):
        batch, heads, groups, dim = query.shape
        length = key.shape[2]
        block = block or BLOCK_N
        splits = min(splits or default_splits(batch * heads, query.device), max(1, length // block))
        g_pad = max(16, triton.next_power_of_2(groups))
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if splits > 1:
            partial = torch.empty((batch, heads, splits, g_pad, dim), dtype=torch.float32, device=query.device)
            maxima = torch.empty((batch, heads, splits, g_pad), dtype=torch.float32, device=query.device)
            sums = torch.empty_like(maxima)
        else:
            partial, maxima, sums = out, out, out  # unused
        decode_attention_kernel[(batch, heads, splits)](
            query, key, value, keep, keep, partial, maxima, sums, length, scale, 0,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), keep.stride(0), keep.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            G=groups, G_PAD=g_pad, D=dim, L_POW2=triton.next_power_of_2(length), BLOCK=block, SPLITS=splits,
            PARTS=splits, HAS_ROWS=False, num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES)
        if splits > 1:
            decode_attention_combine[(batch, heads)](partial, maxima, sums, out, out.stride(0), out.stride(1),
                                                     out.stride(2), G=groups, G_PAD=g_pad, D=dim, SPLITS=splits,
                                                     num_warps=4)
        return out

    LAUNCH.append(launch)

    def launch_shared(query, prompt_key, prompt_value, prompt_keep, prompt_row, key, value, keep, scale):
        # --share_prompt_cache: the prompt part (row b reads prompt row prompt_row[b]) and the completion part (row b
        # its own), each one part of the softmax, combined as two splits are (in that order)
        batch, heads, groups, dim = query.shape
        g_pad = max(16, triton.next_power_of_2(groups))
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        partial = torch.empty((batch, heads, 2, g_pad, dim), dtype=torch.float32, device=query.device)
        maxima = torch.empty((batch, heads, 2, g_pad), dtype=torch.float32, device=query.device)
        sums = torch.empty_like(maxima)
        for part, (k, v, kp, rows) in enumerate(((prompt_key, prompt_value, prompt_keep, prompt_row),
                                                 (key, value, keep, None))):
            decode_attention_kernel[(batch, heads, 1)](
                query, k, v, kp, kp if rows is None else rows, partial, maxima, sums, k.shape[2], scale, part,
                query.stride(0), query.stride(1), query.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), kp.stride(0), kp.stride(1), 0, 0, 0,
                G=groups, G_PAD=g_pad, D=dim, L_POW2=triton.next_power_of_2(k.shape[2]), BLOCK=BLOCK_N, SPLITS=1,
                PARTS=2, HAS_ROWS=rows is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        decode_attention_combine[(batch, heads)](partial, maxima, sums, out, out.stride(0), out.stride(1),
                                                 out.stride(2), G=groups, G_PAD=g_pad, D=dim, SPLITS=2, num_warps=4)
        return out

    @torch.library.custom_op("lean_rl::decode_attention", mutates_args=())
    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
           scale: float) -> torch.Tensor:
        with torch.cuda.device(query.device):  # Triton launches on the current device: make it the query's
            return launch(query, key, value, keep.view(torch.uint8), scale)  # viewed here: inductor cannot lower it

    @op.register_fake
    def _(query, key, value, keep, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    @torch.library.custom_op("lean_rl::decode_attention_shared", mutates_args=())
    def shared_op(query: torch.Tensor, prompt_key: torch.Tensor, prompt_value: torch.Tensor, prompt_keep: torch.Tensor,
                  prompt_row: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
                  scale: float) -> torch.Tensor:
        with torch.cuda.device(query.device):
            return launch_shared(query, prompt_key, prompt_value, prompt_keep.view(torch.uint8), prompt_row, key,
                                 value, keep.view(torch.uint8), scale)

    @shared_op.register_fake
    def _(query, prompt_key, prompt_value, prompt_keep, prompt_row, key, value, keep, scale):
        return torch.empty_like(query, memory_format=torch.contiguous_format)


def usable(query, key, attention_mask):
    """Whether decode_attention can take this call: bf16 or fp16 CUDA tensors (float32 stays with SDPA, whose
    products are not TF32), a head size of 16-256 that is a power of two, a boolean mask of one row per batch
    row over the cache's positions, and Triton."""
    dim = query.shape[-1]
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.dtype == query.dtype
            and attention_mask is not None and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1
            and attention_mask.shape[3] == key.shape[2] and 16 <= dim <= 256 and dim & (dim - 1) == 0
            and ready())

