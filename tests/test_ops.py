"""Logprobs, entropy, completion masks and sampling, checked against direct computations."""
import pytest
import torch

from utils import toy
from utils.generation import build_generation_config, completion_ids_and_mask, generate_completions
from utils.ops import (batched_completion_logprobs, completion_logprobs, logprobs_and_entropy, masked_mean,
                       plan_micro_batches)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = toy.build_tokenizer()
    tokenizer.padding_side = "left"
    model = toy.build_model(tokenizer, seed=3).eval()
    return tokenizer, model


def test_logprobs_and_entropy_against_log_softmax_and_p_log_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    index = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits.double(), -1).gather(-1, index[..., None]).squeeze(-1)
    logprobs, entropy = logprobs_and_entropy(logits, index, 1.0, "metric")
    torch.testing.assert_close(logprobs.double(), ref, rtol=1e-5, atol=1e-5)
    p = torch.softmax(logits.double(), -1)
    ent_ref = -(p * torch.log(p)).sum(-1)
    torch.testing.assert_close(entropy.double(), ent_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_and_entropy_and_their_written_out_gradients_equal_autograd_in_float64(dtype, temperature):
    """logprobs_and_entropy (a written-out backward: d logprob/dz = onehot - p, d entropy/dz = -p (z - lse + H))
    against log_softmax and -sum p log p in float64 through autograd: values, and the gradient of a loss mixing
    both, on a non-contiguous [B, C, V] view as completion_logprobs passes it; the metric entropy has no gradient
    and leaves the logprob's gradient as it is."""
    torch.manual_seed(0)
    full = (torch.randn(3, 6, 50) * 3).to(dtype).requires_grad_()
    logits = full[:, :-1]  # [3, 5, 50], a view
    targets = torch.randint(0, 50, (3, 5))
    w_lp, w_ent = torch.randn(3, 5), torch.randn(3, 5)
    leaf = logits.detach().double().requires_grad_()
    z = leaf / temperature
    ref_lp = torch.log_softmax(z, -1).gather(-1, targets[..., None]).squeeze(-1)
    p = torch.softmax(z, -1)
    ref_ent = -(p * torch.log(p)).sum(-1)
    (ref_grad,) = torch.autograd.grad((w_lp * ref_lp + w_ent * ref_ent).sum(), leaf, retain_graph=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=1e-5)  # bf16 input, fp32 math
    for mode in ("grad", "checkpointed"):
        lp, ent = logprobs_and_entropy(logits, targets, temperature, mode)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (3, 5)
        torch.testing.assert_close(lp.double(), ref_lp.detach(), **tol)
        torch.testing.assert_close(ent.double(), ref_ent.detach(), **tol)
        (grad,) = torch.autograd.grad((w_lp * lp + w_ent * ent).sum(), full)
        assert grad.dtype == dtype and grad[:, -1].abs().sum() == 0
        torch.testing.assert_close(grad[:, :-1].double(), ref_grad, rtol=0,
                                   atol=1e-5 if dtype == torch.float32 else 2e-2 * ref_grad.abs().max().item())
    (ref_lp_grad,) = torch.autograd.grad((w_lp * ref_lp).sum(), leaf)
    lp, ent = logprobs_and_entropy(logits, targets, temperature, "metric")
    assert not ent.requires_grad
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **tol)
    (grad,) = torch.autograd.grad((w_lp * lp).sum(), full)
    torch.testing.assert_close(grad[:, :-1].double(), ref_lp_grad, rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 2e-2 * ref_lp_grad.abs().max().item())
    lp, ent = logprobs_and_entropy(logits, targets, temperature)  # no entropy: zeros
    assert not ent.requires_grad and not ent.any()


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]]).float()
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_mean(x, m, dim=1).tolist() == pytest.approx([1.5, 3.0])


def test_completion_mask_stops_at_first_eos():
    eos, pad = 1, 0
    ids = torch.tensor([[5, 6, 1, 7, 1], [5, 6, 7, 8, 9], [1, 5, 5, 5, 5]])
    out, mask, truncated = completion_ids_and_mask(ids, [eos], pad)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert out.tolist() == [[5, 6, 1, 0, 0], [5, 6, 7, 8, 9], [1, 0, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]
    _, mask2, _ = completion_ids_and_mask(torch.tensor([[5, 9, 7]]), [7, 9], pad)  # several EOS ids
    assert mask2.tolist() == [[1, 1, 0]]


def test_logprobs_do_not_depend_on_left_padding(tiny):
    tokenizer, model = tiny
    prompts = ["1+2=", "4+4=0+0="]
    completion = torch.tensor([[20, 21, 22], [23, 24, 1]])
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    ids = torch.cat([enc["input_ids"], completion], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(completion)], 1)
    batched, _ = completion_logprobs(model, ids, mask, 3)
    for i, prompt in enumerate(prompts):  # each alone, no padding at all
        alone = tokenizer(prompt, return_tensors="pt")["input_ids"]
        ids_i = torch.cat([alone, completion[i:i + 1]], 1)
        single, _ = completion_logprobs(model, ids_i, torch.ones_like(ids_i), 3)
        torch.testing.assert_close(batched[i], single[0], rtol=1e-4, atol=1e-5)
    one_by_one = batched_completion_logprobs(model, ids, mask, plan_micro_batches(mask, 3, batch_size=1), 1.0)
    torch.testing.assert_close(one_by_one, batched)


