"""The memory levers: each one that must not change the math is checked against the plain
computation (values and gradients), the ones that do change it against their documented
behaviour, and their flag combinations against clear errors."""
import contextlib
import copy
import re

import pytest
import torch

import train_grpo
from helpers import metrics_of
from utils import toy
from utils.cli import UsageError
from utils.offload import ParamOffload, enable_activation_offload, resolve_offload_modules
from utils.ops import (batched_completion_logprobs, chunked_logprobs, completion_logprobs, logprobs_and_entropy,
                       plan_micro_batches)
from utils.optim import build_optimizer


def _model(seed=3, hidden_size=64, num_layers=2):
    tokenizer = toy.build_tokenizer()
    return tokenizer, toy.build_model(tokenizer, seed=seed, hidden_size=hidden_size, num_layers=num_layers)


def _batch(vocab, B=6, P=5, C=7, seed=0):
    """Left-padded prompts and right-padded completions of different lengths: [B, P + C]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + C), generator=g)
    prompt_lens = torch.randint(1, P + 1, (B,), generator=g)
    completion_lens = torch.randint(1, C + 1, (B,), generator=g)
    cols = torch.arange(P + C)
    mask = ((cols[None] >= P - prompt_lens[:, None]) & (cols[None] < P + completion_lens[:, None])).long()
    return ids.masked_fill(mask == 0, 0), mask


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ---- chunked LM head ---------------------------------------------------------------------------


@pytest.mark.parametrize("entropy", ["metric", "grad"])
def test_chunked_logprobs_equal_full_logits_with_gradients(entropy):
    _, model = _model()
    ids, mask = _batch(model.config.vocab_size)
    results = []
    for chunk in (0, 5):
        model.zero_grad()
        logprobs, ent = completion_logprobs(model, ids, mask, 7, temperature=0.7, entropy=entropy, chunk_size=chunk)
        loss = (logprobs * mask[:, 5:]).sum() + (0.3 * ent * mask[:, 5:]).sum()
        loss.backward()
        results.append((logprobs.detach(), ent.detach(), _grads(model)))
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
    assert model.lm_head.__dict__.get("forward") is None  # the head's forward was restored


def test_chunked_logprobs_against_a_direct_computation():
    """Independent reference: log_softmax over the full logits, gathered, and -sum p log p."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(3, 4, 8, generator=g), torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (3, 4), generator=g)
    out = chunked_logprobs(lambda h: h @ weight.T, hidden, targets, 2.0, 5, "metric")
    logp = torch.log_softmax(hidden @ weight.T / 2.0, -1)
    torch.testing.assert_close(out[..., 0], logp.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(out[..., 1], -(logp.exp() * logp).sum(-1))


def test_checkpointed_entropy_has_the_same_gradient():
    """--entropy_checkpointing's mode gives the entropy's gradient of the plain one (logprobs_and_entropy keeps no
    softmax in either)."""
    logits = torch.randn(4, 6, 13, requires_grad=True)
    targets = torch.randint(0, 13, (4, 6))
    grads = []
    for fn in (lambda z: logprobs_and_entropy(z, targets, 1.0, "grad")[1],
               lambda z: logprobs_and_entropy(z, targets, 1.0, "checkpointed")[1]):
        logits.grad = None
        fn(logits).sum().backward()
        grads.append(logits.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_chunked_head_refuses_models_that_transform_logits():
    _, model = _model()
    model.config.final_logit_softcapping = 30.0
    ids, mask = _batch(model.config.vocab_size)
    with pytest.raises(UsageError, match="logprob_chunk_size"):
        completion_logprobs(model, ids, mask, 7, chunk_size=4)


# ---- micro-batch plans ---------------------------------------------------------------------------


def test_fixed_plan_and_windows_keep_every_real_token():
    ids, mask = _batch(50, B=7)
    plan = plan_micro_batches(mask, 7, batch_size=3)
    assert [len(m.rows) for m in plan] == [3, 3, 1]
    assert sorted(torch.cat([m.rows for m in plan]).tolist()) == list(range(7))
    for m in plan:  # the columns cut away hold only padding for these rows
        kept = torch.zeros(12, dtype=torch.bool)
        kept[m.start:m.stop] = True
        assert mask[m.rows][:, ~kept].sum() == 0
        assert m.c == m.stop - 5


def test_token_budget_plan_respects_budget_and_agreed_count():
    ids, mask = _batch(50, B=16, P=10, C=20, seed=4)
    budget = 60
    plan = plan_micro_batches(mask, 20, max_tokens=budget)
    assert sorted(torch.cat([m.rows for m in plan]).tolist()) == list(range(16))
    for m in plan:
        assert len(m.rows) * (m.stop - m.start) <= budget or len(m.rows) == 1
    more = plan_micro_batches(mask, 20, max_tokens=budget, num_batches_at_least=lambda n: n + 3)
    assert len(more) == len(plan) + 3  # another process needed more: the biggest ones are split
    assert sorted(torch.cat([m.rows for m in more]).tolist()) == list(range(16))
    subset = torch.tensor([9, 2, 14, 5])  # PPO mini-batches plan over a subset of rows
    assert sorted(torch.cat([m.rows for m in plan_micro_batches(mask, 20, rows=subset, max_tokens=budget)]).tolist()) \
        == sorted(subset.tolist())


def test_grpo_loss_and_gradient_do_not_depend_on_the_micro_batch_plan():
    """Reference: the whole batch in one forward, the loss taken at once over [B, C]. Then the
    same step through fixed micro-batches of 2 and through a token budget: equal loss and
    gradients (the loss normalisers are global)."""
    _, model = _model(seed=5)
    B, P, C = 8, 5, 7
    ids, mask = _batch(model.config.vocab_size, B=B, P=P, C=C, seed=2)
    loss_mask = mask[:, P:].float()
    advantages = torch.randn(B, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        old = completion_logprobs(model, ids, mask, C)[0] + 0.05 * torch.randn(B, C)
        ref = completion_logprobs(model, ids, mask, C)[0] - 0.05
    num_tokens = loss_mask.sum().item()

    def step(plan):
        model.zero_grad()
        total = 0.0
        for micro in plan:
            logprobs, _ = completion_logprobs(model, micro.window(ids), micro.window(mask), micro.c)
            per_token, _, _ = train_grpo.per_token_policy_loss(logprobs, micro.completion(old), micro.take(advantages),
                                                                0.2, 0.2, micro.completion(ref), 0.04)
            loss = train_grpo.aggregate_loss(per_token, micro.completion(loss_mask), "grpo", B, num_tokens, C)
            loss.backward()
            total += loss.item()
        return total, _grads(model)

    model.zero_grad()
    logprobs, _ = completion_logprobs(model, ids, mask, C)
    per_token, _, _ = train_grpo.per_token_policy_loss(logprobs, old, advantages, 0.2, 0.2, ref, 0.04)
    want = ((per_token * loss_mask).sum(1) / loss_mask.sum(1)).mean()  # the paper's per-sequence mean
    want.backward()
    want_grads = _grads(model)
    for plan in (plan_micro_batches(mask, C, batch_size=2), plan_micro_batches(mask, C, max_tokens=40)):
        total, grads = step(plan)
        assert abs(total - want.item()) < 1e-6
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-4, atol=1e-7, msg=name)


def test_no_grad_passes_over_a_plan_equal_one_pass():
    _, model = _model()
    ids, mask = _batch(model.config.vocab_size)
    plan = plan_micro_batches(mask, 7, max_tokens=30)
    full = batched_completion_logprobs(model, ids, mask, plan, 1.0)
    want, _ = completion_logprobs(model, ids, mask, 7)
    real = mask[:, 5:].bool()
    torch.testing.assert_close(full[real], want.detach()[real], rtol=1e-5, atol=1e-6)
    for m in plan:  # columns no row of the micro-batch reaches are zeros
        assert (full[m.rows, m.c:] == 0).all()


# ---- activation and parameter offload ------------------------------------------------------------


def test_activation_offload_gives_the_checkpointed_gradients():
    _, base = _model(seed=7, num_layers=3)
    ids, mask = _batch(base.config.vocab_size)
    grads = []
    for mode in ("plain", "checkpointing", "offload"):
        model = copy.deepcopy(base).train()
        if mode != "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode == "offload":
            assert enable_activation_offload(model) >= 3
        logprobs, _ = completion_logprobs(model, ids, mask, 7)
        (logprobs * mask[:, 5:]).sum().backward()
        grads.append(_grads(model))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads[2][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_activation_offload_backward_twice_and_dropout_as_plain_checkpointing(monkeypatch):
    """Two backwards through one graph (retain_graph: the host copy serves each recompute) give checkpointing's
    gradients, with dropout in the layers (the recompute must draw the forward's masks). Each layer's checkpoint
    gets a tensor on the input's device among its arguments: torch.utils.checkpoint saves the RNG state of the
    devices its arguments are on, and transformers binds the layer's other inputs into the function, so without one
    a GPU's state would not be restored for the recompute (a CPU's always is; the GPU test checks the masks there)."""
    import utils.offload

    _, base = _model(seed=7, num_layers=3)
    for layer in base.model.layers:
        layer.self_attn.attention_dropout = 0.3  # dropout on the attention weights (SDPA's dropout_p) in training
    ids, mask = _batch(base.config.vocab_size)
    grads, devices = [], []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(utils.offload.torch.utils.checkpoint, "checkpoint", lambda fn, *args, **kwargs: devices.append(
        [a.device for a in args if isinstance(a, torch.Tensor)]) or checkpoint(fn, *args, **kwargs))
    for mode in ("checkpointing", "offload"):
        model = copy.deepcopy(base).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if mode == "offload":
            enable_activation_offload(model)
        torch.manual_seed(11)
        logprobs, _ = completion_logprobs(model, ids, mask, 7)
        loss = (logprobs * mask[:, 5:]).sum()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append(_grads(model))
    assert devices[-3:] == [[ids.device]] * 3  # the offload's three layers, each with its input's device
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_activation_offload_needs_checkpointed_layers():
    _, model = _model()
    with pytest.raises(RuntimeError, match="no checkpointed layers"):
        enable_activation_offload(model)


def test_param_offload_resolves_names_and_keeps_the_math():
    _, base = _model(seed=8)
    ids, mask = _batch(base.config.vocab_size)
    model = copy.deepcopy(base)
    offload = ParamOffload(model, "embedding,lm_head,layers.0.mlp.down_proj", "cpu")
    names = [n for n, _ in offload.modules]
    assert names == ["embedding", "lm_head", "layers.0.mlp.down_proj"]
    outs = []
    for m in (base, model):
        m.zero_grad()
        logprobs, _ = completion_logprobs(m, ids, mask, 7, chunk_size=4)
        logprobs.sum().backward()
        outs.append((logprobs.detach(), _grads(m)))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for name in outs[0][1]:
        torch.testing.assert_close(outs[1][1][name], outs[0][1][name])
    with pytest.raises(UsageError, match="no such module"):
        resolve_offload_modules(base, "embedding,nonexistent")
    # the toy model ties its LM head to the embedding, as Qwen2.5-1.5B does: the head leaves the GPU with it
    assert base.lm_head.weight is base.model.embed_tokens.weight
    assert [n for n, _ in resolve_offload_modules(base, "embedding")] == ["embedding", "lm_head (tied)"]
    untied = copy.deepcopy(base)
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert [n for n, _ in resolve_offload_modules(untied, "embedding")] == ["embedding"]
    with pytest.raises(UsageError, match="only plain Linear and Embedding"):
        resolve_offload_modules(base, "layers.0.mlp")



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offloaded_embedding_moves_only_the_used_rows_and_sums_their_gradients_as_f_embedding(dtype, monkeypatch):
    """--param_offload's embedding (utils/offload.py _EmbeddingRows) against F.embedding on the whole matrix:
    repeated ids, the padding row (no gradient), two micro-batches accumulating into one .grad, a second use of
    the weight through autograd (a tied LM head) summed with it, and a frozen weight (LoRA) left without one."""
    import utils.offload as offload

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 8, generator=g).to(dtype)
    batches = [torch.tensor([[3, 3, 7, 0], [0, 9, 3, 49]]), torch.tensor([[7, 7, 7, 1], [2, 0, 0, 9]])]
    head = torch.randn(8, generator=g).to(dtype)
    gathered = []
    real_select = torch.index_select
    monkeypatch.setattr(offload.torch, "index_select", lambda w, d, idx, out=None: (
        gathered.append(idx.numel()), real_select(w, d, idx, out=out))[1])

    def loss_of(w, ids, rows):
        out = offload._EmbeddingRows.apply(w, ids, 0) if rows else torch.nn.functional.embedding(ids, w, 0)
        scale = torch.arange(1.0, out.numel() + 1).reshape(out.shape).to(dtype)  # a different weight per slot
        return (out * scale).sum() + (w @ head).square().sum()  # the second term: a tied head's use of w

    grads, outs = [], []
    for rows in (False, True):
        w = weight.clone().requires_grad_(True)
        for ids in batches:
            loss_of(w, ids, rows).backward()
        grads.append(w.grad)
        outs.append(offload._EmbeddingRows.apply(w, batches[0], 0) if rows else
                    torch.nn.functional.embedding(batches[0], w, 0))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)  # a lookup: the same values exactly
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-2)
    assert gathered[:2] == [5, 5]  # the distinct ids of each micro-batch crossed, not the 50 rows
    frozen = weight.clone()
    out = offload._EmbeddingRows.apply(frozen, batches[0], None)
    assert not out.requires_grad and frozen.grad is None
    torch.testing.assert_close(out, torch.nn.functional.embedding(batches[0], frozen))


