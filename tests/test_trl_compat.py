"""A TRL user's names and code work here: TRL's flag names as aliases where they mean the same
(checked against the counts that follow from this script's flags where they are counts), one line
for TRL flags with no meaning here, and TRL-style reward functions (completion_ids, trainer_state,
conversational completions, dotted paths, trl.rewards) through the real scripts."""
import json
import os
import re
import textwrap

import pytest

import train_grpo
import train_ppo
from helpers import ROOT, metrics_of
from utils.cli import TRL_ALIASES, TRL_NOT_HERE, UsageError, parse_args


def checked(script, argv, num_processes=1):
    args, explicit = parse_args(script.Args, argv)
    script.apply_presets(args, explicit, script.TOY_PRESET, script.DEBUG_PRESET)
    script.check_args(args, num_processes, explicit)
    return args


@pytest.mark.parametrize("argv, expected", [
    (["--gradient_checkpointing"], dict(use_gradient_checkpointing=True)),
    (["--gradient_checkpointing", "false"], dict(use_gradient_checkpointing=False)),
    (["--use_peft"], dict(use_lora=True)),
    (["--dtype", "bfloat16"], dict(torch_dtype="bfloat16")),
    (["--bf16"], dict(mixed_precision="bf16")),
    (["--bf16", "true"], dict(mixed_precision="bf16")),
    (["--bf16=false"], dict(mixed_precision="no")),
    (["--fp16"], dict(mixed_precision="fp16")),
    (["--dataset_train_split", "test"], dict(dataset_split="test")),
    (["--ds3_gather_for_generation", "false"], dict(gather_for_generation=False)),
    (["--sft_model_path", "a/b"], dict(model_name_or_path="a/b")),
    (["--reward_model_path", "r/m"], dict(reward_model_name_or_path="r/m")),
    (["--response_length", "17"], dict(max_completion_length=17)),
    (["--reward_funcs", "accuracy", "format", "--reward_weights", "1", "-0.5"],  # TRL's list form
     dict(reward_funcs="accuracy,format", reward_weights="1,-0.5")),
    (["--lora_target_modules", "q_proj", "v_proj"], dict(lora_target_modules="q_proj,v_proj")),
])
def test_trl_aliases_set_this_projects_flags(argv, expected):
    args, explicit = parse_args(train_grpo.Args, argv)
    assert {k: getattr(args, k) for k in expected} == expected
    assert set(expected) <= explicit  # presets leave them alone, as for the flags themselves


def test_ppo_aliases():
    args, _ = parse_args(train_ppo.Args, ["--num_ppo_epochs", "3", "--value_model_path", "c/m"])
    assert args.ppo_epochs == 3 and args.critic_model_name_or_path == "c/m"
    with pytest.raises(UsageError, match="--num_ppo_epochs is TRL's name for --ppo_epochs, a flag of the other"):
        parse_args(train_grpo.Args, ["--num_ppo_epochs", "3"])


def test_every_alias_targets_a_flag():
    fields = {f for script in (train_grpo, train_ppo) for f in script.Args.__dataclass_fields__}
    assert {ours for ours, _ in TRL_ALIASES.values()} <= fields
    assert not set(TRL_ALIASES) & fields and not set(TRL_NOT_HERE) & fields


def test_config_file_takes_trl_names(tmp_path):
    cfg = tmp_path / "trl.yaml"
    cfg.write_text("bf16: true\ngradient_checkpointing: true\ngradient_accumulation_steps: 8\nnum_generations: 16\n")
    args = checked(train_grpo, ["--config", str(cfg)])
    assert args.mixed_precision == "bf16" and args.use_gradient_checkpointing
    assert args.per_device_train_batch_size == 512 // 8  # toy preset: 32 prompts x 16 completions on one process


@pytest.mark.parametrize("argv, per_device", [
    (["--gradient_accumulation_steps", "8"], 64),  # toy GRPO: 512 completions per optimizer step
    (["--gradient_accumulation_steps", "8", "--per_device_train_batch_size", "64"], 64),  # consistent
    (["--gradient_accumulation_steps", "1"], 512),
])
def test_gradient_accumulation_steps_sets_the_micro_batch(argv, per_device):
    assert checked(train_grpo, argv).per_device_train_batch_size == per_device


def test_gradient_accumulation_steps_on_two_processes_and_ppo():
    assert checked(train_grpo, ["--gradient_accumulation_steps", "4"], num_processes=2).per_device_train_batch_size == 64
    # toy PPO: 256 prompts / 4 mini-batches = 64 completions per optimizer step
    assert checked(train_ppo, ["--gradient_accumulation_steps", "2"]).per_device_train_batch_size == 32


@pytest.mark.parametrize("argv, message", [
    (["--gradient_accumulation_steps", "3"], "--gradient_accumulation_steps 3 does not divide the 512 completions"),
    (["--gradient_accumulation_steps", "8", "--per_device_train_batch_size", "32"],
     "each process trains on 512 completions per optimizer step, so 8 micro-batches are of 64; give one of the two"),
    (["--gradient_accumulation_steps", "8", "--use_dynamic_bsz"], "micro-batches then follow the token budget"),
    (["--generation_batch_size", "100"], "--generation_batch_size 100 (TRL: completions generated per round): each "
                                         "step here generates --prompts_per_step x 16 (--num_generations) = 512"),
    (["--prompts_per_step", "8", "--generation_batch_size", "256"], "= 128; set --prompts_per_step, or use "
                                                                    "--generation_slice_size"),
])
def test_trl_counts_that_do_not_map_are_refused(argv, message):
    with pytest.raises(UsageError) as exc:
        checked(train_grpo, argv)
    assert message in str(exc.value)


