"""--torch_compile (regional compilation of the decoder layers): the blocks are compiled in place
(same parameters, same state_dict keys), and both scripts train to the same numbers as without it."""
import pytest
import torch

from helpers import metrics_of
from utils import toy


def test_compile_repeated_blocks_compiles_each_decoder_layer_in_place():
    from torch._dynamo.utils import counters

    from utils.modeling import compile_repeated_blocks

    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer)
    keys, params = list(model.state_dict()), [p.data_ptr() for p in model.parameters()]
    ids = torch.randint(0, len(tokenizer), (2, 6))
    expected = model(input_ids=ids).logits
    assert compile_repeated_blocks(model) == model.config.num_hidden_layers
    assert list(model.state_dict()) == keys and [p.data_ptr() for p in model.parameters()] == params
    frames = counters["frames"]["ok"]
    torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-5)
    assert counters["frames"]["ok"] > frames  # the layers ran through torch.compile


def test_compiled_blocks_compile_once_for_every_batch_and_sequence_length():
    """The layers are compiled with dynamic shapes from their first call: a step's micro-batches and the next
    steps' longer or shorter sequences (and a smaller last micro-batch) run the same compiled graphs, where
    torch.compile's default specialised on the first shape and compiled again at each new length and batch size
    (the second step's reference and update on a GPU), with the same numbers as the eager layers."""
    import copy

    from torch._dynamo.utils import counters

    from utils.modeling import compile_repeated_blocks

    tokenizer = toy.build_tokenizer()
    torch.manual_seed(0)
    eager = toy.build_model(tokenizer)
    model = copy.deepcopy(eager)
    compile_repeated_blocks(model)
    frames = None
    for rows, length in [(4, 40), (4, 52), (3, 52), (4, 61), (2, 47)]:
        ids = torch.randint(3, len(tokenizer), (rows, length))
        for m in (eager, model):
            m.zero_grad()
            m(input_ids=ids).logits.float().pow(2).mean().backward()
        frames = counters["frames"]["total"] if frames is None else frames
        assert counters["frames"]["total"] == frames, (rows, length)  # nothing compiled after the first shape
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rollouts_run_the_compiled_blocks_eagerly():
    """Decoding gives each layer its own guards (its KV-cache layer): through the compiled blocks a
    rollout would use up the recompile limit and leave the update uncompiled. The rollout runs them
    eagerly (nothing compiled, same tokens) and they are compiled again afterwards."""
    from torch._dynamo.utils import counters

    from utils.generation import build_generation_config, generate_completions
    from utils.modeling import compile_repeated_blocks

    torch._dynamo.reset()  # compiled code of an earlier test's layers (dynamic shapes) would serve these: no frame
    tokenizer = toy.build_tokenizer()
    model = toy.build_model(tokenizer)
    prompts = torch.randint(3, len(tokenizer), (4, 5))
    mask = torch.ones_like(prompts)
    config = build_generation_config(6, 1.0, 1.0, 0, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    torch.manual_seed(0)
    expected = generate_completions(model, prompts, mask, config, [tokenizer.eos_token_id])[0]
    compile_repeated_blocks(model)
    frames = counters["frames"]["total"]
    torch.manual_seed(0)
    tokens = generate_completions(model, prompts, mask, config, [tokenizer.eos_token_id])[0]
    assert counters["frames"]["total"] == frames  # no frame went to torch.compile during the rollout
    assert torch.equal(tokens, expected)
    model(input_ids=prompts)
    assert counters["frames"]["total"] > frames  # the blocks are compiled again after it


def test_activation_offload_under_torch_compile_compiles_the_layer_and_its_recompute():
    """--activation_offload with --torch_compile: the offload (host copies, RNG state, the link to the previous
    layer's input) stays out of torch.compile, which broke the layer's graph there and recompiled on that link;
    the layer's forward is compiled on its own and runs compiled in the forward and in the backward's recompute
    (one graph for both since the offload is non-reentrant: the forward runs with gradients on), the gradients
    those of the eager run, no other graph break, and no recompile once the step's shapes have been seen."""
    import copy

    from torch._dynamo.utils import counters

    from utils.modeling import compile_repeated_blocks
    from utils.offload import enable_activation_offload

    import utils.offload

    torch._dynamo.reset()
    counters.clear()
    tokenizer = toy.build_tokenizer()
    torch.manual_seed(0)
    base = toy.build_model(tokenizer).train()
    ids = torch.randint(3, len(tokenizer), (2, 7))
    grads = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        enable_activation_offload(model)
        layers = model.config.num_hidden_layers
        if compiled:
            compile_repeated_blocks(model)
        calls, compiled_layer = [], utils.offload._compiled_layer  # each call of the compiled layer, counted
        utils.offload._compiled_layer = lambda *a: calls.append(1) or compiled_layer(*a)
        try:
            for step in range(3):
                model.zero_grad()
                before = len(calls)
                loss = model(input_ids=ids).logits.float().pow(2).mean()
                forward_calls = len(calls) - before
                loss.backward()
                if compiled:  # every layer ran compiled in the forward, and again in the backward's recompute
                    assert forward_calls == layers and len(calls) - before == 2 * layers, (forward_calls, len(calls))
                if compiled and step == 1:
                    frames = counters["frames"]["total"]
        finally:
            utils.offload._compiled_layer = compiled_layer
        assert bool(calls) == compiled
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert counters["frames"]["total"] == frames  # step 3 compiled nothing new
    assert counters["graph_break"] and all("torch.compiler.disable" in k for k in counters["graph_break"])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 4
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_scripts_train_the_same_with_torch_compile(run, tmp_path, script):
    common = ["--max_steps", "2", "--use_gradient_checkpointing", "--save_strategy", "no"]
    for name, extra in (("eager", []), ("compiled", ["--torch_compile"])):
        result = run(common + extra + ["--output_dir", str(tmp_path / name)], script=script)
        assert result.returncode == 0, result.stderr[-3000:]
    eager, compiled = metrics_of(tmp_path / "eager"), metrics_of(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 2
    for a, b in zip(eager, compiled):
        for key in ("loss/policy", "optim/grad_norm"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), (key, a[key], b[key])