# ---- optimizers ----------------------------------------------------------------------------------


def _small_updates(weight, optimizer, steps):
    """`steps` AdamW steps with a constant-sign gradient: each moves the weight by ~lr."""
    start = weight.detach().float().clone()
    for _ in range(steps):
        weight.grad = torch.ones_like(weight)
        optimizer.step()
        optimizer.zero_grad()
    return (start - weight.detach().float()).mean().item()


def test_bf16_weights_learn_with_stochastic_rounding_as_fp32_does():
    """A weight of 0.02 moved by lr 1e-5 per step is below bf16's resolution (2^-14 ~ 6e-5 there):
    plain bf16 AdamW loses every update, the optimizer build_optimizer picks for bf16 weights
    moves the weight as fp32 arithmetic does (on average)."""
    lr, steps = 1e-5, 100
    moved = {}
    for name, dtype in (("fp32", torch.float32), ("bf16_plain", torch.bfloat16), ("bf16", torch.bfloat16)):
        layer = torch.nn.Linear(64, 64, bias=False)
        torch.nn.init.constant_(layer.weight, 0.02)
        layer.to(dtype)
        opt = (torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0) if name == "bf16_plain"
               else build_optimizer(layer, lr, 0.0, "adamw_torch"))
        moved[name] = _small_updates(layer.weight, opt, steps)
    assert moved["fp32"] == pytest.approx(lr * steps, rel=0.02)
    assert moved["bf16_plain"] < 0.1 * lr * steps  # the problem the flag exists for
    assert moved["bf16"] == pytest.approx(moved["fp32"], rel=0.15)


