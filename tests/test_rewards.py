"""Built-in rewards on real GSM8K-format strings, and loading user reward functions."""
import math
import textwrap

import pytest

from utils.cli import UsageError
from utils.rewards import (accuracy, call_reward_function, extract_answer, format, load_reward_function)

GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize("completion, expected", [
    ("She sold 48 in April and 24 in May, so 48 + 24 = 72.\n#### 72", 1.0),
    ("48 + 24 = 72 clips. The answer is \\boxed{72}.", 1.0),
    ("In total 48+24 = 72", 1.0),                      # no marker: the last number counts
    ("#### 72.00", 1.0),
    ("The answer is $72.", 1.0),
    ("She sold 48 + 24 = 72 clips... #### 70", 0.0),   # the marked answer wins over earlier numbers
    ("\\boxed{71} but #### 72", 0.0),                   # boxed wins over ####
    ("I am not sure.", 0.0),                           # malformed: no number at all
    ("#### ", 0.0),
    ("", 0.0),
    ("#### 72 apples, sorry 73", 1.0),
])
def test_accuracy_on_gsm8k_strings(completion, expected):
    assert accuracy([completion], answer=[GSM8K_REFERENCE]) == [expected]


def test_accuracy_number_formats_and_references():
    assert accuracy(["#### 1,234"], answer=["#### 1234"]) == [1.0]
    assert accuracy(["\\boxed{\\frac{1}{2}}"], answer=["0.5"]) == [1.0]
    assert accuracy(["#### -3"], answer=["\\boxed{-3}"]) == [1.0]
    assert accuracy(["#### 3"], answer=["-3"]) == [0.0]
    assert accuracy(["\\boxed{2}"], answer=["\\boxed{2"]) == [1.0]  # unclosed box in the reference: last number
    assert accuracy(["7"], answer=["no number here"]) == [None]    # reward does not apply


def test_extract_answer_nested_boxes():
    assert extract_answer("so \\boxed{\\text{x} = {4}} hmm") == 4.0
    assert extract_answer("\\boxed{1} then \\boxed{2}") == 2.0
    assert extract_answer("no answer", fallback_last_number=False) is None


def test_format_reward():
    assert format(["work... #### 72", "\\boxed{5}", "the answer is 72", "#### seventy", "\\boxed{"]) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_user_reward_from_file_and_module(tmp_path, monkeypatch):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent("""
        def length_penalty(completions, prompts, answer, **kwargs):
            return [-len(c) / 10 for c in completions]
        def skip_some(completions, **kwargs):
            return [None if c == "" else 1.0 for c in completions]
        CONSTANT = 3
    """))
    fn = load_reward_function(f"{path}:length_penalty")
    assert call_reward_function(fn, "length_penalty", ["ab", "abcd"], ["p", "q"], {"answer": ["1", "2"]}) == [-0.2, -0.4]
    values = call_reward_function(load_reward_function(f"{path}:skip_some"), "skip_some", ["", "x"], ["p", "q"], {})
    assert math.isnan(values[0]) and values[1] == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("my_rewards:length_penalty")(completions=["abc"], prompts=[""], answer=[""]) == [-0.3]


@pytest.mark.parametrize("spec, message", [
    ("acuracy", "unknown reward function 'acuracy'"),
    ("missing_file.py:f", "does not exist"),
    ("{tmp}/bad.py:f", "cannot load"),
    ("{tmp}/good.py:nope", "has no function 'nope'"),
    ("{tmp}/good.py:CONSTANT", "has no function 'CONSTANT'"),
    ("no_such_module_xyz:f", "cannot load"),
])
def test_bad_reward_specs(tmp_path, spec, message):
    (tmp_path / "bad.py").write_text("def f(:\n")
    (tmp_path / "good.py").write_text("CONSTANT = 1\ndef g(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(UsageError, match=message):
        load_reward_function(spec.format(tmp=tmp_path))


def test_reward_function_returning_wrong_length():
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        call_reward_function(lambda completions, **kw: [1.0], "f", ["a", "b"], ["p", "q"], {})


def test_reward_model_reads_the_last_real_token_whatever_the_padding(tmp_path):
    import torch

    from utils import toy
    from utils.placement import Placement
    from utils.rewards import RewardModel

    tokenizer = toy.build_tokenizer()
    toy.build_sequence_classifier(tokenizer, seed=3).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    rm = RewardModel(str(tmp_path), Placement("reward", "device", torch.device("cpu")), torch.float32, batch_size=8)
    prompts, completions = ["1+1=", "2+2=", "3+3="], ["2", "4 and some more text", ""]
    together = rm(completions, prompts)
    alone = [rm([c], [p])[0] for p, c in zip(prompts, completions)]
    assert together == pytest.approx(alone, abs=1e-5)
    assert len(set(round(x, 6) for x in together)) == 3
