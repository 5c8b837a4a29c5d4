"""QLoRA's NF4 weights multiplied where they lie: a Triton kernel that reads bitsandbytes' packed 4-bit codes and
their double-quantised block statistics (what `--load_in_4bit` stores: nf4, blocks of 64, nested absmax in blocks
of 256) and converts them to bf16 inside the matrix product, for the decoding steps' few rows (up to 128).

bitsandbytes' own 4-bit product converts the whole matrix to bf16 in memory first for more than one row (a 7b
decoding step at 64 rows took about 25 ms there, in the 7b QLoRA 12GB budget row: 25.5 s of generation); a bf16
or int8 generation copy avoids that but does not fit 12 GB. This kernel reads the 4-bit codes once per step, a
quarter of a bf16 copy's bytes, and needs no copy.

Measured slower than bitsandbytes, so off (DECODE_WITH_KERNEL). H100, 2026-12-06 (tests/gpu/test_gpu_nf4.py,
each product alone in a CUDA graph): a 7b decoding step's layer products at 64 rows took 36.1 ms through this
kernel, 14.2 ms through bitsandbytes (dequantise, then cuBLAS), 5.1 ms in bf16; at one row 18.4 against 3.7 ms
(bitsandbytes' own 4-bit GEMV). In the decoding loop (benchmarks/decode_step.py --shape qwen2.5-1.5b --dtypes qlora
--rows 64): 15.59 ms per step with the kernel, 8.09 without. Exact on the GPU too (within 1.1e-4 of bitsandbytes'
dequantised product at every split). Likely costs, not profiled: the two gathers from the 16-entry code per
byte, the absmax broadcast's reshape (a layout change through shared memory), and 56 programs for a 3584-wide
output at split 1 on 132 SMs. Since then, NOT yet measured on a GPU: each tile is worked one block of 64 columns at
a time, its absmax a plain broadcast (no reshape), and the code is looked up by a select tree over the nibble's
bits with NF4_CODE's constants (CODE_BY_TREE; the gather stays for a side-by-side: tests/gpu/test_gpu_nf4.py times
both). With it on, prepare_decoding (called before each rollout of a 4-bit model) makes
every nf4 layer's decoding products go through the kernel. The numbers: each weight is
bf16(code[nibble] * (code2[absmax_code] * absmax2[block // 256] + offset)) in float32, as bitsandbytes'
dequantize_4bit makes it (tests/test_nf4.py checks it bit for bit), so the product equals F.linear on
bitsandbytes' dequantised weight up to float32 summation order.
"""
import os

import torch
import torch.nn.functional as F

from utils.base import defined_once

KERNEL_MAX_ROWS = 128  # the Triton kernel's rows (decoding); larger products dequantise and use torch's matmul
# whether the rollouts of a 4-bit model decode through the kernel (prepare_decoding). Off: measured slower than
# bitsandbytes' own product (module docstring); benchmarks/decode_step.py --dtypes qlora --nf4_kernel, side by side
DECODE_WITH_KERNEL = False
# bitsandbytes' NF4 code (bnb.functional.get_4bit_type("nf4"), float32): the kernel's select tree holds these
# constants; nf4_parts checks a weight's code against them once
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0)
# the kernel's code lookup: a select tree over each 4-bit code's bits (True) or a gather from the 16-entry table
# (False, as measured on 2026-12-06). Not yet measured on a GPU: tests/gpu/test_gpu_nf4.py times both
CODE_BY_TREE = True


def nf4_parts(weight):
    """A bitsandbytes Params4bit (nf4, nested statistics, blocks of 64) as the tensors the product reads:
    dict(packed [N*K/2] uint8, absmax [N*K/64] uint8, absmax2 [ceil(N*K/64/256)] float32, code [16] float32,
    code2 [256] float32, offset [1] float32, shape (N, K)): views of the weight's own tensors (no copy, no GPU
    sync but the first call's check of the code table: the offset stays a tensor). Anything else (fp4, statistics
    not nested, other blocks, a code table other than NF4_CODE) is refused with a ValueError naming what differs."""
    state = weight.quant_state
    if state.quant_type != "nf4" or not state.nested or state.blocksize != 64 or state.state2.blocksize != 256:
        raise ValueError(f"nf4 kernel: needs nf4 weights with nested statistics in blocks of 64/256 (what "
                         f"--load_in_4bit stores); got {state.quant_type}, nested={state.nested}, blocksize "
                         f"{state.blocksize}")
    n, k = state.shape
    if k % 64:
        raise ValueError(f"nf4 kernel: the input size {k} is not a multiple of the block size 64")
    if not _CODE_CHECKED:  # the one GPU sync: bitsandbytes' code table is one for every layer
        if tuple(state.code.float().tolist()) != NF4_CODE:
            raise ValueError("nf4 kernel: this bitsandbytes' nf4 code differs from NF4_CODE, which the kernel holds")
        _CODE_CHECKED.append(True)
    return dict(packed=weight.data.view(-1), absmax=state.absmax, absmax2=state.state2.absmax.float(),
                code=state.code.float(), code2=state.state2.code.float(), offset=state.offset.float().reshape(1),
                shape=(int(n), int(k)))


