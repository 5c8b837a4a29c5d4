# micro-benchmark: LoRA adapter products at decoding shapes (7b), each candidate in a CUDA graph
import torch, torch.nn.functional as F
torch.manual_seed(0)
dev = "cuda"
bf = torch.bfloat16

import os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_mm_util import graph_us  # noqa: E402

def splitk(x, A, chunk=512):
    m, k = x.shape; r = A.shape[0]; s = k // chunk
    return torch.bmm(x.view(m, s, chunk).transpose(0, 1), A.view(r, s, chunk).permute(1, 2, 0)).sum(0)

def splitk32(x, A, chunk=512):
    m, k = x.shape; r = A.shape[0]; s = k // chunk
    return torch.bmm(x.view(m, s, chunk).transpose(0, 1), A.view(r, s, chunk).permute(1, 2, 0), out_dtype=torch.float32).sum(0).to(bf)

reduce_c = torch.compile(lambda x, A: (x.unsqueeze(1).float() * A.unsqueeze(0).float()).sum(-1).to(bf))
linear_c = torch.compile(lambda x, A: F.linear(x, A))
def autocast_fp32w(x, A32):
    with torch.autocast("cuda", dtype=bf):
        return F.linear(x, A32)
ac_c = torch.compile(autocast_fp32w)

for rows in (16, 64, 128):
    for k in (3584, 18944):
        x = torch.randn(rows, k, device=dev, dtype=bf)
        A32 = torch.randn(16, k, device=dev) * 0.02
        A = A32.to(bf); At = A.t().contiguous()
        ref = (x.double() @ A.double().t())
        cands = {
            "F.linear bf16": lambda: F.linear(x, A),
            "x @ At (NN)": lambda: x @ At,
            "A @ x.T then .T": lambda: (A @ x.t()).t(),
            "autocast fp32 A (PEFT)": lambda: autocast_fp32w(x, A32),
            "compiled autocast fp32 A": lambda: ac_c(x, A32),
            "compiled F.linear": lambda: linear_c(x, A),
            "compiled fp32 reduction": lambda: reduce_c(x, A),
            "split-K bmm bf16 out": lambda: splitk(x, A),
        }
        try:
            splitk32(x, A); cands["split-K bmm fp32 out"] = lambda: splitk32(x, A)
        except Exception as e:
            print("out_dtype bmm:", type(e).__name__, str(e)[:100])
        for name, fn in cands.items():
            out = fn()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"rows {rows:4d} K {k:6d} r16 A-product: {name:28s} {graph_us(fn):8.1f} us  rel err {err:.2e}", flush=True)
    # B products
    for n in (512, 3584, 18944):
        h = torch.randn(rows, 16, device=dev, dtype=bf); B = (torch.randn(n, 16, device=dev) * 0.02).to(bf)
        print(f"rows {rows:4d} N {n:6d} r16 B-product: F.linear bf16 {graph_us(lambda: F.linear(h, B)):8.1f} us", flush=True)