def test_logprobs_equal_the_sampling_distribution(tiny):
    """The loss's logprobs (forward pass at the sampling temperature) equal the log of the
    probabilities generate() sampled from."""
    tokenizer, model = tiny
    enc = tokenizer(["3+1=", "2+2=", "0+4="], return_tensors="pt", padding=True)
    temperature = 0.7
    out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=None, top_p=None, max_new_tokens=6,
                         min_new_tokens=6, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    completion = out.sequences[:, enc["input_ids"].shape[1]:]
    scores = torch.stack(out.scores, 1)  # [B, C, V], logits already divided by the temperature
    from_generate = torch.log_softmax(scores.float(), -1).gather(-1, completion[..., None]).squeeze(-1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(completion)], 1)
    ours, entropy = completion_logprobs(model, out.sequences, mask, 6, temperature=temperature, entropy="metric")
    torch.testing.assert_close(ours, from_generate, rtol=1e-4, atol=1e-4)
    assert entropy.shape == ours.shape and (entropy > 0).all()


def test_sampled_frequencies_follow_the_model():
    """Empirical first-token frequencies of generate_completions match softmax(logits / T)."""
    tokenizer = toy.build_tokenizer()
    tokenizer.padding_side = "left"
    model = toy.build_model(tokenizer, seed=0)
    with torch.no_grad():  # sharpen the distribution so a few thousand samples measure it well
        model.lm_head.weight.mul_(60.0)
    enc = tokenizer(["7+1="], return_tensors="pt")
    n = 4000
    ids = enc["input_ids"].repeat(n, 1)
    config = build_generation_config(1, 1.5, 1.0, 0, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    torch.manual_seed(0)
    completion, _, _ = generate_completions(model, ids, torch.ones_like(ids), config, [tokenizer.eos_token_id])
    with torch.no_grad():
        probs = torch.softmax(model(**enc).logits[0, -1] / 1.5, -1)
    counts = torch.bincount(completion[:, 0], minlength=probs.numel()).float() / n
    top = probs.topk(5).indices
    assert probs[top].sum() > 0.3
    torch.testing.assert_close(counts[top], probs[top], atol=0.03, rtol=0)


def test_lora_under_autocast_skips_the_input_cast_and_keeps_every_number():
    """apply_lora's adapters on a bf16 base (PEFT keeps them in float32): under autocast they take the bf16
    input as it is instead of PEFT's float32 copy (checked at lora_A's input), and the logits and every
    gradient (adapters and embedding) are bit for bit PEFT's own; without autocast they cast as PEFT does."""
    import copy

    from utils.modeling import _AUTOCAST_CASTS, apply_lora

    tokenizer = toy.build_tokenizer()
    base = toy.build_model(tokenizer, seed=5).to(torch.bfloat16)
    policy = apply_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    policy.get_input_embeddings().weight.requires_grad_(True)  # a gradient through every adapter's input
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert {p.dtype for n, p in policy.named_parameters() if "lora_" in n} == {torch.float32}
    peft_own = copy.deepcopy(policy)  # the same weights, PEFT's layer classes
    for module in peft_own.modules():
        if type(module) in _AUTOCAST_CASTS.values():
            module.__class__ = type(module).__mro__[1]
    seen = {}

    def record(model, key):
        for name, module in model.named_modules():
            if name.endswith("lora_A.default"):
                module.register_forward_pre_hook(lambda m, inputs: seen.setdefault(key, set()).add(inputs[0].dtype))

    record(policy, "ours")
    record(peft_own, "peft")
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]])
    weights = torch.randn(2, 8, 100)

    def run(model, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids).logits
        (logits.float() * weights).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for autocast, ours_dtype in [(True, torch.bfloat16), (False, torch.float32)]:
        seen.clear()
        ours, ours_grads = run(policy, autocast)
        want, want_grads = run(peft_own, autocast)
        assert seen == {"ours": {ours_dtype}, "peft": {torch.float32}}, (autocast, seen)
        assert torch.equal(ours, want)
        assert ours_grads.keys() == want_grads.keys() and len(ours_grads) > 10
        assert any("embed_tokens" in n for n in ours_grads)
        for name in want_grads:
            assert torch.equal(ours_grads[name], want_grads[name]), (autocast, name)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled():
    """With --use_lora the reference logprobs come from the policy with its adapter disabled:
    they must equal those of an untouched copy of the base model, while the adapted policy differs."""
    import copy

    from utils.modeling import apply_lora

    tokenizer = toy.build_tokenizer()
    base = toy.build_model(tokenizer, seed=4)
    untouched = copy.deepcopy(base).eval()
    policy = apply_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear").eval()
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.ones_like(ids)
    want, _ = completion_logprobs(untouched, ids, mask, 3)
    with policy.disable_adapter():
        ref, _ = completion_logprobs(policy, ids, mask, 3)
    adapted, _ = completion_logprobs(policy, ids, mask, 3)
    torch.testing.assert_close(ref, want)
    assert (adapted - want).abs().max() > 1e-3
