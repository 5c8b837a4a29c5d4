# which kernels bitsandbytes' gemm_4bit runs at 7b decoding shapes (nested absmax, Qwen's q/k/v bias), 64 rows
import sys, torch
import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from lora_mm_util import graph_us
from torch.profiler import profile, ProfilerActivity
from torch.autograd import DeviceType
import bitsandbytes as bnb
from bitsandbytes.nn import Params4bit
bf = torch.bfloat16
torch.manual_seed(0)
shapes = {"q": (3584, 3584, True), "k/v": (512, 3584, True), "o": (3584, 3584, False), "gate/up": (18944, 3584, False), "down": (3584, 18944, False)}
for rows in (16, 32, 64, 128):
    for name, (n, k, has_bias) in shapes.items():
        w = Params4bit(torch.randn(n, k, dtype=bf) * 0.02, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64).cuda()
        bias = torch.randn(n, device="cuda", dtype=bf) * 0.02 if has_bias else None
        x = torch.randn(rows, 1, k, device="cuda", dtype=bf)
        qs = w.quant_state
        fn = lambda: torch.ops.bitsandbytes.gemm_4bit.default(x, w.data.view(-1, 1), qs.shape, qs.state2.absmax, qs.blocksize, qs.quant_type,
                                                            bias=bias, absmax_8bit=qs.absmax, absmax_code=qs.state2.code, absmax_offset=qs.offset)
        us = graph_us(fn)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        ks = [f"{e.key[:60]} {e.self_device_time_total:.1f}" for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        print(f"rows {rows:4d} {name:8s} [{n} x {k}] bias {has_bias}: {us:7.1f} us | " + " ; ".join(ks), flush=True)
