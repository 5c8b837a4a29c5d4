"""Where the activation-offload peak sits: forward peak, memory held after forward, backward peak, for
checkpointing vs offload, eager and compiled, default SDPA and the math SDPA backend (determinism)."""
import copy, sys, torch
sys.path[:0] = ["tests/gpu", "tests"]
from torch.nn.attention import sdpa_kernel, SDPBackend
from utils.ops import completion_logprobs
from utils.modeling import compile_repeated_blocks
from utils.offload import enable_activation_offload
from transformers import LlamaConfig, LlamaForCausalLM
GIB = 1024**3

def llama(layers, hidden=1024, vocab=32000):
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(c).cuda().train()

def step(model, ids, mask, C):
    model.zero_grad(set_to_none=True); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = completion_logprobs(model, ids, mask, C, chunk_size=2048); loss = lp.mean()
    torch.cuda.synchronize()
    fwd_peak = (torch.cuda.max_memory_allocated() - base) / GIB; held = (torch.cuda.memory_allocated() - base) / GIB
    torch.cuda.reset_peak_memory_stats(); loss.backward(); torch.cuda.synchronize()
    bwd_peak = (torch.cuda.max_memory_allocated() - base) / GIB
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, fwd_peak, held, bwd_peak

def worst(a, b):
    w = {n: ((a[n] - b[n]).abs().max() / a[n].abs().max().clamp(min=1e-8)).item() for n in a}
    n = max(w, key=w.get); return n, w[n]

for layers, B, compiled, backend in [(8, 16, False, None), (8, 16, False, SDPBackend.MATH), (4, 8, True, None),
                                     (12, 8, True, None)]:
    torch._dynamo.reset()
    base = llama(layers)
    ids = torch.randint(0, 32000, (B, 1024), device="cuda"); mask = torch.ones_like(ids); C = 512
    ctx = sdpa_kernel(backend) if backend is not None else torch.enable_grad()
    res = {}
    with ctx:
        for mode in ("ckpt", "ckpt2", "offload"):
            m = copy.deepcopy(base) if mode != "ckpt2" else res["model"]
            if mode != "ckpt2":
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                if mode == "offload":
                    enable_activation_offload(m)
                if compiled:
                    compile_repeated_blocks(m)
                for _ in range(2):
                    step(m, ids, mask, C)
            res[mode] = step(m, ids, mask, C)
            res["model"] = m if mode == "ckpt" else None
            if mode != "ckpt":
                del m
    per_input = B * 1024 * 1024 * 4 / GIB
    print(f"layers {layers} B {B} compiled {compiled} sdpa {backend}: one layer input {per_input:.3f} GiB")
    for mode in ("ckpt", "ckpt2", "offload"):
        loss, g, f, h, b = res[mode]
        print(f"  {mode:8s} loss {loss:.9f} fwd_peak {f:.3f} held_after_fwd {h:.3f} bwd_peak {b:.3f}")
    print("  offload vs ckpt", worst(res["ckpt"][1], res["offload"][1]), " ckpt vs ckpt2", worst(res["ckpt"][1], res["ckpt2"][1]))
    del base, res; torch.cuda.empty_cache()
