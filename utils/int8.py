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
bitsandbytes 4-bit 121-128 us. Hence a kernel of our own for the decoding shapes. A wide-K matrix against few
rows leaves most of the GPU idle, so K is split (each split's float32 partial sum stored apart and the splits
added in a fixed order: deterministic), the split timed per shape at its first call: 7b's down projection
(3584 x 18944) at 64 rows 79 -> 49 us (bf16 41). Tried and slower: the converted weights as the product's
first operand (y^T = W x^T), 47 us against 42 for gate/up at 64 rows. The split and the tiles are chosen by
timing (as Triton's autotuning does), so two processes may choose other ones and round differently.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from utils.base import defined_once

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


# --- a float32 policy's decoding products (utils/generation.py float32_weights_through_kernel) ---
# Under bf16 autocast without a generation copy, every decoding step casts each float32 weight to bf16 (read 4 bytes
# a weight, write 2) before cuBLAS reads the cast (2 more). The kernel above reads the float32 weight itself, rounds it
# to bf16 in registers (as the cast does) and multiplies it with a scale of ones: 4 bytes a weight. Measured at 1.5b's
# shapes on one H100 (CUDA graph, 2026-12-07, .gpu/fp32_decode_mm.py in benchmarks/results/stop54_h100/), us at 64 /
# 128 rows, autocast's way against the kernel: gate/up 39.3/40.4 vs 24.6/27.0, down 44.6/47.9 vs 27.0/41.0, LM head
# 637/645 vs 325/339, but q/o 9.9/10.2 vs 6.9/11.1 and k/v 8.2/8.3 vs 6.8/11.0 (7b: q/o 38/40 vs 22.5/23.9, k/v 12.1/
# 12.2 vs 12.6/17.4): so each shape takes whichever of autocast's way and the kernel's splits was fastest at its first
# call (as the split is chosen for int8 codes). The whole 1.5b decoding step with every product through the kernel:
# 6.97 -> 6.17 ms (H100, 128 rows, compiled; its first rollout 46.8 -> 82.5 s: the kernel's autotuning per shape and
# split). Matrices under FLOAT32_KERNEL_MIN_WEIGHTS weights (1.5b's k/v, LoRA adapters) keep autocast's way untimed.
FLOAT32_KERNEL_MIN_WEIGHTS = 1 << 20
_FLOAT32_CHOICE = {}  # (device, BLOCK_M, N, K) -> (0: autocast's way or the kernel's split of K, bf16 ones [N])


def _cast_then_mm(x, weight, bias):
    """What autocast does with F.linear(x, weight, bias) to bf16: every operand cast to bf16, then one product."""
    return F.linear(x, weight.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))


