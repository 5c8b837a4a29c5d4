"""Activation offload, reentrant (the code before 2026-12-07's change, .gpu/offload_reentrant.py) against
non-reentrant (utils/offload.py now) and checkpointing: forward peak, memory held after the forward, backward peak
(GiB above the step's start), gradients against checkpointing, step time; eager and compiled. Two warm-up steps."""
import copy, importlib.util, sys, time, torch
from utils.ops import completion_logprobs
from utils.modeling import compile_repeated_blocks
import utils.offload as nonreentrant
from transformers import LlamaConfig, LlamaForCausalLM
spec = importlib.util.spec_from_file_location("offload_reentrant", ".gpu/offload_reentrant.py")
reentrant = importlib.util.module_from_spec(spec); spec.loader.exec_module(reentrant)
GIB = 1024**3

def llama(layers, hidden=1024, vocab=32000):
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(c).cuda().train()

def step(model, ids, mask, C):
    model.zero_grad(set_to_none=True); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated(); t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, _ = completion_logprobs(model, ids, mask, C, chunk_size=2048); loss = lp.mean()
    torch.cuda.synchronize()
    fwd_peak = (torch.cuda.max_memory_allocated() - base) / GIB; held = (torch.cuda.memory_allocated() - base) / GIB
    torch.cuda.reset_peak_memory_stats(); loss.backward(); torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    bwd_peak = (torch.cuda.max_memory_allocated() - base) / GIB
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, fwd_peak, held, bwd_peak, ms

def worst(a, b):
    w = {n: ((a[n] - b[n]).abs().max() / a[n].abs().max().clamp(min=1e-8)).item() for n in a}
    n = max(w, key=w.get); return n, w[n]

for layers, B, hidden, compiled in [(8, 16, 1024, False), (4, 8, 1024, True), (12, 8, 1024, True), (8, 8, 2048, False)]:
    torch._dynamo.reset()
    base = llama(layers, hidden)
    ids = torch.randint(0, 32000, (B, 1024), device="cuda"); mask = torch.ones_like(ids); C = 512
    res = {}
    for mode in ("ckpt", "reentrant", "nonreentrant"):
        m = copy.deepcopy(base)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode != "ckpt":
            (reentrant if mode == "reentrant" else nonreentrant).enable_activation_offload(m)
        if compiled:
            compile_repeated_blocks(m)
        for _ in range(2):
            step(m, ids, mask, C)
        res[mode] = step(m, ids, mask, C)
        del m; torch.cuda.empty_cache()
    per_input = B * 1024 * hidden * 4 / GIB
    print(f"layers {layers} B {B} hidden {hidden} compiled {compiled}: one layer input {per_input:.3f} GiB", flush=True)
    for mode in ("ckpt", "reentrant", "nonreentrant"):
        loss, g, f, h, b, ms = res[mode]
        extra = "" if mode == "ckpt" else f" grads vs ckpt {worst(res['ckpt'][1], g)}"
        print(f"  {mode:12s} loss {loss:.9f} fwd_peak {f:.3f} held {h:.3f} bwd_peak {b:.3f} step {ms:.1f} ms{extra}", flush=True)
    del base, res; torch.cuda.empty_cache()
