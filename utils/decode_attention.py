"""Attention of one decoding step over the static KV cache, in a Triton kernel that reads only the positions
the step can see (utils/generation.py's packed_gqa_attention calls it on a CUDA GPU; elsewhere, or without
Triton, torch's SDPA runs as before).

A static cache holds every row's keys and values at all `cache_len` positions (the prompt, the tokens so far
and the empty rest); SDPA with the step's mask reads all of them: at the W-GRPO workload's 768 positions a
rollout's mean step needs 512. Here one program per (row, key/value head) takes the query heads that share
that key/value head as the rows of a small matrix product (grouped-query attention read as it is stored),
finds the first and last position its mask keeps, and streams only the blocks between them with an online
softmax in float32 (flash-decoding's arithmetic without its split of the positions: at 64-128 rows and 2-4
key/value heads there are 128-512 programs, enough to fill the GPU). The probabilities are rounded to the
values' dtype before their product with the values, as flash attention does: the same numbers as SDPA up to
bf16 rounding and summation order (tests/gpu checks them against SDPA).
"""
import torch

BLOCK_N, NUM_WARPS, NUM_STAGES = 32, 4, 3  # positions per loop step, and the launch: the fastest of 18 at 7b
# (H200, 2026-12-02, tests/gpu: 37.9 us a layer against 46.4 with blocks of 64; SDPA 84.5)
_READY = []
LAUNCH = []  # launch(query, key, value, keep, scale, block_n, num_warps, num_stages) once the kernel is defined


def ready():
    """Whether the kernel and its op are defined (Triton importable); defined at first use."""
    if not _READY:
        try:
            _define_kernel()
            _READY.append(True)
        except ImportError:
            _READY.append(False)
    return _READY[0]


def decode_attention(query, key, value, keep, scale):
    """query [B, Hkv, G, D] (the G query heads of each key/value head), key and value [B, Hkv, L, D], keep
    [B, L] bool (the positions each row attends to) -> [B, Hkv, G, D] in the query's dtype."""
    return torch.ops.lean_rl.decode_attention(query, key, value, keep, float(scale))


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(q_ptr, k_ptr, v_ptr, keep_ptr, o_ptr, L, scale,
               sq_b, sq_h, sq_g, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, skeep_b, skeep_l, so_b, so_h, so_g,
               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, L_POW2: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        n = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=g[:, None] < G, other=0.0)
        # the first and last position this row keeps: only the blocks between them are read
        every = tl.arange(0, L_POW2)
        kept = tl.load(keep_ptr + b * skeep_b + every * skeep_l, mask=every < L, other=0) != 0
        end = tl.max(tl.where(kept, every, -1), axis=0) + 1
        first = tl.min(tl.where(kept, every, L_POW2), axis=0)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for start in range((first // BLOCK) * BLOCK, end, BLOCK):
            pos = start + n
            inside = pos < end
            keep = (tl.load(keep_ptr + b * skeep_b + pos * skeep_l, mask=inside, other=0) != 0) & inside
            k = tl.load(k_ptr + b * sk_b + h * sk_h + pos[:, None] * sk_l + d[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, BLOCK] float32
            s = tl.where(keep[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing kept yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * sv_b + h * sv_h + pos[:, None] * sv_l + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=g[:, None] < G)

    def launch(query, key, value, keep, scale, block=None, num_warps=None, num_stages=None):
        batch, heads, groups, dim = query.shape
        length = key.shape[2]
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        kernel[(batch, heads)](
            query, key, value, keep, out, length, scale,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), keep.stride(0), keep.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            G=groups, G_PAD=max(16, triton.next_power_of_2(groups)), D=dim, L_POW2=triton.next_power_of_2(length),
            BLOCK=block or BLOCK_N, num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES)
        return out

    LAUNCH.append(launch)

    @torch.library.custom_op("lean_rl::decode_attention", mutates_args=())
    def op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
           scale: float) -> torch.Tensor:
        return launch(query, key, value, keep.view(torch.uint8), scale)  # viewed here: inductor cannot lower it

    @op.register_fake
    def _(query, key, value, keep, scale):
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

