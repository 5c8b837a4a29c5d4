"""Built-in rewards on real GSM8K-format strings, and loading user reward functions."""
import math
import textwrap

import pytest

from utils.cli import UsageError, UserCodeError
from utils.rewards import (accuracy, call_reward_function, check_reward_signatures, extract_answer, format,
                           load_reward_function, score_completions)

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
    kwargs = dict(completions=["ab", "abcd"], prompts=["p", "q"], answer=["1", "2"])
    assert call_reward_function(fn, "length_penalty", kwargs, 2, step=1) == [-0.2, -0.4]
    values = call_reward_function(load_reward_function(f"{path}:skip_some"), "skip_some",
                                  dict(completions=["", "x"], prompts=["p", "q"]), 2, step=1)
    assert math.isnan(values[0]) and values[1] == 1.0
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward_function("my_rewards:length_penalty")(completions=["abc"], prompts=[""], answer=[""]) == [-0.3]
    assert load_reward_function("my_rewards.length_penalty") is load_reward_function("my_rewards:length_penalty")


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


def f_raises(completions, **kwargs):
    return [1 / 0 for _ in completions]


@pytest.mark.parametrize("fn, message", [
    (lambda completions, **kw: [1.0], "reward function 'f' at step 3 returned 1 values for 2 completions"),
    (lambda completions, **kw: ["1.0", "0.0"], "returned a str ('1.0') for completion 0; expected a list of 2 numbers"),
    (lambda completions, **kw: 0.5, "returned a float (0.5); expected a list of 2 numbers (or None)"),
    (lambda completions, **kw: None, "returned None; expected a list"),
    (lambda completions, **kw: "1", "returned a str ('1')"),
    (f_raises, "reward function 'f' at step 3 raised ZeroDivisionError: division by zero"),
])
def test_reward_function_failures_name_the_function_and_the_step(fn, message):
    with pytest.raises(UserCodeError) as exc:
        call_reward_function(fn, "f", dict(completions=["a", "b"], prompts=["p", "q"]), 2, step=3)
    assert message in str(exc.value)
    if fn is f_raises:  # the user's own frames are kept, ours are not
        assert "in f_raises" in exc.value.user_traceback and "1 / 0" in exc.value.user_traceback
        assert "utils/rewards.py" not in exc.value.user_traceback


def test_tensors_and_numpy_arrays_are_accepted():
    import numpy as np
    import torch

    kwargs = dict(completions=["a", "b"], prompts=["p", "q"])
    assert call_reward_function(lambda **kw: torch.tensor([1.0, 2.0]), "f", kwargs, 2, step=1) == [1.0, 2.0]
    assert call_reward_function(lambda **kw: np.array([0.5, 1]), "f", kwargs, 2, step=1) == [0.5, 1.0]


def test_trl_arguments_and_conversational_completions():
    """What TRL passes: prompts, completions (messages when the prompts are), completion_ids
    without padding, trainer_state, every column; a function without **kwargs gets what it takes."""
    import torch

    seen = {}

    def trl_style(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, kw=kwargs)
        return [float(len(c[0]["content"])) for c in completions]

    def narrow(completions, answer):
        return [1.0 if answer[i] in c[0]["content"] else 0.0 for i, c in enumerate(completions)]

    prompts = [[{"role": "user", "content": "1+1="}]] * 2
    ids = torch.tensor([[5, 6, 1, 0], [7, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    rewards = score_completions([("trl_style", trl_style), ("narrow", narrow)], ["2!", "x"], prompts,
                                {"answer": ["2", "2"], "level": [1, 1]}, "cpu", ids, mask, step=4, max_steps=10,
                                epoch=0.5)
    assert rewards.tolist() == [[2.0, 1.0], [1.0, 0.0]]
    assert seen["completions"] == [[{"role": "assistant", "content": "2!"}], [{"role": "assistant", "content": "x"}]]
    assert seen["ids"] == [[5, 6, 1], [7]]
    assert (seen["state"].global_step, seen["state"].max_steps, seen["state"].epoch) == (4, 10, 0.5)
    assert seen["kw"] == {"answer": ["2", "2"], "level": [1, 1]} and seen["prompts"] == prompts


def test_trainer_state_is_made_only_for_a_function_that_may_read_it(monkeypatch):
    """The built-ins and reward models read no trainer_state, so none is made for them (transformers' TrainerState
    imports its trainer's dependencies: seconds at a run's first step); a function taking it, by name or through
    **kwargs, gets it."""
    from utils import rewards

    made = []
    monkeypatch.setattr(rewards, "trainer_state", lambda *a: made.append(a) or "state")
    builtins = [("accuracy", rewards.accuracy), ("format", rewards.format)]
    out = score_completions(builtins, ["#### 2", "3"], ["1+1="] * 2, {"answer": ["2", "2"]}, "cpu")
    assert out.tolist() == [[1.0, 1.0], [0.0, 0.0]] and made == []

    def narrow(completions, answer):
        return [0.0] * len(completions)

    score_completions(builtins + [("narrow", narrow)], ["2"], ["1+1="], {"answer": ["2"]}, "cpu")
    assert made == []
    seen = {}

    def catch_all(completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    score_completions(builtins + [("catch_all", catch_all)], ["2"], ["1+1="], {"answer": ["2"]}, "cpu", step=3,
                      max_steps=9, epoch=0.25)
    assert made == [(3, 9, 0.25)] and seen["trainer_state"] == "state"


def test_all_none_rewards_warn_once_per_step(recwarn):
    def nothing(completions, **kw):
        return [None] * len(completions)

    fns = [("accuracy", accuracy), ("nothing", nothing)]
    for step in range(2):
        rewards = score_completions(fns, ["7", "8"], ["3+4=", "3+4="], {"answer": ["7", "7"]}, "cpu", step=step)
        assert rewards[:, 0].tolist() == [1.0, 0.0] and rewards[:, 1].isnan().all()
    messages = [str(w.message) for w in recwarn if "gave no reward" in str(w.message)]
    assert messages == ["step 1: nothing gave no reward (None or NaN) to any of the 2 completions; they get 0 from it",
                        "step 2: nothing gave no reward (None or NaN) to any of the 2 completions; they get 0 from it"]


def _needs_completion(completion, **kw):
    return [0.0]


def _positional(completions, /):
    return [0.0]


def _takes_nothing_passed(text):  # noqa: ARG001
    return [0.0]


@pytest.mark.parametrize("fn, message", [
    (_needs_completion, "reward function 'f' needs 'completion', not passed (did you mean completions?)"),
    (_positional, "has the positional-only parameter 'completions'"),
    (lambda completions, log_metric: [0.0], "needs 'log_metric', TRL passes it, this script does not"),
    (_takes_nothing_passed, "needs 'text', not passed; it receives prompts, completions, completion_ids, "
                            "trainer_state and the columns answer, level"),
    (lambda x=1: [0.0], "takes none of what is passed"),
])
def test_signatures_that_cannot_take_what_is_passed_are_refused(fn, message):
    with pytest.raises(UsageError) as exc:
        check_reward_signatures([("f", fn)], ["question", "answer", "level"], "question", "answer")
    assert message in str(exc.value)


def test_signatures_that_fit_are_accepted():
    fns = [("a", accuracy), ("b", lambda completions, level, trainer_state=None: [0.0]),
           ("c", lambda prompts, completions, completion_ids, trainer_state, **kw: [0.0])]
    check_reward_signatures(fns, ["question", "answer", "level"], "question", "answer")


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
