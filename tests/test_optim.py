"""utils/optim.py. The torchao optimizers step parameters above utils.optim.STEP_SLICE elements one slice at a time
(their temporaries bounded by the slice): the same update as torchao's own whole-parameter step, checked against it.
The learning-rate schedules, written there, checked against transformers' get_scheduler."""
import copy
import io

import pytest
import torch

from utils import optim


def model_and_grads(dtype, seed=0):
    torch.manual_seed(seed)
    # a 64 x 384 embedding (24576 elements: 6 slices of 4096, the last one short when the slice is 5120) and
    # a small linear layer that stays whole
    model = torch.nn.Sequential(torch.nn.Embedding(64, 384), torch.nn.Linear(384, 16)).to(dtype)
    grads = [[torch.randn_like(p) * 1e-2 for p in model.parameters()] for _ in range(3)]
    return model, grads


def run_steps(model, opt, grads, scheduler=None):
    """One step per entry of `grads` (a gradient for each trainable parameter, in order)."""
    for step_grads in grads:
        for p, g in zip([p for p in model.parameters() if p.requires_grad], step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        if scheduler:
            scheduler.step()
        opt.zero_grad(set_to_none=True)


def state_of(opt, p):
    return {k: (v.dequantize() if hasattr(v, "dequantize") else v).clone() for k, v in opt.state[p].items()}


@pytest.mark.parametrize("slice_elements", [4096, 5120])
def test_sliced_4bit_step_equals_torchaos_whole_step_bit_for_bit(monkeypatch, slice_elements):
    import torchao.optim

    model, grads = model_and_grads(torch.float32)
    reference = copy.deepcopy(model)
    monkeypatch.setattr(optim, "STEP_SLICE", slice_elements)
    sliced = optim.build_optimizer(model, 1e-3, weight_decay=0.1, optim="adamw_4bit")
    decay = [p for p in reference.parameters() if p.ndim >= 2]
    whole = torchao.optim.AdamW4bit([{"params": decay, "weight_decay": 0.1},
                                     {"params": [p for p in reference.parameters() if p.ndim < 2],
                                      "weight_decay": 0.0}], lr=1e-3)
    assert isinstance(sliced, torchao.optim.AdamW4bit) and type(sliced).__name__ == "AdamW4bit"
    run_steps(model, sliced, grads)
    run_steps(reference, whole, grads)
    embedding, reference_embedding = model[0].weight, reference[0].weight
    assert not torch.equal(embedding, model_and_grads(torch.float32)[0][0].weight)  # it moved
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert type(sliced.state[embedding]["exp_avg"]).__name__ == "OptimState4bit"  # quantised, sliced in place
    for key, value in state_of(sliced, embedding).items():
        assert torch.equal(value, state_of(whole, reference_embedding)[key]), key


@pytest.mark.parametrize("name, torchao_class", [("adamw_8bit", "AdamW8bit"), ("adamw_4bit", "AdamW4bit"),
                                                 ("adamw_torch", "_AdamW")])
def test_sliced_bf16_step_keeps_the_moments_and_rounds_within_one_ulp_a_step(monkeypatch, name, torchao_class):
    """bf16 weights: stochastic rounding draws other random numbers per slice, so after 3 steps the weights
    agree to 3 bf16 steps (each step rounds to either side), the moments (weight decay 0: they see only the
    gradients) exactly."""
    import torchao.optim

    model, grads = model_and_grads(torch.bfloat16)
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    monkeypatch.setattr(optim, "STEP_SLICE", 4096)
    sliced = optim.build_optimizer(model, 1e-3, optim=name)
    whole = getattr(torchao.optim, torchao_class)(reference.parameters(), lr=1e-3, weight_decay=0.0,
                                                  bf16_stochastic_round=True)
    assert type(sliced).__name__ == torchao_class and isinstance(sliced, type(whole))
    run_steps(model, sliced, grads)
    run_steps(reference, whole, grads)
    for p, q, r in zip(model.parameters(), reference.parameters(), initial.parameters()):
        # one bf16 step at the largest magnitude the weight had (>= the rounding step on its way to 0)
        ulp = torch.finfo(torch.bfloat16).eps * torch.stack([p, q, r]).float().abs().amax(0)
        assert ((p.float() - q.float()).abs() <= 3 * ulp).all()
        assert not torch.equal(p, q) or p.numel() < 4096  # the sliced one drew other random numbers
    for key, value in state_of(sliced, model[0].weight).items():
        assert torch.equal(value, state_of(whole, reference[0].weight)[key]), key


def test_the_default_slice_is_a_multiple_of_every_block_size():
    assert optim.STEP_SLICE % 256 == 0 and optim.STEP_SLICE % 128 == 0 and optim.STEP_SLICE >= 3584 * 18944 // 2


def test_sliced_state_goes_through_a_state_dict_and_resumes_exactly(monkeypatch):
    """2 steps, state_dict, a new optimizer loads it, 1 more step == 3 uninterrupted steps (float32, 4-bit moments
    stepped in slices): the slices are views of the state the checkpoint holds, not copies."""
    monkeypatch.setattr(optim, "STEP_SLICE", 4096)
    model, grads = model_and_grads(torch.float32)
    resumed_model = copy.deepcopy(model)
    full = optim.build_optimizer(model, 1e-3, weight_decay=0.1, optim="adamw_4bit")
    run_steps(model, full, grads)
    first = optim.build_optimizer(resumed_model, 1e-3, weight_decay=0.1, optim="adamw_4bit")
    run_steps(resumed_model, first, grads[:2])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # as the checkpoint saves it
    buffer.seek(0)
    second = optim.build_optimizer(resumed_model, 1e-3, weight_decay=0.1, optim="adamw_4bit")
    second.load_state_dict(torch.load(buffer, weights_only=False))
    run_steps(resumed_model, second, grads[2:])
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", optim.SCHEDULERS)
@pytest.mark.parametrize("total, warmup", [(10, 0), (10, 3), (7, 7), (100, 10), (1, 0)])
def test_schedules_equal_transformers_get_scheduler(name, total, warmup):
    """The schedules utils/optim.py writes itself (to spare every run transformers' trainer imports) against
    transformers' get_scheduler, step by step past the end."""
    from transformers import get_scheduler

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
        sched, out = make(opt), []
        for _ in range(total + 3):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    theirs = "constant_with_warmup" if name == "constant" and warmup else name
    expected = lrs(lambda o: get_scheduler(theirs, o, num_warmup_steps=warmup, num_training_steps=total))
    assert lrs(lambda o: optim.build_scheduler(o, name, total, warmup)) == pytest.approx(expected, abs=1e-12)


# ---- --param_offload: the offloaded weights step on the CPU (HostStepped) --------------------------------------


def _offloaded_toy(dtype, embedding_only=False):
    from utils import toy
    from utils.offload import ParamOffload

    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer, seed=5, hidden_size=32, num_layers=1).to(dtype)
    if embedding_only:
        model.requires_grad_(False).get_input_embeddings().weight.requires_grad_(True)
    ParamOffload(model, "embedding", "cpu")  # the toy model's head is tied: it leaves with the embedding
    return model