def test_optimizer_choices():
    import bitsandbytes as bnb

    layer = torch.nn.Linear(128, 64)
    opt = build_optimizer(layer, 1e-3, 0.1, "adamw_8bit")
    assert isinstance(opt, bnb.optim.AdamW8bit)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # no decay on the bias
    x, y = torch.randn(32, 128), torch.randn(32, 64)
    losses = []
    for _ in range(20):
        loss = ((layer(x) - y) ** 2).mean()
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]
    with pytest.raises(UsageError, match="paged_adamw_8bit with bf16"):
        build_optimizer(torch.nn.Linear(4, 4).to(torch.bfloat16), 1e-3, 0.0, "paged_adamw_8bit")


# ---- flags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, match", [
    (["--activation_offload"], "add --use_gradient_checkpointing"),
    (["--use_dynamic_bsz", "--max_token_len_per_gpu", "10"], "max_token_len_per_gpu 10 is below"),
    (["--load_in_4bit"], "give --model_name_or_path"),
    (["--model_name_or_path", "x", "--load_in_4bit", "--load_in_8bit"], "choose one"),
    (["--ref_offload", "--ref_device", "cpu"], "--ref_offload and --ref_device cpu"),
    (["--ref_offload", "--use_lora"], "no copy to offload"),
    (["--model_name_or_path", "x", "--load_in_4bit", "--reward_device", "offload"], "quantised model"),
    (["--logprob_chunk_size", "-1"], "logprob_chunk_size must be >= 0"),
    (["--param_offload", "--offload_policy", " ,"], "needs --offload_policy"),
    (["--param_offload", "--mixed_precision", "fp16"], "loss scaler would not unscale"),
    (["--plan", "--gpu_memory", "lots"], "expected a card size as sold such as 24GB or 80GB, or an allocator budget such as 21GiB"),
])
def test_memory_flag_errors(argv, match):
    from utils.args import apply_presets
    from utils.cli import parse_args

    args, explicit = parse_args(train_grpo.Args, argv)
    apply_presets(args, explicit, train_grpo.TOY_PRESET, train_grpo.DEBUG_PRESET)
    with pytest.raises(UsageError, match=match):
        train_grpo.check_args(args, 1, explicit)


