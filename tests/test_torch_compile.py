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


def test_rollouts_run_the_compiled_blocks_eagerly():
    """Decoding gives each layer its own guards (its KV-cache layer): through the compiled blocks a
    rollout would use up the recompile limit and leave the update uncompiled. The rollout runs them
    eagerly (nothing compiled, same tokens) and they are compiled again afterwards."""
    from torch._dynamo.utils import counters

    from utils.generation import build_generation_config, generate_completions
    from utils.modeling import compile_repeated_blocks

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
