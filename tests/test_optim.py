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


def run_steps(model, opt, grads):
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        opt.step()
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