def test_param_offload_is_one_process_only():
    from utils.cli import parse_args

    args, explicit = parse_args(train_grpo.Args, ["--param_offload", "--prompts_per_step", "4"])
    with pytest.raises(UsageError, match="needs one process"):
        train_grpo.check_args(args, 2, explicit)


def test_offload_shorthand_becomes_a_placement():
    from utils.cli import parse_args

    args, explicit = parse_args(train_grpo.Args, ["--ref_offload", "--reward_offload"])
    train_grpo.check_args(args, 1, explicit)
    assert (args.ref_device, args.reward_device) == ("offload", "offload")


# ---- end to end ------------------------------------------------------------------------------------

SAME_MATH = ["--use_gradient_checkpointing", "--activation_offload", "--logprob_chunk_size", "7",
             "--use_dynamic_bsz", "--max_token_len_per_gpu", "100", "--param_offload", "--empty_cache_between_phases"]


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_levers_that_keep_the_math_give_the_baseline_first_step(run, tmp_path, script):
    """The issue's equivalence check: checkpointing, activation offload, chunking, dynamic
    batching and parameter offload all on -> the first step's loss and gradient norm equal the
    baseline's."""
    common = ["--max_steps", "1", "--save_strategy", "no", "--prompts_per_step", "16"]
    for extra, out in (([], "base"), (SAME_MATH, "levers")):
        result = run(common + extra + ["--output_dir", str(tmp_path / out)], script=script)
        assert result.returncode == 0, result.stderr[-3000:]
    base, levers = metrics_of(tmp_path / "base")[0], metrics_of(tmp_path / "levers")[0]
    assert base["optim/grad_norm"] > 0
    for key in ("loss/policy", "optim/grad_norm", "policy/entropy", "reward/mean"):
        assert levers[key] == pytest.approx(base[key], rel=1e-4, abs=1e-7), key
    assert not (tmp_path / "levers" / "final").exists()  # --save_strategy no


