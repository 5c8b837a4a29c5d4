"""Bad input fails early (before any model loads) with one readable line and exit code 2;
--config YAML works and the command line wins over it."""
import json

import pytest

import train_grpo
import utils.modeling
from utils.cli import UsageError, parse_args


@pytest.fixture
def no_model_loading(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(utils.modeling, "load_causal_lm", boom)
    monkeypatch.setattr(utils.modeling, "load_tokenizer", boom)


def error_of(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        train_grpo.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"{i}+1=", "solution": f"#### {i + 1}"}) for i in range(8)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    return tmp_path


BAD_INPUTS = [
    (["--reward_funcs", "acuracy"], "unknown reward function 'acuracy'; built-ins are accuracy, format"),
    (["--reward_funcs", "nowhere/r.py:f"], "file nowhere/r.py does not exist"),
    (["--reward_funcs", "{d}/broken.py:f"], "cannot load"),
    (["--dataset_name", "{d}/data.jsonl"], "--prompt_column prompt: no such column in {d}/data.jsonl; columns are question, solution"),
    (["--dataset_name", "{d}/data.jsonl", "--prompt_column", "question"], "--answer_column answer: no such column"),
    (["--dataset_name", "{d}/empty.jsonl"], "dataset {d}/empty.jsonl is empty (0 rows)"),
    (["--dataset_name", "{d}/data.txt"], "unsupported file type '.txt'; use one of .json, .jsonl, .parquet, .csv"),
    (["--dataset_name", "{d}/empty.csv"], "is empty (0 rows)"),
    (["--prompts_per_step", "3", "--num_generations", "4", "--per_device_train_batch_size", "5"],
     "--per_device_train_batch_size 5 does not divide the 12 completions each process trains on per step"),
    (["--num_generations", "1"], "--num_generations 1: GRPO's advantage is the reward minus its group's mean"),
    (["--config", "{d}/missing.yaml"], "--config {d}/missing.yaml: cannot read it"),
    (["--config", "{d}/unknown.yaml"], "unknown key 'learnig_rate' (did you mean learning_rate"),
    (["--config", "{d}/notyaml.yaml"], "not valid YAML"),
    (["--resume_from_checkpoint", "{d}/nowhere"], "--resume_from_checkpoint {d}/nowhere: no such folder"),
    (["--resume_from_checkpoint", "latest", "--output_dir", "{d}/fresh"], "no complete checkpoint in --output_dir"),
    (["--attn_implementation", "flash_attention_2"], "flash-attn package is not installed"),
    (["--reward_weights", "1,2"], "--reward_weights has 2 values for 1 rewards (accuracy)"),
    (["--reward_funcs", "none"], "no reward"),
    (["--top_p", "1.5"], "--top_p must be in (0, 1]"),
    (["--use_lora", "--ref_device", "cpu"], "--ref_device cpu: with --use_lora the reference is the policy with its adapter disabled"),
    (["--use_lora", "--lora_dropout", "1"], "--lora_dropout must be in [0, 1)"),
    (["--learning_rate", "0"], "--learning_rate must be > 0"),
    (["--generation_backend", "cudagraph", "--param_offload"], "does not keep; use --generation_backend static, or add --generation_copy"),
    (["--generation_backend", "compiled", "--actor_device", "balanced"], "which --actor_device balanced"),
    (["--generation_copy_dtype", "int8"], "--generation_copy_dtype int8 sets the dtype of --generation_copy's copy"),
    (["--generation_copy_in_place"], "--generation_copy_in_place needs --generation_copy"),
    (["--generation_copy_in_place", "--generation_copy"], "--generation_copy_in_place needs --use_lora"),
    (["--generation_copy_in_place", "--generation_copy", "--use_lora"],
     "--generation_copy_in_place needs --torch_dtype bfloat16 (the base is float32)"),
    (["--use_bnb_nested_quant", "false"], "--use_bnb_nested_quant false keeps --load_in_4bit's statistics in float32"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS)
def test_bad_input_fails_before_models_load(argv, message, data, capsys, no_model_loading):
    (data / "broken.py").write_text("def f(:\n")
    (data / "data.txt").write_text("x")
    (data / "unknown.yaml").write_text("learnig_rate: 0.1\n")
    (data / "notyaml.yaml").write_text("a: [1, 2\n")
    argv = [a.format(d=data) for a in argv] + (["--output_dir", str(data / "out")] if "--output_dir" not in argv else [])
    err = error_of(argv, capsys)
    assert message.format(d=data) in err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_invalid_choice_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        train_grpo.main(["--loss_type", "ppo"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "error: --loss_type: invalid choice: 'ppo' (choose from 'grpo', 'dr_grpo', 'dapo')\n"


@pytest.mark.parametrize("argv, message", [
    (["--attn_implementation", "flash_attention_2"], "use --attn_implementation sdpa"),
    (["--dataset_name", "no/such-dataset-xyz"], "--dataset_name no/such-dataset-xyz: cannot load it"),
])
def test_errors_as_subprocess(run, argv, message):
    result = run(argv, timeout=300, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


def test_config_yaml_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("learning_rate: 0.01\nbeta: 0.0\nuse_gradient_checkpointing: true\nreward_funcs: [accuracy, format]\n")
    args, explicit = parse_args(train_grpo.Args, ["--config", str(cfg), "--beta", "0.1"])
    assert args.learning_rate == 0.01 and args.beta == 0.1 and args.use_gradient_checkpointing is True
    assert args.reward_funcs == "accuracy,format"
    assert {"learning_rate", "beta", "use_gradient_checkpointing", "reward_funcs"} <= explicit
    assert "num_generations" not in explicit
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss_type: ppo\n")
    with pytest.raises(UsageError, match="invalid choice"):  # config values get the same choice checks as flags
        parse_args(train_grpo.Args, ["--config", str(bad)])
    with pytest.raises(UsageError, match="another config"):
        (tmp_path / "nested.yaml").write_text("config: x.yaml\n")
        parse_args(train_grpo.Args, ["--config", str(tmp_path / "nested.yaml")])


def test_presets_fill_only_unset_flags():
    args, explicit = parse_args(train_grpo.Args, ["--debug", "--num_generations", "4"])
    train_grpo.apply_presets(args, explicit, train_grpo.TOY_PRESET, train_grpo.DEBUG_PRESET)
    assert args.num_generations == 4  # explicit value kept
    assert args.prompts_per_step == train_grpo.TOY_PRESET["prompts_per_step"]  # toy preset (no model given)
    args, explicit = parse_args(train_grpo.Args, ["--debug", "--model_name_or_path", "some/model"])
    train_grpo.apply_presets(args, explicit, train_grpo.TOY_PRESET, train_grpo.DEBUG_PRESET)
    assert args.max_steps == train_grpo.DEBUG_PRESET["max_steps"] and args.learning_rate == 1e-6
    assert args.reward_funcs == "accuracy"
    train_grpo.check_args(args, num_processes=1)
    assert args.epsilon_high == args.epsilon  # clip-higher defaults to symmetric clipping


@pytest.mark.parametrize("num_processes", [1, 2, 4, 8])
@pytest.mark.parametrize("script_name", ["train_grpo", "train_ppo"])
@pytest.mark.parametrize("debug_model", [None, "some/model"])
def test_presets_fit_common_process_counts(script_name, num_processes, debug_model):
    """`accelerate launch --multi_gpu --num_processes N train_*.py` works with the presets: a
    micro-batch the user did not set shrinks to divide each process's share; one they set does not."""
    import importlib

    script = importlib.import_module(script_name)
    argv = ["--debug"] + (["--model_name_or_path", debug_model] if debug_model else [])
    args, explicit = parse_args(script.Args, argv)
    script.apply_presets(args, explicit, script.TOY_PRESET, script.DEBUG_PRESET)
    if debug_model and args.prompts_per_step % num_processes:
        pytest.skip("the real-model --debug preset is meant for one process")
    sizes = script.check_args(args, num_processes, explicit)
    unit = sizes if script_name == "train_grpo" else sizes[1]
    assert unit % args.per_device_train_batch_size == 0
    args, explicit = parse_args(script.Args, ["--per_device_train_batch_size", "48"])
    script.apply_presets(args, explicit, script.TOY_PRESET, script.DEBUG_PRESET)
    with pytest.raises(UsageError, match="--per_device_train_batch_size 48 does not divide"):
        script.check_args(args, num_processes, explicit)


# ---- --help: grouped by section, each flag once ------------------------------------------------


@pytest.mark.parametrize("script", [train_grpo, "train_ppo"])
def test_every_flag_is_in_exactly_one_help_section(script):
    import dataclasses
    import importlib

    from utils.cli import HELP_SECTIONS

    script = importlib.import_module(script) if isinstance(script, str) else script
    fields = [f.name for f in dataclasses.fields(script.Args)]
    count = {name: sum(name in names for names in HELP_SECTIONS.values()) for name in fields}
    missing = [name for name, n in count.items() if n == 0]
    assert not missing, f"flags in no --help section: add each to HELP_SECTIONS in utils/cli.py: {missing}"
    twice = [name for name, n in count.items() if n > 1]
    assert not twice, f"flags in several --help sections of HELP_SECTIONS (utils/cli.py): {twice}"


def test_help_sections_name_only_real_flags():
    import dataclasses

    import train_ppo
    from utils.cli import HELP_SECTIONS

    fields = {f.name for script in (train_grpo, train_ppo) for f in dataclasses.fields(script.Args)}
    stale = [name for names in HELP_SECTIONS.values() for name in names if name not in fields]
    assert not stale, f"HELP_SECTIONS (utils/cli.py) names flags that no script has: {stale}"


@pytest.mark.parametrize("script_name", ["train_grpo", "train_ppo"])
def test_help_lists_each_flag_once_algorithm_first(script_name, capsys):
    import dataclasses
    import importlib
    import re

    from utils.cli import TRL_ALIASES

    script = importlib.import_module(script_name)
    with pytest.raises(SystemExit) as exc:
        parse_args(script.Args, ["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flags = re.findall(r"^  (--\w+)", out.split("TRL's names, accepted:", 1)[0], flags=re.M)
    assert len(flags) == len(set(flags)), "a flag is listed twice"
    fields = dataclasses.fields(script.Args)
    negations = {f"--no_{f.name}" for f in fields if f.default is True}  # HfArgumentParser's --no_X for True defaults
    assert set(flags) == {f"--{f.name}" for f in fields} | negations
    titles = re.findall(r"^(\S[^\n]*):$", out, flags=re.M)
    assert titles[:4] == ["options", "algorithm (this script's own flags)",
                          "training: steps, batches, optimizer, sampling", "model"]
    assert titles[-1] == "TRL's names, accepted"
    trl_text = out.split("TRL's names, accepted:", 1)[1]
    for alias, (ours, _) in TRL_ALIASES.items():  # each accepted alias once, in that section only
        if f"--{ours}" in flags:
            assert out.count(f"--{alias} ") + out.count(f"--{alias}\n") == 1 and f"--{alias}" in trl_text
    assert "--use-lora" not in out  # the dash spellings are accepted, not listed


def test_dash_spellings_and_no_abbreviations():
    args, explicit = parse_args(train_grpo.Args, ["--learning-rate", "0.5", "--use-lora"])
    assert args.learning_rate == 0.5 and args.use_lora and explicit == {"learning_rate", "use_lora"}
    with pytest.raises(UsageError, match=r"^unknown flag --use_gradient_checkpointin; did you mean "
                                         r"--use_gradient_checkpointing"):
        parse_args(train_grpo.Args, ["--use_gradient_checkpointin"])
    with pytest.raises(UsageError, match=r"^unknown flag --learning; did you mean --learning_rate"):
        parse_args(train_grpo.Args, ["--learning", "1"])


def test_a_flag_unset_by_default_takes_true_false_or_stands_bare():
    """Optional booleans (None: the script decides, e.g. --share_prompt_cache, --use_chat_template): a bare flag is
    true, as for the plain booleans; true/false as given; unset stays None and is not counted as set."""
    for argv, want in (([], None), (["--share_prompt_cache"], True), (["--share_prompt_cache", "false"], False),
                       (["--share_prompt_cache", "true", "--use_lora"], True),
                       (["--share_prompt_cache", "--use_lora"], True)):
        args, explicit = parse_args(train_grpo.Args, argv)
        assert args.share_prompt_cache is want and ("share_prompt_cache" in explicit) == bool(argv), argv
    args, _ = parse_args(train_grpo.Args, ["--use_chat_template"])
    assert args.use_chat_template is True
    with pytest.raises(UsageError, match="share_prompt_cache"):
        parse_args(train_grpo.Args, ["--share_prompt_cache", "maybe"])


def test_negative_numbers_are_values():
    args, _ = parse_args(train_grpo.Args, ["--learning_rate", "-1e-3", "--max_steps", "-1", "--reward_weights",
                                           "1", "-0.5"])
    assert args.learning_rate == -1e-3 and args.max_steps == -1 and args.reward_weights == "1,-0.5"
    with pytest.raises(UsageError, match=r"--learning_rate must be > 0 \(got -0.001\)"):
        train_grpo.check_args(args, 1)


def test_readme_flag_rows_name_real_flags_or_trl_aliases():
    """README and --help agree: every `--flag` row of the README's tables is a flag of a script or a
    TRL name that the parser accepts (tests/test_readme.py checks the other direction)."""
    import dataclasses
    import os
    import re

    import train_ppo
    from helpers import ROOT
    from utils.cli import TRL_ALIASES

    with open(os.path.join(ROOT, "README.md")) as f:
        rows = set(re.findall(r"^\| `--(\w+)` \|", f.read(), flags=re.M))
    known = {f.name for script in (train_grpo, train_ppo) for f in dataclasses.fields(script.Args)} | set(TRL_ALIASES)
    assert not rows - known, f"README rows for flags that no script has: {sorted(rows - known)}"
