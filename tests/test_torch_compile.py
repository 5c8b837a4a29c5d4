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