@pytest.fixture
def biased_local_model(tmp_path):
    """A tiny local model whose attention projections have biases (as Qwen2's do): the case
    where bitsandbytes' CPU 4-bit inference path breaks a later training forward."""
    from transformers import LlamaForCausalLM

    tokenizer = toy.build_tokenizer()
    config = toy.build_model(tokenizer).config
    config.attention_bias = True
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    return str(tmp_path / "model"), str(tmp_path / "tokenizer")


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_qlora_trains_on_cpu(run, tmp_path, biased_local_model, script):
    model, tokenizer = biased_local_model
    result = run(["--model_name_or_path", model, "--tokenizer_name_or_path", tokenizer, "--use_lora", "--load_in_4bit",
         "--use_gradient_checkpointing", "--max_steps", "2", "--prompts_per_step", "8", "--max_completion_length",
         "8", "--output_dir", str(tmp_path / "out"), "--save_strategy", "no", "--learning_rate", "1e-3"]
        + (["--num_generations", "4"] if script == "train_grpo.py" else []), script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path / "out")
    assert len(rows) == 2 and all(r["optim/grad_norm"] > 0 for r in rows)


def test_checkpointing_is_active_for_pretrained_models(tmp_path, biased_local_model, monkeypatch):
    """from_pretrained returns a model in eval mode, where transformers skips checkpointing: the
    script must put the policy in train mode. Counted through the offloaded checkpoint."""
    import utils.offload

    calls = []
    original = utils.offload.offloaded_checkpoint
    monkeypatch.setattr(utils.offload, "offloaded_checkpoint", lambda *a: calls.append(1) or original(*a))
    model, tokenizer = biased_local_model
    train_grpo.main(["--model_name_or_path", model, "--tokenizer_name_or_path", tokenizer, "--max_steps", "1",
                     "--prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4",
                     "--use_gradient_checkpointing", "--activation_offload", "--save_strategy", "no",
                     "--output_dir", str(tmp_path / "out")])
    assert len(calls) >= 2  # each decoder layer, each micro-batch


def test_chunked_logprobs_through_an_offloaded_model():
    """An offloaded reference (accelerate cpu_offload) keeps its weights on `meta` until its hooks
    load them: the chunked head must go through the hooked forward, not read the weight."""
    from utils.placement import Placement, place_model

    _, model = _model(seed=9)
    ids, mask = _batch(model.config.vocab_size)
    want, _ = completion_logprobs(model, ids, mask, 7)
    offloaded = place_model(copy.deepcopy(model), Placement("ref", "offload", torch.device("cpu")))
    assert offloaded.lm_head.weight.device.type == "meta"
    got = batched_completion_logprobs(offloaded, ids, mask, plan_micro_batches(mask, 7, batch_size=4), 1.0,
                                      chunk_size=5)
    real = mask[:, 5:].bool()
    torch.testing.assert_close(got[real], want.detach()[real], rtol=1e-5, atol=1e-6)