def dequantize(parts, dtype=torch.bfloat16):
    """The [N, K] weight from nf4_parts' tensors with torch ops (no bitsandbytes call): high nibble first, each
    block of 64 scaled by its absmax, itself code2[absmax code] * absmax2[block // 256] + offset, in float32."""
    n, k = parts["shape"]
    packed = parts["packed"]
    nibbles = torch.stack([packed >> 4, packed & 15], dim=1).view(-1).long()  # [N*K]
    absmax = (parts["code2"][parts["absmax"].long()]
              * parts["absmax2"].repeat_interleave(256)[:parts["absmax"].numel()] + parts["offset"])  # [N*K/64]
    return (parts["code"][nibbles].view(-1, 64) * absmax[:, None]).view(n, k).to(dtype)


def nf4_linear(x, parts, bias=None):
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W the NF4 weight of `parts` (nf4_parts): the Triton
    kernel for up to KERNEL_MAX_ROWS rows on a CUDA GPU, else the weight dequantised and multiplied by torch."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and rows <= KERNEL_MAX_ROWS and _triton_ready():
        out = torch.ops.lean_rl.nf4_mm(x.reshape(rows, x.shape[-1]), parts["packed"], parts["absmax"],
                                       parts["absmax2"], parts["code"], parts["code2"], parts["offset"])
        out = out.reshape(*x.shape[:-1], -1)
        return out if bias is None else out + bias.to(x.dtype)
    return F.linear(x, dequantize(parts, x.dtype), None if bias is None else bias.to(x.dtype))


_CODE_CHECKED = []  # [True] once a weight's code table was found equal to NF4_CODE
_DECODING = {}  # bitsandbytes Linear4bit class -> its subclass that decodes through the kernel


def _decoding_class(cls):
    """`cls` (a bitsandbytes Linear4bit class) whose forward sends products of up to KERNEL_MAX_ROWS rows made
    without gradient on a CUDA GPU to the kernel (prepare_decoding's parts), in the layer's compute dtype as
    bitsandbytes' own forward; anything else (training passes, prefills, a CPU) to bitsandbytes."""
    if cls not in _DECODING:
        def forward(self, x):
            parts = getattr(self, "_lean_rl_nf4", None)
            if parts is None or not x.is_cuda or torch.is_grad_enabled() or x.numel() // x.shape[-1] > KERNEL_MAX_ROWS:
                return cls.forward(self, x)
            dtype = x.dtype
            return nf4_linear(x.to(self.compute_dtype or dtype), parts, self.bias).to(dtype)

        _DECODING[cls] = type(cls.__name__, (cls,), {"forward": forward})
    return _DECODING[cls]


def prepare_decoding(model):
    """With DECODE_WITH_KERNEL (and Triton), every nf4 Linear4bit of `model` on a CUDA GPU decodes through the
    kernel from now on (its class swapped for _decoding_class's), reading its own tensors (nf4_parts, looked up
    again wherever the weight has moved since). Called before each rollout; returns how many layers decode so
    (0: nothing changed)."""
    if not DECODE_WITH_KERNEL or not _triton_ready():
        return 0
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if not isinstance(module, bnb.nn.Linear4bit) or not module.weight.is_cuda:
            continue
        parts = module.__dict__.get("_lean_rl_nf4")
        if parts is None or parts["packed"].data_ptr() != module.weight.data_ptr():
            try:
                module.__dict__["_lean_rl_nf4"] = nf4_parts(module.weight)
            except ValueError:  # fp4, statistics not nested: bitsandbytes' own product
                continue
        if type(module) not in _DECODING.values():
            module.__class__ = _decoding_class(type(module))
        count += 1
    return count


_READY = []
LAUNCH = []  # launch(x, packed, absmax, absmax2, code, code2, offset, split) once the kernel is defined
_SPLITS = {}  # (block_m, N, K) -> the fastest split of K measured at the first call of that shape


def _triton_ready():
    """Whether the kernel and its op are defined (Triton importable); defined at first use."""
    return defined_once(_READY, _define_kernel)


