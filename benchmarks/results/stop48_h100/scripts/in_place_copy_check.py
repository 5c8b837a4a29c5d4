# The failing GPU test test_in_place_copy_in_a_captured_step_on_gpu, taken apart (NOT run: no device time left):
# per backend and with the fused projections on/off, which rollouts agree: the usual copy, the in-place copy and the
# policy itself (no copy). On a CPU every pair agrees (0.979 against the policy itself: bf16 merge rounding).
# Run from the repository root: PYTHONPATH=. python benchmarks/results/stop48_h100/scripts/in_place_copy_check.py
import torch, sys
from transformers import LlamaConfig, LlamaForCausalLM, GenerationConfig
from utils import toy, generation
from utils.generation import generate_completions
from utils.modeling import apply_lora
DEV = "cuda" if torch.cuda.is_available() else "cpu"
sampled = generation.static_cache_generate
def greedy_generate(*args, **kwargs):
    return sampled(*args, **dict(kwargs, greedy=True))
for greedy in (False, True):  # greedy: no random draws, so a difference is the weights', not the sampler's
 generation.static_cache_generate = greedy_generate if greedy else sampled
 for fuse in (True, False):
  for backend in ("static", "cudagraph", "compiled"):
    generation.FUSE_PROJECTIONS = fuse
    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.02, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEV).eval()
    enc = tokenizer(["1+2=", "12+34=", "7+7=", "100+1="], return_tensors="pt", padding=True, padding_side="left")
    ids, mask, pad = enc["input_ids"].to(DEV), enc["attention_mask"].to(DEV), tokenizer.pad_token_id
    model.to(torch.bfloat16)
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            module.inv_freq = module.inv_freq.float()
    policy = apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules="all-linear")
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    gc = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, pad_token_id=pad, eos_token_id=[10**9])
    def rollout(in_place, from_copy=True, keep=True):
        torch.manual_seed(3)
        return generate_completions(policy, ids, mask, gc, [10**9], backend=backend, from_copy=from_copy, copy_in_place=in_place, keep_decoder=keep)[0]
    direct = rollout(False, from_copy=False, keep=False)
    usual = rollout(False)
    policy.__dict__.pop("_lean_rl_generation_copy")
    inp = rollout(True)
    policy.__dict__.pop("_lean_rl_generation_copy")
    inp2 = rollout(True, keep=False)
    f = lambda a, b: round((a == b).float().mean().item(), 3)
    print(f"greedy={greedy} fuse={fuse} backend={backend}: usual==in_place {f(usual, inp)} usual==direct {f(usual, direct)} in_place==direct {f(inp, direct)} in_place(keep=False)==in_place {f(inp2, inp)}", flush=True)