def test_phase_swap_moves_the_whole_model_for_its_phase_only():
    """--ref_device swap: the logprobs through a swapped model (inside its phase) equal the
    unplaced model's; every parameter and buffer is moved, a tied weight once; after the phase
    the model's tensors are their CPU storage again. (That they sit on the GPU during the phase
    only: tests/gpu/test_gpu_memory.py.)"""
    from utils.offload import resident
    from utils.placement import Placement, place_model

    _, model = _model(seed=9)
    ids, mask = _batch(model.config.vocab_size)
    want, _ = completion_logprobs(model, ids, mask, 7)
    swapped = place_model(copy.deepcopy(model), Placement("ref", "swap", torch.device("cpu")))
    tensors = list(swapped.parameters()) + list(swapped.buffers())
    before = {id(t): t.data_ptr() for t in tensors}
    swap = swapped.lean_rl_swap
    assert {id(t) for t, _ in swap.tensors} == {id(t) for t in tensors}
    assert len(swap.tensors) == len(tensors) < len(list(swapped.named_parameters(remove_duplicate=False))) + len(
        list(swapped.buffers()))  # the toy model ties its LM head to the embedding: moved once
    with resident(swapped):
        got = batched_completion_logprobs(swapped, ids, mask, plan_micro_batches(mask, 7, batch_size=4), 1.0)
    real = mask[:, 5:].bool()
    torch.testing.assert_close(got[real], want.detach()[real], rtol=1e-5, atol=1e-6)
    assert all(t.device.type == "cpu" and t.data_ptr() == before[id(t)] for t in tensors)


