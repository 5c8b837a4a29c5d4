"""Can utils/int8.py's decoding kernel read float32 weights (rounded to bf16 in registers, scale 1) faster than
autocast's cast-then-cuBLAS? 1.5b and 7b decoding shapes, 64 and 128 rows, each timed replayed in a CUDA graph.
Prints us per product and the largest difference against autocast's F.linear (bf16 output)."""
import torch, torch.nn.functional as F
from utils import int8
from utils.int8 import _graph_milliseconds
assert int8._triton_ready()
shapes = {"1.5b": [("q/o", 1536, 1536), ("k/v", 256, 1536), ("gate/up", 8960, 1536), ("down", 1536, 8960),
                   ("lm_head", 151936, 1536)],
          "7b": [("q/o", 3584, 3584), ("k/v", 512, 3584), ("gate/up", 18944, 3584), ("down", 3584, 18944)]}
for model, mats in shapes.items():
    for name, n, k in mats:
        w = torch.randn(n, k, device="cuda") * 0.02
        ones = torch.ones(n, dtype=torch.bfloat16, device="cuda")
        wb = w.to(torch.bfloat16)
        for rows in (64, 128):
            x = torch.randn(rows, k, device="cuda")
            def autocast_linear():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return F.linear(x, w)
            xb = x.to(torch.bfloat16)
            kernel = lambda: torch.ops.lean_rl.int8_mm(xb, w, ones)
            bf16 = lambda: F.linear(xb, wb)
            ref, got = autocast_linear().float(), kernel().float()
            diff = ((ref - got).abs().max() / ref.abs().max()).item()
            t = [_graph_milliseconds(f) * 1e3 for f in (autocast_linear, kernel, bf16)]
            mb = n * k * 4 / 1e6
            print(f"{model} {name:8s} {n}x{k} rows {rows}: autocast {t[0]:7.1f} us, kernel fp32 {t[1]:7.1f} us "
                  f"({mb / t[1]:.2f} TB/s of fp32 weights), bf16 weights {t[2]:7.1f} us; max diff {diff:.2e}",
                  flush=True)
