"""Every row of the README's "Bad input" table through the real script: exit code 2, exactly one
stderr line (the table's), no traceback, no model loaded. User-code failures through the real
scripts: one block, exit code 1, no frame of this project's code. A run's stderr holds none of the
other libraries' start-up warnings; the CPU thread count is chosen, printed, and does not change
what the debug run learns beyond noise."""
import importlib
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import utils.modeling
from helpers import ROOT, metrics_of

FILES = {  # the files the table's commands name (the README's text describes them)
    "train.jsonl": "\n".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(4)) + "\n",
    "numbers.jsonl": "\n".join(json.dumps({"prompt": i, "answer": str(i)}) for i in range(3, 7)) + "\n",
    "token_ids.jsonl": json.dumps({"prompt": [1, 2, 3], "answer": "6"}) + "\n",
    "a_file.txt": "not a folder\n",
    "rewards.py": "def needs_text(text):\n    return [0.0 for _ in text]\n",
}


def readme_table():
    """(environment, script, argv, line) for each row of the README's "Bad input" table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("### Bad input", 1)[1].split("\n## ", 1)[0]
    rows = []
    for command, line in re.findall(r"^\| `([^`]+)` \| `(.+)` \|$", section, flags=re.M):
        tokens = shlex.split(command)
        env = dict(t.split("=", 1) for t in tokens if re.match(r"^[A-Z_]+=", t))
        tokens = [t for t in tokens if not re.match(r"^[A-Z_]+=", t)]
        assert tokens[0] == "python", command
        rows.append((env, tokens[1], tokens[2:], line))
    return rows


ROWS = readme_table()


def test_the_table_covers_the_inputs_tried():
    flags = {a for _, _, argv, _ in ROWS for a in argv if a.startswith("--")}
    assert len(ROWS) >= 18
    assert {"--lerning_rate", "--use_vllm", "--model_name_or_path", "--dataset_name", "--dataset_split", "--output_dir",
            "--learning_rate", "--reward_funcs", "--gradient_accumulation_steps"} <= flags


@pytest.fixture
def no_model_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    for name in ("load_causal_lm", "load_tokenizer", "load_value_model"):
        monkeypatch.setattr(utils.modeling, name, boom)


@pytest.mark.parametrize("env, script, argv, line", ROWS, ids=[" ".join(r[2]) for r in ROWS])
def test_bad_input_is_one_line_and_exit_2(env, script, argv, line, tmp_path, monkeypatch, capfd, no_model_loading):
    for name, content in FILES.items():
        (tmp_path / name).write_text(content)
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    main = importlib.import_module(script.removesuffix(".py")).main
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capfd.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    assert err.splitlines() == [line], err  # exactly one line on stderr, the table's


def test_one_row_as_a_subprocess(tmp_path):
    """The same through `python train_grpo.py`: nothing else reaches stderr (library warnings included)."""
    env_row = next(r for r in ROWS if r[2][:1] == ["--dataset_name"] and r[2][1] == "numbers.jsonl")
    for name, content in FILES.items():
        (tmp_path / name).write_text(content)
    result = subprocess.run([sys.executable, os.path.join(ROOT, env_row[1]), *env_row[2]], cwd=tmp_path,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.splitlines() == [env_row[3]], result.stderr


# ---- user code that fails during the run: one block, exit code 1 --------------------------------

USER_CODE = '''
def boom(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 2:  # the third step
        return [1 / 0 for _ in completions]
    return [0.0 for _ in completions]


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)
'''


def run_failing(script, tmp_path, funcs, *extra):
    (tmp_path / "user_rewards.py").write_text(USER_CODE)
    out = tmp_path / "out"
    sizes = (["--prompts_per_step", "4", "--num_generations", "4"] if script == "train_grpo.py" else
             ["--prompts_per_step", "16", "--num_mini_batches", "1", "--ppo_epochs", "1"])
    cmd = [sys.executable, os.path.join(ROOT, script), "--reward_funcs", funcs, "--max_steps", "4", "--save_steps",
           "2", "--per_device_train_batch_size", "16", "--output_dir", str(out), *sizes, *extra]
    result = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    block = result.stderr[result.stderr.index("error: "):]
    for ours in ("train_grpo.py\"", "train_ppo.py\"", os.path.join(ROOT, "utils")):  # no frame of this project
        assert ours not in block, block
    return block, out


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_a_reward_function_that_raises_is_one_block_with_the_checkpoint(script, tmp_path):
    block, out = run_failing(script, tmp_path, "user_rewards.py:boom")
    lines = block.rstrip("\n").splitlines()
    assert lines[0] == "error: reward function 'boom' at step 3 raised ZeroDivisionError: division by zero"
    assert lines[1] == "Traceback of your code (most recent call last):"
    assert 'user_rewards.py", line 4, in boom' in lines[2] and "1 / 0" in lines[3]
    assert lines[-2] == "ZeroDivisionError: division by zero"
    assert lines[-1] == (f"step 3 failed in user code (rank 0); saved {out}/checkpoint-2, the state after step 2: fix "
                         f"the code, then resume with --resume_from_checkpoint {out}/checkpoint-2")
    assert "Traceback (most recent call last)" not in block and all(
        line.startswith(("  File", "    ")) for line in lines[2:-2])  # the user's frames only


@pytest.mark.parametrize("funcs, message", [  # the other wrong values: tests/test_rewards.py
    ("user_rewards.py:one_short", "error: reward function 'one_short' at step 1 returned 63 values for 64 completions; "
                                  "expected a list of 64 numbers (or None), one per completion"),
])
def test_wrong_return_values_name_the_function_and_the_step(funcs, message, tmp_path):
    block, out = run_failing("train_grpo.py", tmp_path, funcs, "--num_generations", "16")
    lines = block.rstrip("\n").splitlines()
    assert lines[0].startswith(message), lines[0]
    assert lines[1] == "step 1 failed in user code; nothing saved (no step had finished); fix it and start again"
    assert len(lines) == 2


def test_a_failing_reward_model_is_one_block(tmp_path):
    """A reward model whose forward fails (its embedding smaller than the ids it gets): the model's
    own frames are shown, not this project's."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from utils import toy

    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    block, _ = run_failing("train_grpo.py", tmp_path, "none", "--reward_model_name_or_path", str(tmp_path / "rm"))
    first = block.splitlines()[0]
    assert first.startswith(f"error: reward model {tmp_path / 'rm'} at step 1 raised IndexError"), first
    assert "modeling_llama.py" in block and "Traceback of your code" in block