def _define_kernel():
    import triton
    import triton.language as tl

    from utils.int8 import block_rows, chosen_split, split_output

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                                  (128, 128, 8, 4), (16, 256, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4)]]
    if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter (tests/test_nf4.py): nothing timed
        configs = configs[:1]

    def quick_bench(fn, quantiles):
        return triton.testing.do_bench(fn, warmup=3, rep=10, quantiles=quantiles)

    @triton.autotune(configs=configs, key=["BLOCK_M", "N", "K", "SPLIT_K", "TREE"], do_bench=quick_bench)
    @triton.jit
    def kernel(x_ptr, q_ptr, a_ptr, a2_ptr, code_ptr, code2_ptr, offset_ptr, y_ptr, M, N, K, K_PER_SPLIT, stride_xm,
               stride_ym, stride_ys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               SPLIT_K: tl.constexpr, TREE: tl.constexpr):
        # one program: all BLOCK_M rows of x against BLOCK_N rows of W over one split of K. W[n, k] is element
        # n*K + k of the flat weight, in byte (n*K + k) // 2 (high nibble first) and block of 64 (n*K + k) // 64,
        # whose absmax is double-quantised: code2[absmax code] * absmax2[block // 256] + offset. K and every split
        # and tile are multiples of 64, so each block of 64 columns is 32 consecutive bytes per row of W, each
        # loaded once: its high nibbles meet x's even columns, its low nibbles the odd ones (two products, no
        # interleaving). A tile of BLOCK_K columns is BLOCK_K // 64 such blocks, one after the other, each scaled by
        # its own absmax [1, BLOCK_N] (a broadcast, no reshape)
        GROUPS: tl.constexpr = BLOCK_K // 64
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rh = tl.arange(0, 32)
        row_start = rn[None, :].to(tl.int64) * K  # [1, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        offset = tl.load(offset_ptr)
        for k0 in range(k_start, k_end, BLOCK_K):
            for g in tl.static_range(GROUPS):
                kg = k0 + 64 * g
                even = kg + 2 * rh  # [32]: the even columns of this block
                x_rows = x_ptr + rm[:, None] * stride_xm + even[None, :]
                x_mask = (rm[:, None] < M) & (even[None, :] < k_end)
                x_even = tl.load(x_rows, mask=x_mask, other=0.0)
                x_odd = tl.load(x_rows + 1, mask=x_mask, other=0.0)
                w_mask = (rn[None, :] < N) & (even[:, None] < k_end)  # [32, BLOCK_N]
                byte = tl.load(q_ptr + (row_start + kg) // 2 + rh[:, None], mask=w_mask, other=0).to(tl.int32)
                block = (row_start + kg) // 64  # [1, BLOCK_N]
                s_mask = (rn[None, :] < N) & (kg + 0 * rn[None, :] < k_end)  # a tensor: the interpreter refuses
                # a mask made with a scalar comparison
                absmax_code = tl.load(a_ptr + block, mask=s_mask, other=0).to(tl.int32)
                absmax = (tl.load(code2_ptr + absmax_code) * tl.load(a2_ptr + block // 256, mask=s_mask, other=0.0)
                          + offset)  # [1, BLOCK_N]
                for half in tl.static_range(2):  # the high nibbles against x's even columns, the low ones the odd
                    if half == 0:
                        nibble = byte >> 4
                        x_half = x_even
                    else:
                        nibble = byte & 15
                        x_half = x_odd
                    if TREE:  # NF4_CODE[b3 b2 b1 b0] from constants, 15 selects (no memory access)
                        b0 = (nibble & 1) != 0
                        b1 = (nibble & 2) != 0
                        b2 = (nibble & 4) != 0
                        below = tl.where(b2,
                                         tl.where(b1, tl.where(b0, 0.0, -0.09105003625154495),
                                                  tl.where(b0, -0.18477343022823334, -0.28444138169288635)),
                                         tl.where(b1, tl.where(b0, -0.39491748809814453, -0.5250730514526367),
                                                  tl.where(b0, -0.6961928009986877, -1.0)))
                        above = tl.where(b2,
                                         tl.where(b1, tl.where(b0, 1.0, 0.7229568362236023),
                                                  tl.where(b0, 0.5626170039176941, 0.44070982933044434)),
                                         tl.where(b1, tl.where(b0, 0.33791524171829224, 0.24611230194568634),
                                                  tl.where(b0, 0.16093020141124725, 0.07958029955625534)))
                        value = tl.where((nibble & 8) != 0, above, below)
                    else:  # gathered from the weight's own 16-entry table, one load per element
                        value = tl.load(code_ptr + nibble)
                    acc += tl.dot(x_half, (value * absmax).to(x_half.dtype))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)

    def launch(x, packed, absmax, absmax2, code, code2, offset, split, tree=None):
        rows, k = x.shape
        n = packed.numel() * 2 // k
        k_per_split, split, out = split_output(x, n, split)
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)](
            x, packed, absmax, absmax2, code, code2, offset, out, rows, n, k, k_per_split, x.stride(0),
            out.stride(-2), out.stride(0) if split > 1 else 0, BLOCK_M=block_rows(rows), SPLIT_K=split,
            TREE=CODE_BY_TREE if tree is None else tree)
        return out if split == 1 else out.sum(0).to(x.dtype)

    LAUNCH.append(launch)

    @torch.library.custom_op("lean_rl::nf4_mm", mutates_args=())
    def nf4_mm(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax2: torch.Tensor,
               code: torch.Tensor, code2: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        args = (x, packed, absmax, absmax2, code, code2, offset)
        key = (block_rows(x.shape[0]), packed.numel() * 2 // x.shape[1], x.shape[1])
        return launch(*args, chosen_split(_SPLITS, key, x.device, lambda split: launch(*args, split)))

    @nf4_mm.register_fake
    def _(x, packed, absmax, absmax2, code, code2, offset):
        return x.new_empty(x.shape[0], packed.numel() * 2 // x.shape[1])
