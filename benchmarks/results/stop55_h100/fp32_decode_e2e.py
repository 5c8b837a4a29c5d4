"""The float32-weight decoding idea end to end: benchmarks/decode_step.py's compiled step of a float32 policy under
bf16 autocast, as today, or (--kernel) with every decoding product (no grad, CUDA, <= 128 rows, float32 weight,
bf16 autocast) through utils/int8.py's kernel reading the float32 weight (scale 1). Run twice, e.g.
    python3 .gpu/fp32_decode_e2e.py --backends compiled --dtypes fp32 --short 400 --long 512
    python3 .gpu/fp32_decode_e2e.py --kernel --backends compiled --dtypes fp32 --short 400 --long 512"""
import sys
import torch
sys.path.insert(0, ".")
if "--kernel" in sys.argv:
    sys.argv.remove("--kernel")
    from utils import int8
    assert int8._triton_ready()
    plain = torch.nn.Linear.forward

    def forward(self, x):
        w, rows = self.weight, x.numel() // x.shape[-1]
        if (w.dtype == torch.float32 and x.is_cuda and not torch.is_grad_enabled() and rows <= int8.KERNEL_MAX_ROWS
                and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16):
            ones = torch.ones(w.shape[0], dtype=torch.bfloat16, device=w.device)
            out = torch.ops.lean_rl.int8_mm(x.reshape(rows, x.shape[-1]).to(torch.bfloat16), w, ones)
            out = out.reshape(*x.shape[:-1], w.shape[0])
            return out if self.bias is None else out + self.bias.to(torch.bfloat16)
        return plain(self, x)

    torch.nn.Linear.forward = forward
    print("decoding products through the kernel (float32 weights read, rounded to bf16 in registers)", flush=True)
from benchmarks.decode_step import main
main(sys.argv[1:])
