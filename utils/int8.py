"""--generation_copy_dtype int8: Linear layers holding int8 weights with one bf16 scale per output row
(symmetric, weight-only: W ~= codes * scale, scale = max|W_row| / 127.5, codes = round(W / scale): the
quantisation torchao's Int8WeightOnlyConfig makes, tested against it). The rollouts' decoding steps (a few
to 128 rows) read the int8 codes once per step in a Triton kernel that converts them to bf16 inside the matrix
product; half the bytes of a bf16 copy. Elsewhere (larger products such as the prefill, a CPU, no
Triton) the codes are converted first and multiplied by torch: the same numbers up to summation order.

Measured on an H200 (torch 2.11, 2026-12-02, x [64-128, K] bf16, one 18944 x 3584 or 3584 x 18944
matrix, each replayed in a CUDA graph): bf16 F.linear 36-45 us; int8 codes converted then multiplied,
eager 217-223 us, torch.compile'd 92-99 us, max-autotune 96-106 us (inductor did not fuse the
conversion into the product); torchao 0.18's Int8WeightOnlyConfig under torch.compile 9.8-19.8 ms;
bitsandbytes 4-bit 121-128 us. Hence a kernel of our own for the decoding shapes.
"""
import torch
import torch.nn.functional as F

REFRESH_ROWS = 4096  # rows quantised at a time by Int8Linear.refresh
KERNEL_MAX_ROWS = 128  # the Triton kernel's rows (decoding); larger products convert and use torch's matmul


def quantize_rows(weight):
    """weight [N, K] -> (codes [N, K] int8, scale [N] bf16), torchao's symmetric int8 mapping per output
    row: the weight rounded to bf16, scale = bf16(max|w| / 127.5) (rows of zeros get scale 1) and
    codes = round(w / scale) clamped to [-128, 127]."""
    weight = weight.to(torch.bfloat16).float()
    scale = (weight.abs().amax(dim=1) / 127.5).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(weight / scale[:, None]).clamp_(-128, 127).to(torch.int8)
    return codes, scale.to(torch.bfloat16)


class Int8Linear(torch.nn.Module):
    """A Linear whose weight is int8 codes [out, in] and a bf16 scale [out] (buffers, so that a
    captured decoding graph reads them at fixed addresses and refresh() rewrites them in place); the
    bias, if any, in bf16. y = (x @ codes^T) * scale + bias, in x's dtype."""

    def __init__(self, in_features, out_features, bias, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("codes", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                       requires_grad=False) if bias else None

    @torch.no_grad()
    def refresh(self, weight, bias=None):
        """Quantise `weight` [out, in] into this layer's buffers (in place), REFRESH_ROWS rows at a time
        (float32 temporaries of a 7b LM head at once: 6 GiB); copy `bias`."""
        for start in range(0, self.out_features, REFRESH_ROWS):
            rows = slice(start, start + REFRESH_ROWS)
            self.codes[rows], self.scale[rows] = quantize_rows(weight[rows])
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias)

    def forward(self, x):
        return int8_linear(x, self.codes, self.scale, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def int8_linear(x, codes, scale, bias=None):
    """x [..., K] @ codes[N, K]^T * scale [N] (+ bias) -> [..., N] in x's dtype."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and rows <= KERNEL_MAX_ROWS and _triton_ready():
        out = torch.ops.lean_rl.int8_mm(x.reshape(rows, x.shape[-1]), codes, scale).reshape(*x.shape[:-1], -1)
    else:
        out = F.linear(x, codes.to(x.dtype)) * scale.to(x.dtype)
    return out if bias is None else out + bias.to(x.dtype)


_READY = []


def _triton_ready():
    """Whether the Triton kernel and its op are defined (Triton importable); defined at first use."""
    if not _READY:
        try:
            _define_kernel()
            _READY.append(True)
        except ImportError:
            _READY.append(False)
    return _READY[0]


def _define_kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                                  (128, 128, 8, 4), (16, 256, 4, 4), (32, 512, 8, 3), (64, 64, 4, 5)]]

    @triton.autotune(configs=configs, key=["BLOCK_M", "N", "K"])
    @triton.jit
    def kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program: all BLOCK_M rows of x against BLOCK_N rows of the codes (each code read once)
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0)
            acc += tl.dot(x, w.to(x.dtype))
        scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))

    @torch.library.custom_op("lean_rl::int8_mm", mutates_args=())
    def int8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, n = x.shape[0], codes.shape[0]
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        block_m = max(16, triton.next_power_of_2(rows))
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x, codes, scale, out, rows, n, x.shape[1], x.stride(0), codes.stride(0), out.stride(0), BLOCK_M=block_m)
        return out

    @int8_mm.register_fake
    def _(x, codes, scale):
        return x.new_empty(x.shape[0], codes.shape[0])