@torch.library.custom_op("lean_rl::float32_mm", mutates_args=())
def float32_mm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [M, K] (any float dtype; cast to bf16) @ weight [N, K]^T (float32) + bias -> [M, N] bf16: autocast's
    F.linear to bf16 or, on a CUDA GPU with Triton, the kernel reading the float32 weight, whichever of the two (and
    of the kernel's splits of K) was faster at the first call of that (device, BLOCK_M, N, K), timed in a CUDA graph.
    Inside a capture nothing is timed: autocast's way until a call outside one has chosen. The same numbers up to the
    order of the bf16 products' float32 sums; with a bias, the kernel's product is rounded to bf16 before the bias is
    added (autocast's cuBLAS adds it before its one rounding: at most one bf16 rounding apart)."""
    x = x.to(torch.bfloat16).contiguous()
    if not (x.is_cuda and x.shape[0] <= KERNEL_MAX_ROWS and _triton_ready()):
        return _cast_then_mm(x, weight, bias)
    n, k = weight.shape
    key = (x.device, block_rows(x.shape[0]), n, k)
    with torch.cuda.device(x.device):  # Triton launches, the capture check and the timing on x's GPU (not the current)
        if key not in _FLOAT32_CHOICE:
            if torch.cuda.is_current_stream_capturing():
                return _cast_then_mm(x, weight, bias)
            ones = torch.ones(n, dtype=torch.bfloat16, device=x.device)
            _FLOAT32_CHOICE[key] = (_fastest_float32_split(x, weight, bias, ones), ones)
        split, ones = _FLOAT32_CHOICE[key]
        return _float32_product(x, weight, bias, split, ones)


def _fastest_float32_split(x, weight, bias, ones):
    """0 (autocast's way) or the kernel's split of K, whichever of them one CUDA graph replays fastest. A kernel
    that fails to build or run here is left out with a warning (autocast's way always stays)."""
    if not SMS:
        SMS.append(torch.cuda.get_device_properties(x.device).multi_processor_count)
    times = {0: _graph_milliseconds(lambda: _cast_then_mm(x, weight, bias))}
    for split in split_candidates(*weight.shape, SMS[0]):
        try:
            times[split] = _graph_milliseconds(lambda: _float32_product(x, weight, bias, split, ones))
        except Exception as error:  # noqa: BLE001 (Triton's compile and launch errors have no common class)
            import warnings

            warnings.warn(f"float32 decoding kernel [{weight.shape[0]} x {weight.shape[1]}], split {split}: "
                          f"{type(error).__name__}: {error}; autocast's product kept for it")
            break
    return min(times, key=times.get)


@float32_mm.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.bfloat16)


def _float32_product(x, weight, bias, split, ones):
    """x [M, K] bf16 @ weight [N, K]^T float32 (+ bias) -> [M, N] bf16: split 0 autocast's way, else the kernel."""
    if split == 0:
        return _cast_then_mm(x, weight, bias)
    out = LAUNCH[0](x, weight, ones, split)
    return out if bias is None else out + bias.to(torch.bfloat16)


def float32_weight_linear(x, weight, bias=None):
    """x [..., K] @ weight [N, K]^T (float32) + bias -> [..., N] bf16 through lean_rl::float32_mm."""
    rows = x.numel() // x.shape[-1]
    return float32_mm(x.reshape(rows, x.shape[-1]), weight, bias).reshape(*x.shape[:-1], weight.shape[0])


_READY = []
_SPLITS = {}  # (block_m, N, K) -> the fastest split of K measured at the first call of that shape
SMS = []  # the device's multiprocessor count, read once
LAUNCH = []  # launch(x, codes, scale, split) -> x @ codes^T * scale, once the kernel is defined


def _triton_ready():
    """Whether the kernel and its op are defined (Triton importable); defined at first use."""
    return defined_once(_READY, _define_kernel)


def block_rows(rows):
    """The kernel's BLOCK_M for `rows` rows of x: the next power of two, at least 16 (tl.dot's least)."""
    return max(16, 1 << (rows - 1).bit_length())


def split_candidates(n, k, sms):
    """Splits of the K dimension worth timing for an [N, K] matrix on `sms` multiprocessors: 1, and powers of
    two while the programs (N / 32 per split) stay under 8 per multiprocessor and each split keeps >= 512
    columns. A few rows against a wide-K matrix otherwise leave most of the GPU idle: 7b's down projection
    (3584 x 18944) at 64 rows took 79 us unsplit, 49 us in 8 splits (H200, CUDA graph, 2026-12-02)."""
    splits, split = [1], 2
    while -(-n // 32) * split <= 8 * sms and k // split >= 512:
        splits.append(split)
        split *= 2
    return splits


def _define_kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
               for n, k, w, s in [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 8, 3),
                                  (128, 128, 8, 4), (16, 256, 4, 4), (32, 512, 8, 3), (64, 64, 4, 5),
                                  (128, 64, 4, 4), (64, 128, 8, 5)]]

    def quick_bench(fn, quantiles):  # autotuning at a decoding shape's first call: ~15 ms per config
        return triton.testing.do_bench(fn, warmup=3, rep=10, quantiles=quantiles)

    @triton.autotune(configs=configs, key=["BLOCK_M", "N", "K", "SPLIT_K"], do_bench=quick_bench)
    @triton.jit
    def kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        # one program: all BLOCK_M rows of x against BLOCK_N rows of the codes over one split of K (each code
        # read once). SPLIT_K == 1: the scaled product is stored in x's dtype; else the split's float32 partial
        # sum goes to its own slice of y (summed afterwards in a fixed order: deterministic).
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                        mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                        mask=(rn[None, :] < N) & (kk[:, None] < k_end), other=0)
            acc += tl.dot(x, w.to(x.dtype))
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        if SPLIT_K == 1:
            scale = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)
        else:
            tl.store(y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)

    def launch(x, codes, scale, split):
        # K split `split` ways, each split a multiple of 512 columns (of every BLOCK_K), so perhaps fewer splits; the
        # output [rows, N] in x's dtype when unsplit, else [splits, rows, N] float32 partial sums (added afterwards in
        # a fixed order: deterministic)
        rows, n, k = x.shape[0], codes.shape[0], x.shape[1]
        k_per_split = -(-k // split)  # ceil(K / split)
        k_per_split = -(-k_per_split // 512) * 512  # rounded up to 512 columns
        split = -(-k // k_per_split)
        if split == 1:
            out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        else:
            out = torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
        kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split)](
            x, codes, scale, out, rows, n, k, k_per_split, x.stride(0), codes.stride(0), out.stride(-2),
            out.stride(0) if split > 1 else 0, BLOCK_M=block_rows(rows), SPLIT_K=split)
        return out if split == 1 else (out.sum(0) * scale.float()).to(x.dtype)

    launch.autotuner = kernel  # its .cache: each (BLOCK_M, N, K, SPLIT_K)'s tiles chosen (printed by the GPU test)
    LAUNCH.append(launch)

    @torch.library.custom_op("lean_rl::int8_mm", mutates_args=())
    def int8_mm(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        # the split of K for calls of this shape, key (BLOCK_M, N, K): at its first call each of split_candidates is
        # run and timed (each autotuned) replayed in a CUDA graph (timed eagerly, the launches' CPU cost hides the
        # kernels' and the unsplit one always wins). Inside a capture nothing is timed: 1, the choice made at the
        # next call outside one.
        x = x.contiguous()
        n, k = codes.shape
        key = (block_rows(x.shape[0]), n, k)
        with torch.cuda.device(x.device):  # Triton launches, the capture check and the timing on x's GPU
            if key not in _SPLITS:
                if torch.cuda.is_current_stream_capturing():
                    return launch(x, codes, scale, 1)
                if not SMS:
                    SMS.append(torch.cuda.get_device_properties(x.device).multi_processor_count)
                candidates = split_candidates(n, k, SMS[0])
                times = [_graph_milliseconds(lambda: launch(x, codes, scale, split)) for split in candidates]
                _SPLITS[key] = candidates[times.index(min(times))]
            return launch(x, codes, scale, _SPLITS[key])

    @int8_mm.register_fake
    def _(x, codes, scale):
        return x.new_empty(x.shape[0], codes.shape[0])


def _graph_milliseconds(fn, calls=10, replays=5):
    """Time of one fn() on the GPU: `calls` of it captured in a CUDA graph (after two warm-up calls on a
    side stream, the first of which autotunes), the graph replayed `replays` times between two events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    del graph
    return start.elapsed_time(end) / (calls * replays)