def test_generation_batch_size_maps_to_prompts_per_step():
    assert checked(train_grpo, ["--generation_batch_size", "256"]).prompts_per_step == 16  # 256 / 16 generations
    assert checked(train_grpo, ["--generation_batch_size", "512", "--prompts_per_step", "32"]).prompts_per_step == 32
    assert checked(train_ppo, ["--generation_batch_size", "128"]).prompts_per_step == 128  # one completion each


@pytest.mark.parametrize("flag", ["--use_vllm", "--vllm_mode=colocate", "--steps_per_generation=4", "--deepspeed=x",
                                  "--eval_strategy=steps", "--push_to_hub", "--use_liger_kernel", "--use_cpu"])
def test_trl_flags_with_no_meaning_here_say_what_to_use(flag):
    with pytest.raises(UsageError) as exc:
        parse_args(train_grpo.Args, [flag])
    name = flag[2:].split("=")[0]
    assert str(exc.value).startswith(f"--{name} (TRL) has no counterpart here: ") and "\n" not in str(exc.value)


def test_the_other_scripts_flags_say_where_they_belong():
    with pytest.raises(UsageError, match="PPO generates one completion per prompt"):
        parse_args(train_ppo.Args, ["--num_generations", "8"])
    with pytest.raises(UsageError, match="GRPO's KL penalty weight is --beta"):
        parse_args(train_grpo.Args, ["--kl_coef", "0.1"])


def test_readme_lists_the_aliases_help_accepts():
    """The README's "Coming from TRL" table holds exactly the aliases the parser accepts."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text.split("## Coming from TRL", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `--(\w+)` \| `--(\w+)`", section, flags=re.M))
    assert rows == {trl: ours for trl, (ours, _) in TRL_ALIASES.items()}
    for name in ("gradient_accumulation_steps", "generation_batch_size", "use_vllm", "generation_slice_size"):
        assert f"`--{name}" in section


# ---- TRL-style reward functions through the real scripts -------------------------------------

REWARDS = '''
import json
import os

from trl.rewards import get_soft_overlong_punishment
from utils import toy

_tokenizer = toy.build_tokenizer()
overlong = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)  # TRL's, unchanged


def trl_reward(prompts, completions, completion_ids, trainer_state, answer, level, **kwargs):
    """A reward function written for TRL's GRPOTrainer: it records what it was given."""
    record = {
        "step": trainer_state.global_step, "max_steps": trainer_state.max_steps, "n": len(completions),
        "conversational": all(isinstance(c, list) and len(c) == 1 and c[0]["role"] == "assistant" for c in completions),
        "prompts_are_messages": all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts),
        "ids_decode_to_content": all(_tokenizer.decode(ids, skip_special_tokens=True) == c[0]["content"]
                                     for ids, c in zip(completion_ids, completions)),
        "ids_are_ints": all(isinstance(t, int) for ids in completion_ids for t in ids),
        "levels": sorted(set(level)), "extra": sorted(kwargs),
    }
    with open(os.environ["TRL_REWARD_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")
    return [1.0 if c[0]["content"].strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]
'''


@pytest.fixture
def trl_task(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b), "level": a % 2}
            for a in range(5) for b in range(5)]
    (tmp_path / "conversational.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "trl_rewards.py").write_text(textwrap.dedent(REWARDS))
    return tmp_path


@pytest.mark.parametrize("script, sizes", [
    ("train_grpo.py", ["--prompts_per_step", "4", "--num_generations", "4"]),
    ("train_ppo.py", ["--prompts_per_step", "16", "--num_mini_batches", "1", "--ppo_epochs", "1"]),
])
def test_trl_reward_functions_run_unchanged(run, trl_task, script, sizes):
    log = trl_task / "calls.jsonl"
    funcs = [f"{trl_task}/trl_rewards.py:trl_reward", f"{trl_task}/trl_rewards.py:overlong"]
    if script == "train_grpo.py":
        funcs.append("trl.rewards.think_format_reward")  # TRL's dotted form, a function of trl.rewards
    out = trl_task / "out"
    result = run(["--dataset_name", str(trl_task / "conversational.jsonl"), "--reward_funcs", ",".join(funcs),
                  "--max_steps", "3", "--per_device_train_batch_size", "16", "--save_strategy", "no",
                  "--output_dir", str(out), *sizes], env={"TRL_REWARD_LOG": str(log)}, script=script, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    completions_per_step = 16
    assert [c["step"] for c in calls] == [0, 1, 2] and {c["max_steps"] for c in calls} == {3}
    assert all(c["n"] == completions_per_step for c in calls)
    assert all(c["conversational"] and c["prompts_are_messages"] and c["ids_decode_to_content"] and c["ids_are_ints"]
               for c in calls), calls
    assert all(set(c["levels"]) <= {0, 1} for c in calls)
    assert {"completion_ids", "trainer_state"}.isdisjoint(calls[0]["extra"])  # named, not in **kwargs
    rows = metrics_of(str(out))
    assert len(rows) == 3
    names = ["trl_reward", "overlong"] + (["think_format_reward"] if script == "train_grpo.py" else [])
    for row in rows:
        for name in names:
            assert f"reward/{name}/mean" in row
        assert -1.0 <= row["reward/overlong/mean"] <= 0.0  # TRL's soft overlong punishment, in its range