# ---- start-up output: no unrelated library warnings; the CPU thread count -----------------------

UNRELATED = ("Failed to load", "Enum subclass", "kernels-community", "Setting accelerator to CPU",
             "Removed shared tensor")


def toy_run(tmp_path, name, threads, steps, save=False):
    """The toy GRPO run, `threads` intra-op threads (None: the script's choice); (stdout, rewards)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    out = tmp_path / name
    saving = ["--save_steps", "1"] if save else ["--save_strategy", "no"]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--max_steps", str(steps),
                             *saving, "--output_dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-2000:]
    for text in UNRELATED:
        assert text not in result.stderr, text
    return result.stdout, [row["reward/mean"] for row in metrics_of(str(out))]


def test_a_run_prints_no_unrelated_library_warnings_and_its_thread_count(tmp_path):
    """With no OMP_NUM_THREADS the script picks one thread for the tiny model and says so; stderr
    holds none of the other libraries' start-up warnings (a checkpoint and the final model saved)."""
    stdout, _ = toy_run(tmp_path, "auto", threads=None, steps=2, save=True)
    assert re.search(r"^cpu threads: 1 of \d+ cores \(the tiny model gains nothing from more; "
                     r"OMP_NUM_THREADS=N to choose\)$", stdout, flags=re.M), stdout


def test_the_filters_drop_only_those_messages(caplog):
    import logging

    from utils.cli import quiet_library_warnings

    quiet_library_warnings()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/_C.so: nope")
        logging.getLogger("torchao").warning("torchao says something else")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU. If you have GPU ...")
    assert [r.getMessage() for r in caplog.records if r.name in ("torchao", "DeepSpeed")] == [
        "torchao says something else"]


def test_two_threads_learn_what_one_thread_learns(tmp_path):
    """The thread count (here the user's choice, OMP_NUM_THREADS=1 against 2) does not change what the
    toy run learns beyond noise: over 40 steps the reward rises in both (steps 31-40 against 1-10),
    and their mean rewards over the 40 steps differ by less than the spread over seeds (one thread,
    this 2-core machine: 0.134, 0.156 and 0.228 for seeds 2, 1 and 42; rises of 0.11, 0.10, 0.31).
    On this machine the two runs are in fact equal step for step."""
    means = {}
    for threads in (1, 2):
        stdout, rewards = toy_run(tmp_path, f"threads{threads}", threads, steps=40)
        assert f"cpu threads: {threads} (OMP_NUM_THREADS={threads})" in stdout
        assert sum(rewards[-10:]) / 10 - sum(rewards[:10]) / 10 > 0.05, (threads, rewards)
        means[threads] = sum(rewards) / len(rewards)
    assert abs(means[1] - means[2]) < 0.15, means