def test_phase_swap_of_a_trained_model_steps_as_placed_and_keeps_its_state_in_host_buffers():
    """--critic_device swap: three AdamW steps, each inside the model's `resident(write_back=True)` and, around the
    step, its OptimizerSwap's `resident()`, leave the same weights and moments as three steps of the same model
    never swapped (the CPU copies are real copies, so a lost write-back would show); between steps every parameter
    and every moment is a CPU tensor in a buffer kept from one step to the next, the 0-dim step counts where the
    optimizer made them; during the forward and backward the moments are not on the device."""
    from utils.offload import OptimizerSwap
    from utils.optim import state_tensors
    from utils.placement import Placement, place_model

    _, model = _model(seed=4)
    ids, mask = _batch(model.config.vocab_size)
    placed, swapped = copy.deepcopy(model), place_model(copy.deepcopy(model), Placement("critic", "swap",
                                                                                      torch.device("cpu")))
    swap = swapped.lean_rl_swap
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (placed, swapped)]
    moments_swap = OptimizerSwap(opts[1])
    addresses = []
    for _ in range(3):
        for m, opt, swapping in ((placed, opts[0], False), (swapped, opts[1], True)):
            with swap.resident(write_back=True) if swapping else contextlib.nullcontext():
                (m(input_ids=ids, attention_mask=mask).logits.float() ** 2).mean().backward()
                if swapping:  # the moments are in their host buffers while the gradients are computed
                    assert [t.data_ptr() for t in state_tensors(opt) if t.dim() > 0] == (addresses or [[]])[-1]
                with moments_swap.resident() if swapping else contextlib.nullcontext():
                    opt.step()
                opt.zero_grad(set_to_none=True)
        moments = [t for t in state_tensors(opts[1]) if t.dim() > 0]
        assert moments and all(t.device.type == "cpu" for t in moments)
        addresses.append([t.data_ptr() for t in moments])
        assert all(p.grad is None for p in swapped.parameters())
    assert addresses[0] == addresses[1] == addresses[2]  # the host buffers are reused, not allocated per step
    for (name, a), b in zip(placed.named_parameters(), swapped.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    for a, b in zip(state_tensors(opts[0]), state_tensors(opts[1])):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_optimizer_swap_moves_torchaos_quantised_moments_by_their_parts():
    """torchao's 8-bit moments (a tensor subclass): moved by their codes, scales and map, rebuilt as the same
    class, equal after a round trip, and back in the same host buffers the next time; the step count stays put."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from utils.offload import OptimizerSwap

    layer = torch.nn.Linear(64, 64, bias=False)

    class _Opt:  # what OptimizerSwap reads of an optimizer: its state
        state = {layer.weight: {"step": torch.tensor(3.0), "exp_avg": OptimState8bit.zeros((64, 64), signed=True)}}

    swap = OptimizerSwap(_Opt)
    moment = _Opt.state[layer.weight]["exp_avg"]
    moment.codes.random_(0, 255)
    want = moment.dequantize().clone()
    step = _Opt.state[layer.weight]["step"]
    ptrs = []
    for _ in range(2):
        with swap.resident():
            inside = _Opt.state[layer.weight]["exp_avg"]
            assert isinstance(inside, OptimState8bit) and inside.codes.data_ptr() != moment.codes.data_ptr()
        out = _Opt.state[layer.weight]["exp_avg"]
        assert isinstance(out, OptimState8bit) and _Opt.state[layer.weight]["step"] is step
        torch.testing.assert_close(out.dequantize(), want, rtol=0, atol=0)
        ptrs.append(out.codes.data_ptr())
    assert ptrs[0] == ptrs[1]
    disabled = OptimizerSwap(_Opt, enabled=False)
    with disabled.resident():
        assert _Opt.state[layer.weight]["exp_avg"] is out  # a no-op


def test_grpo_with_optimizer_offload_trains_as_without(run, tmp_path):
    """--optimizer_offload: the moments in host buffers outside each optimizer step; every metric but timings
    equal to a run without it over 3 steps (on the CPU the copies are real copies)."""
    rows = {}
    for name, extra in (("placed", []), ("offload", ["--optimizer_offload"])):
        result = run(["--max_steps", "3", "--save_strategy", "no", "--output_dir", str(tmp_path / name)] + extra)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = metrics_of(tmp_path / name)
    keys = [k for k in rows["placed"][0] if not k.startswith(("time/", "memory/", "throughput/"))]
    for a, b in zip(rows["placed"], rows["offload"]):
        assert {k: b[k] for k in keys} == {k: a[k] for k in keys}


def test_grpo_with_a_swapped_reference_and_reward_model_trains_as_without(run, tmp_path):
    """The whole step with --ref_device swap and --reward_device swap: the same KL, losses and
    rewards as with both models placed normally; the placement table says swap."""
    from utils import toy

    rm_tokenizer = toy.build_tokenizer()
    rm = toy.build_sequence_classifier(rm_tokenizer, seed=5)
    rm.save_pretrained(tmp_path / "rm")
    rm_tokenizer.save_pretrained(tmp_path / "rm")
    common = ["--max_steps", "2", "--save_strategy", "no", "--reward_model_name_or_path", str(tmp_path / "rm"),
              "--reward_funcs", "accuracy", "--reward_weights", "1,0.5"]
    rows = {}
    for name, extra in (("placed", []), ("swap", ["--ref_device", "swap", "--reward_device", "swap"])):
        result = run(common + extra + ["--output_dir", str(tmp_path / name)])
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = metrics_of(tmp_path / name)
    assert re.search(r"ref\s+cpu memory, on cpu for its phase \(swap\)", result.stdout)
    assert re.search(r"reward\s+cpu memory, on cpu for its phase \(swap\)", result.stdout)
    for a, b in zip(rows["placed"], rows["swap"]):
        for key in ("policy/kl", "loss/policy", "reward/mean", "reward/reward_model/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_levers_under_two_ddp_processes(tmp_path, script):
    """Checkpointing with activation offload (its recompute inside DDP's backward), token-budget
    micro-batches (the processes agree on a count), chunked head with an entropy bonus, the optimizer
    state offloaded between steps: two gloo processes end with identical weights (the script checks and
    fails otherwise)."""
    from helpers import launch_two_cpu_processes

    result = launch_two_cpu_processes(script, [
        "--max_steps", "2", "--output_dir", str(tmp_path), "--save_strategy", "no", "--use_gradient_checkpointing",
        "--activation_offload", "--use_dynamic_bsz", "--max_token_len_per_gpu", "100", "--logprob_chunk_size", "7",
        "--entropy_coef", "0.01", "--optimizer_offload"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "num_processes=2" in result.stdout
    # the two ranks' prints may share a line (concurrent writes): find them anywhere
    prints = re.findall(r"\[rank (\d)\] final weights fingerprint: (\([^)]*\))", result.stdout)
    assert sorted(rank for rank, _ in prints) == ["0", "1"] and prints[0][1] == prints[1][1], result.stdout[-2000:]


@pytest.mark.parametrize("optim", ["adamw_8bit", "adamw_4bit"])
def test_quantised_optimizer_state_resumes_exactly(run, tmp_path, optim):
    """bitsandbytes' and torchao's quantised moments go through the checkpoint: 2 steps, stop,
    resume to 4 gives the weights of 4 uninterrupted steps, bit for bit."""
    from helpers import assert_same_weights

    common = ["--save_steps", "2", "--optim", optim]
    for args in (["--max_steps", "4", "--output_dir", str(tmp_path / "full")],
                 ["--max_steps", "2", "--output_dir", str(tmp_path / "part")],
                 ["--max_steps", "4", "--output_dir", str(tmp_path / "part"), "--resume_from_checkpoint", "latest"]):
        result = run(common + args)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(tmp_path / "full" / "final", tmp_path / "part" / "final")


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_8bit"])
def test_param_offload_steps_on_the_cpu_and_resumes_exactly(run, tmp_path, optim):
    """--param_offload: the offloaded embedding (tied to the head) steps on the CPU (utils/optim.py HostStepped),
    its moments and master weights go through accelerate's checkpoint: 2 steps, stop, resume to 4 gives the
    weights of 4 uninterrupted steps, bit for bit; the run trains as it would without the flag (float32 AdamW:
    the same update, within rounding, so the same rewards and losses to 1e-4)."""
    from helpers import assert_same_weights

    common = ["--save_steps", "2", "--optim", optim]
    for args in (["--max_steps", "4", "--output_dir", str(tmp_path / "full"), "--param_offload"],
                 ["--max_steps", "2", "--output_dir", str(tmp_path / "part"), "--param_offload"],
                 ["--max_steps", "4", "--output_dir", str(tmp_path / "part"), "--param_offload",
                  "--resume_from_checkpoint", "latest"],
                 ["--max_steps", "4", "--output_dir", str(tmp_path / "plain")]):
        result = run(common + args)
        assert result.returncode == 0, result.stderr[-3000:]
    assert_same_weights(tmp_path / "full" / "final", tmp_path / "part" / "final")
    if optim == "adamw_torch":
        for got, want in zip(metrics_of(tmp_path / "full"), metrics_of(tmp_path / "plain")):
            for key in ("loss/policy", "optim/grad_norm", "reward/mean"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), (got["step"], key)


@pytest.mark.parametrize("device, expected", [("cuda", {"": 1}), ("cuda:0", {"": 0}), ("cpu", {"": "cpu"})])
def test_quantised_loading_places_a_bare_cuda_on_the_current_gpu(device, expected, monkeypatch):
    """--load_in_4bit / --load_in_8bit load straight onto the role's device. A bare "cuda" (`--actor_device cuda`,
    benchmarks/decode_step.py) has no index, and from_pretrained fails on {"": None} (seen on a GPU, 2026-12-06):
    it is the current GPU, as torch reads "cuda"."""
    from utils.modeling import quantization_kwargs

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert quantization_kwargs("4bit", torch.bfloat16, device)["device_map"] == expected
    assert quantization_kwargs("8bit", torch.bfloat16, device)["device_map"] == expected
    assert quantization_kwargs(None, torch.bfloat16, device) == {}


# the 16 NF4 levels (Dettmers et al. 2023, QLoRA, appendix E), for a reference computed here and not by bitsandbytes
NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
              1.0]


def test_unnested_4bit_weights_dequantise_with_each_blocks_exact_statistic(biased_local_model):
    """--use_bnb_nested_quant false ('4bit_unnested'): every 64-weight block of a quantised Linear dequantises to
    its NF4 levels times the block's exact absmax (the reference here: nearest level of w / absmax, from the saved
    weights); double quantisation (the default) stores the absmax in 8 bits, so its blocks come back scaled by a
    statistic off by up to about 1%. The storage difference per quantised weight is the planner's
    NESTED_SAVED_BYTES."""
    from transformers import LlamaForCausalLM

    bnb = pytest.importorskip("bitsandbytes")
    import utils.plan as P
    from utils.modeling import load_causal_lm

    model_dir, tokenizer_dir = biased_local_model
    tokenizer = toy.build_tokenizer()
    plain = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    weight = plain.model.layers[0].mlp.down_proj.weight.detach().float()  # [out, in]
    blocks = weight.reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    levels = torch.tensor(NF4_LEVELS)
    nearest = (blocks / absmax).unsqueeze(-1).sub(levels).abs().argmin(dim=-1)
    reference = (levels[nearest] * absmax).reshape(weight.shape)
    stored, dequantised = {}, {}
    for quantization in ("4bit", "4bit_unnested"):
        model = load_causal_lm(model_dir, tokenizer, torch.bfloat16, quantization=quantization, device="cpu")
        param = model.model.layers[0].mlp.down_proj.weight
        state = param.quant_state
        assert state.nested == (quantization == "4bit")
        dequantised[quantization] = bnb.functional.dequantize_4bit(param.data, state).float()
        numel = weight.numel()
        stats = state.absmax.numel() * state.absmax.element_size()
        if state.nested:
            stats += state.state2.absmax.numel() * state.state2.absmax.element_size()
        stored[quantization] = stats / numel
    exact = dequantised["4bit_unnested"]
    reference = reference.to(torch.bfloat16).float()  # bitsandbytes dequantises into the compute dtype
    assert (exact == reference).float().mean() > 0.999, (exact == reference).float().mean()
    assert (dequantised["4bit"] == reference).float().mean() < 0.9  # the test can tell the two apart
    nested_scale = (dequantised["4bit"].reshape(-1, 64).abs().amax(1) / exact.reshape(-1, 64).abs().amax(1))
    assert (nested_scale - 1).abs().max() < 0.02 and (nested_scale != 1).any()
    assert stored["4bit_unnested"] - stored["4bit"] == pytest.approx(P.NESTED_SAVED_BYTES, rel=0.01)
