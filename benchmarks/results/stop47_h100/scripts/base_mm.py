# micro-benchmark: bf16 base products at decoding shapes, by rows; and bnb 4-bit, each in a CUDA graph
import sys, torch, torch.nn.functional as F
import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); from lora_mm_util import graph_us
bf = torch.bfloat16
torch.manual_seed(0)
shapes = {"7b q/o": (3584, 3584), "7b k/v": (512, 3584), "7b gate/up": (18944, 3584), "7b down": (3584, 18944),
          "1.5b q/o": (1536, 1536), "1.5b gate/up": (8960, 1536), "1.5b down": (1536, 8960)}
def splitk(x, W, s):
    m, k = x.shape; n = W.shape[0]; c = k // s
    return torch.bmm(x.view(m, s, c).transpose(0, 1), W.view(n, s, c).permute(1, 2, 0), out_dtype=torch.float32).sum(0).to(bf)
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for name, (n, k) in shapes.items():
        W = (torch.randn(n, k, device="cuda") * 0.02).to(bf)
        for rows in (16, 32, 48, 64, 96, 128):
            x = torch.randn(rows, k, device="cuda", dtype=bf)
            c = {"F.linear": lambda: F.linear(x, W), "(W@x.T).T": lambda: (W @ x.t()).t()}
            if lib == "cublas" and k % 4 == 0:
                c["splitK2 fp32"] = lambda: splitk(x, W, 2)
                c["splitK4 fp32"] = lambda: splitk(x, W, 4)
            line = " | ".join(f"{cn} {graph_us(fn):7.1f}" for cn, fn in c.items())
            print(f"{lib:8s} {name:12s} rows {rows:4d}: {line} us (floor {n * k * 2 / 3.35e6:.1f})", flush=True)
torch.backends.cuda.preferred_blas_library("cublas")
import bitsandbytes as bnb
from bitsandbytes.nn import Params4bit
from bitsandbytes.functional import dequantize_4bit
for name, (n, k) in shapes.items():
    if not name.startswith("7b"): continue
    w = Params4bit(torch.randn(n, k, dtype=bf) * 0.02, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64).cuda()
    for rows in (16, 64, 128):
        x = torch.randn(rows, k, device="cuda", dtype=bf)
        t_bnb = graph_us(lambda: bnb.matmul_4bit(x, w.t(), quant_state=w.quant_state))
        t_deq = graph_us(lambda: dequantize_4bit(w.data, w.quant_state))
        t_own = graph_us(lambda: F.linear(x, dequantize_4bit(w.data, w.quant_state)))
        print(f"bnb {name:12s} rows {rows:4d}: matmul_4bit {t_bnb:7.1f} | dequantize alone {t_deq:7.1f} | dequantize + F.linear {t_own:7.1f} us", flush=True)