def _random_grads(model, steps, seed):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype) for p in model.parameters() if p.requires_grad]
            for _ in range(steps)]


def test_offloaded_float32_weights_step_as_torchs_adamw_and_the_rest_through_the_inner_optimizer():
    """float32 weights, adamw_torch: the offloaded embedding steps through torch's fused CPU AdamW and every other
    weight through the inner AdamW; 3 steps under a schedule equal 3 steps of one plain (for-loop) AdamW over
    all of them, decay on matrices only, within float32 rounding."""
    model = _offloaded_toy(torch.float32)
    reference = copy.deepcopy(model)
    opt = optim.build_optimizer(model, 1e-2, weight_decay=0.1)
    assert isinstance(opt, optim.HostStepped) and opt.inner is not None
    embedding = model.get_input_embeddings().weight
    assert [p for p in opt.host_params] == [embedding] and opt.masters[0] is embedding
    assert all(embedding is not p for g in opt.inner.param_groups for p in g["params"])
    decay = [p for p in reference.parameters() if p.ndim >= 2]
    plain = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                               {"params": [p for p in reference.parameters() if p.ndim < 2], "weight_decay": 0.0}],
                              lr=1e-2, foreach=False)
    halve = lambda step: 0.5 ** step  # noqa: E731: one schedule must reach both optimizers' groups
    grads = _random_grads(model, 3, seed=1)
    run_steps(model, opt, grads, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, halve))
    run_steps(reference, plain, grads, scheduler=torch.optim.lr_scheduler.LambdaLR(plain, halve))
    assert opt.host.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    assert embedding.grad is None  # zero_grad reaches the offloaded weights


def test_offloaded_bf16_weight_steps_a_float32_master_and_resumes_exactly():
    """bf16 weights: the offloaded embedding keeps a float32 master copy stepped by AdamW in float32 (against a
    plain AdamW on a float32 copy of the start) and takes it rounded to nearest; only it trains here, so there is
    no inner optimizer. Its state_dict (moments and master) through torch.save resumes bit for bit: 2 steps, save,
    a new optimizer loads, 2 more, against 4 uninterrupted."""
    model = _offloaded_toy(torch.bfloat16, embedding_only=True)
    start = copy.deepcopy(model)
    opt = optim.build_optimizer(model, 1e-3, optim="adamw_8bit")
    assert isinstance(opt, optim.HostStepped) and opt.inner is None
    embedding = model.get_input_embeddings().weight
    master = embedding.detach().float().clone().requires_grad_(True)
    plain = torch.optim.AdamW([master], lr=1e-3, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        embedding.grad = (torch.randn(embedding.shape, generator=g) * 1e-2).bfloat16()
        master.grad = embedding.grad.float()
        opt.step()
        plain.step()
        opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(opt.masters[0], master.detach(), rtol=1e-5, atol=1e-8)
        assert torch.equal(embedding, opt.masters[0].bfloat16())  # rounded to nearest, not stochastically
    assert not torch.equal(embedding, start.get_input_embeddings().weight)  # 1e-3 steps move bf16 weights

    grads = _random_grads(start, 4, seed=3)
    full = copy.deepcopy(start)
    full_opt = optim.build_optimizer(full, 1e-3, optim="adamw_8bit")
    run_steps(full, full_opt, grads)
    part = copy.deepcopy(start)
    part_opt = optim.build_optimizer(part, 1e-3, optim="adamw_8bit")
    run_steps(part, part_opt, grads[:2])
    buffer = io.BytesIO()
    torch.save({"model": part.state_dict(), "optimizer": part_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = copy.deepcopy(start)
    resumed.load_state_dict(saved["model"])
    resumed_opt = optim.build_optimizer(resumed, 1e-3, optim="adamw_8bit")
    resumed_opt.load_state_dict(saved["optimizer"])
    run_steps(resumed, resumed_opt, grads[2:])
    assert torch.equal(resumed.get_input_embeddings().weight, full.get_input_embeddings().weight)
    assert torch.equal(resumed_opt.masters[0], full_opt.masters[0])
    with pytest.raises(Exception, match="cannot resume it exactly"):
        resumed_opt.load_state_dict(full_opt.inner.state_dict() if full_opt.inner else {"state": {}, "param_groups": []})
