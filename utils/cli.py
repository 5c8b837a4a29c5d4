"""Command line plumbing shared by the training scripts: parse an `Args` dataclass into an argparse
parser whose `--help` is grouped by section, accept `--config file.yaml` (the command line wins) and
TRL's flag names where they mean the same, remember which flags the user set explicitly, turn bad
input into one readable error line, and the process settings made at start (CPU threads, other
libraries' start-up warnings that say nothing to the user)."""

import argparse
import dataclasses
import difflib
import logging
import os
import sys
import traceback
from typing import Optional, get_type_hints

import yaml


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


class UserCodeError(Exception):
    """The user's code (a reward function, a reward model) failed mid-step: reported as one block
    naming the function, the step, what it returned or raised (with its own traceback); the training
    loop saves the last finished step first (--save_on_error, utils/checkpoint.py), exit code 1."""

    def __init__(self, message: str, user_traceback: str = ""):
        super().__init__(message)
        self.user_traceback = user_traceback


def fail(message: str, code: int = 2):
    """Print `error: message` on stderr (once per machine in multi-process runs) and exit."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


# ----------------------------------------------------------------------------------------------
# --help sections: every flag of both scripts' Args is in exactly one (tests/test_cli.py checks it,
# so a flag added without a section fails that test). Order: the script's own algorithm flags,
# then the rest as a user meets them.

HELP_SECTIONS = {
    "algorithm (this script's own flags)": (
        # train_grpo.py
        "prompts_per_step", "num_generations", "num_iterations", "loss_type", "scale_rewards", "epsilon",
        "epsilon_high", "beta", "mask_truncated_completions", "importance_sampling_level", "delta",
        "use_bias_correction_kl", "top_entropy_quantile", "dynamic_sampling", "max_generation_rounds",
        # train_ppo.py
        "num_mini_batches", "ppo_epochs", "cliprange", "cliprange_value", "vf_coef", "gamma", "lam", "kl_coef",
        "kl_estimator", "target_kl", "kl_horizon", "whiten_rewards", "missing_eos_penalty", "stop_token",
        "critic_learning_rate",
        # both scripts: DAPO's overlong penalty, rollout correction
        "overlong_buffer_len", "overlong_penalty_factor", "rollout_importance_correction", "rollout_importance_clip"),
    "training: steps, batches, optimizer, sampling": (
        "debug", "config", "max_steps", "num_train_epochs", "per_device_train_batch_size", "learning_rate",
        "lr_scheduler_type", "warmup_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "entropy_coef",
        "max_skipped_steps", "seed", "temperature", "top_p", "top_k"),
    "model": (
        "model_name_or_path", "tokenizer_name_or_path", "critic_model_name_or_path", "torch_dtype",
        "mixed_precision", "trust_remote_code", "disable_dropout", "use_lora", "lora_r", "lora_alpha",
        "lora_dropout", "lora_target_modules"),
    "data": (
        "dataset_name", "dataset_config", "dataset_split", "prompt_column", "answer_column", "use_chat_template",
        "system_prompt", "max_prompt_length", "max_completion_length"),
    "rewards": ("reward_funcs", "reward_weights", "reward_model_name_or_path"),
    "memory": (
        "use_gradient_checkpointing", "activation_offload", "use_dynamic_bsz", "max_token_len_per_gpu",
        "logprob_chunk_size", "entropy_checkpointing", "optim", "load_in_4bit", "load_in_8bit", "use_bnb_nested_quant",
        "ref_offload", "reward_offload", "param_offload", "optimizer_offload", "offload_policy", "generation_slice_size",
        "prefill_chunk_size", "kv_cache_dtype", "share_prompt_cache", "empty_cache_between_phases",
        "auto_reduce_micro_batch", "plan", "auto_memory", "gpu_memory", "log_memory_every", "memory_report",
        "memory_snapshot", "memory_snapshot_step", "profile_step"),
    "speed": ("generation_backend", "generation_copy", "generation_copy_dtype", "generation_copy_in_place", "torch_compile",
              "attn_implementation", "gather_for_generation"),
    "placement": ("actor_device", "critic_device", "ref_device", "reward_device", "offload_execution_device"),
    "saving and logging": (
        "output_dir", "save_strategy", "save_steps", "save_total_limit", "resume_from_checkpoint", "save_on_error",
        "logging_steps", "report_to", "run_name", "log_completions", "num_completions_to_print"),
}

# ----------------------------------------------------------------------------------------------
# TRL's flag names (TRL 1.16: GRPOConfig / TrainingArguments, ModelConfig, ScriptArguments; the
# PPO names from TRL's last PPOConfig). Same meaning: rewritten to this project's flag before
# parsing, the value mapped where the form differs. A TRL name that is also a flag of the script
# (e.g. --num_generations in train_grpo.py) is that flag.

TRL_ALIASES = {  # TRL name -> (this project's flag, {TRL value: value here} or None: the value as given)
    "gradient_checkpointing": ("use_gradient_checkpointing", None),
    "use_peft": ("use_lora", None),
    "dtype": ("torch_dtype", None),
    "bf16": ("mixed_precision", {"true": "bf16", "false": "no"}),
    "fp16": ("mixed_precision", {"true": "fp16", "false": "no"}),
    "dataset_train_split": ("dataset_split", None),
    "ds3_gather_for_generation": ("gather_for_generation", None),
    "num_ppo_epochs": ("ppo_epochs", None),
    "response_length": ("max_completion_length", None),
    "sft_model_path": ("model_name_or_path", None),
    "reward_model_path": ("reward_model_name_or_path", None),
    "value_model_path": ("critic_model_name_or_path", None),
}

# counts that follow from other flags here: accepted when they can be mapped exactly (see
# apply_trl_generation_batch_size and apply_trl_gradient_accumulation), refused otherwise
TRL_DERIVED = ("gradient_accumulation_steps", "generation_batch_size")

_NO_EVAL = "no evaluation loop here: evaluate output_dir/final (or a checkpoint) separately"
_NO_HUB = "nothing is pushed: upload output_dir/final yourself (huggingface-cli upload)"
_VLLM = ("generation runs in the training process, no vLLM: for speed use --generation_backend static, "
         "cudagraph or compiled (GPU)")
_LORA = "LoRA here is --use_lora with --lora_r, --lora_alpha, --lora_dropout, --lora_target_modules"
_NF4 = ("--load_in_4bit is NF4 computing in the mixed-precision dtype; double quantisation is "
        "--use_bnb_nested_quant (on unless false)")
_REF = "the reference stays the initial policy (no reference updates)"
TRL_NOT_HERE = {  # TRL flags with no meaning here -> what to use instead (one line each)
    "use_vllm": _VLLM, "vllm_mode": _VLLM, "vllm_gpu_memory_utilization": _VLLM,
    "vllm_tensor_parallel_size": _VLLM, "vllm_server_host": _VLLM, "vllm_server_port": _VLLM,
    "vllm_importance_sampling_correction": "the rollouts' own numerics are corrected by --rollout_importance_correction "
                                           "token_truncate (and --rollout_importance_clip); no vLLM here", "vllm_enable_sleep_mode": _VLLM,
    "use_transformers_paged": _VLLM, "use_transformers_continuous_batching": _VLLM,
    "steps_per_generation": "each step generates once and trains on that batch; reuse it for several optimizer "
                            "steps with --num_iterations (train_grpo.py)",
    "deepspeed": "choose the engine with accelerate: accelerate launch --config_file "
                 "accelerate_configs/deepspeed_zero3.yaml (or deepspeed_zero2.yaml) train_grpo.py ...",
    "fsdp": "choose the engine with accelerate: accelerate launch --config_file accelerate_configs/fsdp2.yaml ...",
    "fsdp_config": "choose the engine with accelerate: accelerate launch --config_file accelerate_configs/fsdp2.yaml",
    "use_cpu": "no flag needed: the scripts run on the CPU when no GPU is visible (CUDA_VISIBLE_DEVICES=)",
    "eval_strategy": _NO_EVAL, "eval_steps": _NO_EVAL, "do_eval": _NO_EVAL, "per_device_eval_batch_size": _NO_EVAL,
    "dataset_test_split": _NO_EVAL, "num_generations_eval": _NO_EVAL,
    "push_to_hub": _NO_HUB, "hub_model_id": _NO_HUB, "hub_strategy": _NO_HUB, "hub_private_repo": _NO_HUB,
    "use_liger_kernel": "the LM head's memory is cut by --logprob_chunk_size (logprobs computed in chunks)",
    "torch_empty_cache_steps": "--empty_cache_between_phases (after each phase of every step)",
    "gradient_checkpointing_kwargs": "checkpointing here is always non-reentrant: --use_gradient_checkpointing",
    "use_rslora": _LORA, "use_dora": _LORA, "lora_modules_to_save": _LORA, "lora_task_type": _LORA,
    "lora_target_parameters": _LORA,
    "bnb_4bit_quant_type": _NF4, "bnb_4bit_quant_storage": _NF4,
    "model_revision": "download that revision to a folder (huggingface-cli download --revision ...) and give the folder",
    "logging_strategy": "--logging_steps (log every this many steps)",
    "remove_unused_columns": "every dataset column already reaches the reward functions",
    "shuffle_dataset": "prompts are always drawn in a fresh permutation per epoch, seeded by --seed",
    "dataset_streaming": "datasets are loaded whole (map-style)",
    "sync_ref_model": _REF, "ref_model_mixup_alpha": _REF, "ref_model_sync_steps": _REF,
    "adam_beta1": "AdamW's betas and epsilon are torch's defaults here", "adam_beta2":
        "AdamW's betas and epsilon are torch's defaults here", "adam_epsilon":
        "AdamW's betas and epsilon are torch's defaults here",
    "reward_model_name": "--reward_model_name_or_path",
}
# names that are flags of one script only: a useful line in the other
OTHER_SCRIPT = {
    "num_generations": "PPO generates one completion per prompt; groups of --num_generations are train_grpo.py's",
    "beta": "PPO's KL penalty is --kl_coef (folded into the per-token rewards); --beta is train_grpo.py's",
    "epsilon": "PPO's clip range is --cliprange; --epsilon is train_grpo.py's",
    "kl_coef": "GRPO's KL penalty weight is --beta; --kl_coef is train_ppo.py's",
    "cliprange": "GRPO's clip range is --epsilon (and --epsilon_high); --cliprange is train_ppo.py's",
    "ppo_epochs": "GRPO reuses each batch for --num_iterations optimizer steps; --ppo_epochs is train_ppo.py's",
    "critic_model_name_or_path": "GRPO has no critic; --critic_model_name_or_path is train_ppo.py's",
}

_BOOL_WORDS = {"true", "false", "yes", "no", "t", "f", "y", "n", "1", "0"}
_LIST_FLAGS = ("reward_funcs", "reward_weights", "lora_target_modules", "offload_policy")  # TRL takes lists


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def _config_to_argv(path: str, known: set) -> list:
    """Read a YAML config and turn it into `--key value` tokens for argparse, so that config
    values get exactly the same type conversion and choice checks as command line values."""
    try:
        with open(path) as f:
            config = yaml.safe_load(f) or {}
    except OSError as e:
        raise UsageError(f"--config {path}: cannot read it ({e.strerror})")
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(config, dict):
        raise UsageError(f"--config {path}: expected a mapping of flag names to values, got {type(config).__name__}")
    argv = []
    for key, value in config.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise UsageError(f"--config {path}: unknown key '{key}'{hint}; keys are the script's flag names")
        if name == "config":
            raise UsageError(f"--config {path}: a config file cannot name another config")
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (UsageError) instead of usage + message + exit."""

    def error(self, message):
        raise UsageError(message.replace("argument ", "", 1) if message.startswith("argument --") else message)


class _UnderscoreNames:
    """Passed to HfArgumentParser's field parser in place of an argument group: keeps each flag's
    underscore name only (the dash spellings are still accepted: the command line is normalised to
    underscores first), so `--help` lists every flag once."""

    def __init__(self, group):
        self.group = group

    METAVARS = {int: "N", float: "X", str: "TEXT"}

    def add_argument(self, *names, **kwargs):
        if "choices" not in kwargs and kwargs.get("nargs") != 0 and "action" not in kwargs:
            kwargs["metavar"] = "BOOL" if kwargs.get("nargs") == "?" else self.METAVARS.get(kwargs.get("type"), "VALUE")
        return self.group.add_argument(*[n for n in names if "-" not in n[2:]], **kwargs)


def build_parser(args_class) -> argparse.ArgumentParser:
    """The parser of `args_class`: one argument per field (HfArgumentParser's conversion of types,
    choices and booleans), grouped by HELP_SECTIONS; TRL's accepted names in one closing section."""
    from transformers import HfArgumentParser

    parser = _Parser(prog=os.path.basename(sys.argv[0]) or None, allow_abbrev=False,
                     usage="%(prog)s [--flag value ...]   (flags by section below; --config run.yaml)",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = get_type_hints(args_class)
    fields = {f.name: f for f in dataclasses.fields(args_class) if f.init}
    placed = set()
    for title, names in list(HELP_SECTIONS.items()) + [("other (no section yet)", tuple(fields))]:
        present = [n for n in names if n in fields and n not in placed]
        if not present:
            continue
        group = _UnderscoreNames(parser.add_argument_group(title))
        for name in present:
            field = fields[name]
            field.type = hints[name]  # HfArgumentParser narrows Optional[X] in place; start from the hint
            HfArgumentParser._parse_dataclass_field(group, field)
            if hints[name] == Optional[bool]:  # unset (None: the script decides), true, false, or bare: true
                action = next(a for a in reversed(parser._actions) if a.dest == name)
                action.nargs, action.const, action.metavar = "?", True, "BOOL"
            placed.add(name)
    aliases = [f"--{trl} = --{ours}" + (" (" + ", ".join(f"{a}: {b}" for a, b in values.items()) + ")" if values else "")
               for trl, (ours, values) in TRL_ALIASES.items() if ours in fields]
    parser.add_argument_group(
        "TRL's names, accepted", "; ".join(aliases) + ". --gradient_accumulation_steps and --generation_batch_size are "
        "checked against the counts that follow from the flags above (README: \"Coming from TRL\").")
    return parser


def _normalise(argv: list, parser, fields: set) -> tuple:
    """The command line as argparse should see it: dashes in flag names turned into underscores,
    TRL's names into this project's, negative numbers kept as values (`--learning_rate -1e-3`),
    TRL's list form joined (`--reward_funcs a b` -> `a,b`). Returns (argv, {TRL count: value}) and
    raises UsageError for a TRL flag that has no meaning here."""
    takes_value = {option[2:]: a.nargs != 0 for a in parser._actions for option in a.option_strings}
    out, derived, i = [], {}, 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        name, eq, value = token[2:].partition("=")
        name = name.replace("-", "_")
        if name not in fields and not name.startswith("no_"):
            if name in TRL_NOT_HERE or name.startswith("vllm_"):
                raise UsageError(f"--{name} (TRL) has no counterpart here: {TRL_NOT_HERE.get(name, _VLLM)}")
            if name in OTHER_SCRIPT:
                raise UsageError(f"--{name}: {OTHER_SCRIPT[name]}")
            if name in TRL_ALIASES and TRL_ALIASES[name][0] not in fields:
                raise UsageError(f"--{name} is TRL's name for --{TRL_ALIASES[name][0]}, a flag of the other script")
        values = [value] if eq else []
        if name in TRL_DERIVED and name not in fields:
            if not eq and i < len(argv):
                values, i = [argv[i]], i + 1
            try:
                derived[name] = int(values[0])
            except (IndexError, ValueError):
                raise UsageError(f"--{name} expects an integer (got {' '.join(values) or 'nothing'})")
            continue
        if name in TRL_ALIASES and name not in fields and TRL_ALIASES[name][0] in fields:
            name, mapping = TRL_ALIASES[name]
            if mapping is not None:  # a TRL boolean whose value becomes a choice here
                if not eq and i < len(argv) and argv[i].lower() in _BOOL_WORDS:
                    values, i = [argv[i]], i + 1
                word = (values[0] if values else "true").lower()
                values = [mapping["true" if word in ("true", "yes", "t", "y", "1") else "false"]]
                eq = "="
        if not eq and takes_value.get(name) and i < len(argv) and argv[i].startswith("-") and _is_number(argv[i]):
            values, i = [argv[i]], i + 1  # argparse would read -1e-3 as a flag
            eq = "="
        if not eq and name in _LIST_FLAGS:
            while i < len(argv) and (not argv[i].startswith("-") or _is_number(argv[i])):
                values.append(argv[i])
                i += 1
            if values:
                values, eq = [",".join(values)], "="
        out.append(f"--{name}" + (f"={values[0]}" if eq else ""))
        if not eq:
            out += values
    return out, derived


def _unknown_flag_message(token: str, parser) -> str:
    name = token.lstrip("-").split("=", 1)[0]
    if not token.startswith("-"):
        return f"unexpected value '{token}' (every value follows its --flag; see --help)"
    fields = {a.dest for a in parser._actions}
    known = sorted({s[2:] for s in parser._option_string_actions if s.startswith("--")}
                   | {n for n, (ours, _) in TRL_ALIASES.items() if ours in fields})
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else "; see --help for the flags"
    return f"unknown flag {token.split('=', 1)[0]}{hint}"


_UNSET = object()


def parse_args(args_class, argv=None):
    """Parse `argv` (default: sys.argv[1:]) into an `args_class` instance.

    Returns (args, explicit): `explicit` is the set of field names the user set on the command
    line or in `--config`, so that presets like `--debug` only fill in what the user left alone.
    Every bad input raises UsageError (one line): unknown flags (with the nearest valid names; no
    prefix abbreviations), invalid choices and values, TRL flags with no meaning here. TRL's
    derived counts are kept in `args.trl_counts` for the scripts' size checks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    fields = {f.name for f in dataclasses.fields(args_class)}
    parser = build_parser(args_class)
    config_path = None
    for i, token in enumerate(argv):  # find --config before the real parse
        if token == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
        elif token.startswith("--config="):
            config_path = token.split("=", 1)[1]
    if config_path is not None:  # config keys may use TRL's names too; later tokens win in argparse
        known = fields | set(TRL_ALIASES) | set(TRL_DERIVED) | set(TRL_NOT_HERE) | set(OTHER_SCRIPT)  # said below
        argv = _config_to_argv(config_path, known) + argv
    argv, derived = _normalise(argv, parser, fields)
    namespace, rest = parser.parse_known_args(argv)
    if rest:
        raise UsageError(_unknown_flag_message(rest[0], parser))
    args = args_class(**{name: getattr(namespace, name) for name in fields})
    # second parse with every default replaced by a sentinel tells which flags were given
    parser.set_defaults(**{name: _UNSET for name in fields})
    namespace, _ = parser.parse_known_args(argv)
    explicit = {name for name in fields if getattr(namespace, name, _UNSET) is not _UNSET}
    explicit.discard("config")
    args.trl_counts = derived  # not a field: not in --help, not in the saved config
    return args, explicit


def apply_trl_generation_batch_size(args, explicit, completions_per_prompt):
    """TRL's --generation_batch_size (completions generated per round, over all processes). Here a
    round is one step, generating --prompts_per_step x `completions_per_prompt` completions: the
    value sets --prompts_per_step when that flag is not given and the division is exact, else it
    must equal the count. (Not --generation_slice_size, which decodes fewer at a time.)"""
    value = getattr(args, "trl_counts", {}).get("generation_batch_size")
    if value is None:
        return
    per = completions_per_prompt
    count = f"--prompts_per_step x {per} (--num_generations)" if per > 1 else "--prompts_per_step (one each)"
    if "prompts_per_step" not in explicit and value >= per and value % per == 0:
        args.prompts_per_step = value // per
    elif value != args.prompts_per_step * per:
        raise UsageError(f"--generation_batch_size {value} (TRL: completions generated per round): each step here "
                         f"generates {count} = {args.prompts_per_step * per}; set --prompts_per_step, or use "
                         "--generation_slice_size to decode fewer at a time")


def apply_trl_gradient_accumulation(args, explicit, completions_per_optimizer_step):
    """TRL's --gradient_accumulation_steps: here the count follows from the sizes (each process's
    completions per optimizer step / --per_device_train_batch_size). It sets the micro-batch when
    that flag is not given and the division is exact, else it must equal the derived count."""
    value = getattr(args, "trl_counts", {}).get("gradient_accumulation_steps")
    if value is None:
        return
    n = completions_per_optimizer_step
    if value < 1 or n % value:
        valid = [d for d in range(1, n + 1) if n % d == 0]
        raise UsageError(f"--gradient_accumulation_steps {value} does not divide the {n} completions each process "
                         f"trains on per optimizer step; valid: {valid}")
    if args.use_dynamic_bsz:
        raise UsageError("--gradient_accumulation_steps with --use_dynamic_bsz: micro-batches then follow the token "
                         "budget (--max_token_len_per_gpu); leave one of them out")
    if "per_device_train_batch_size" in explicit and args.per_device_train_batch_size * value != n:
        raise UsageError(f"--gradient_accumulation_steps {value} with --per_device_train_batch_size "
                         f"{args.per_device_train_batch_size}: each process trains on {n} completions per optimizer "
                         f"step, so {value} micro-batches are of {n // value}; give one of the two flags")
    args.per_device_train_batch_size = n // value


def parse_float_list(text: str, flag: str) -> list:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 1.0,0.5")


# ----------------------------------------------------------------------------------------------
# Process settings at start


class _DropMessages(logging.Filter):
    def __init__(self, *texts):
        super().__init__()
        self.texts = texts

    def filter(self, record):
        return not any(text in str(record.msg) for text in self.texts)


# (logger, what the message says) of start-up warnings from other libraries that say nothing to the user
# of these scripts; each is dropped at its own logger, every other message of theirs still shows
QUIET = (
    ("torchao", ("Failed to load",)),  # torchao's prebuilt .so files for other Python/CUDA builds
    ("torch.utils._pytree", ("%s is an Enum subclass",)),  # torchao registering enums, deprecated in torch
    ("bitsandbytes.backends.cpu.ops", ("Failed to load CPU gemm_4bit_forward",)),  # optional `kernels` package
    ("DeepSpeed", ("Setting accelerator to CPU",)),  # DeepSpeed's detection on a machine without a GPU
    ("accelerate.utils.other", ("Removed shared tensor",)),  # tied embeddings saved once, as they should be
)


def quiet_library_warnings():
    """Install the QUIET filters (before the libraries load; idempotent)."""
    for name, texts in QUIET:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(*texts))


def set_cpu_threads(device, toy_model: bool, verbose: bool = True):
    """On the CPU, when neither OMP_NUM_THREADS nor MKL_NUM_THREADS is set, pick the intra-op
    thread count: 1 for the embedded tiny model (its 64-wide matmuls gain nothing from a second
    thread, and two threads stall whenever another process wants the cores: README "What --debug
    shows"), else the cores this process may use, shared among the processes of this machine.
    Prints the count (with `verbose`) and returns it; on a GPU torch's default stays (None)."""
    import torch

    if getattr(device, "type", str(device)) != "cpu":
        return None
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            line = f"cpu threads: {torch.get_num_threads()} ({var}={os.environ[var]})"
            break
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        threads = 1 if toy_model else max(1, cores // local)
        torch.set_num_threads(threads)
        why = "the tiny model gains nothing from more" if toy_model else f"{cores} cores / {local} processes here"
        line = f"cpu threads: {threads} of {cores} cores ({why}; OMP_NUM_THREADS=N to choose)"
    if verbose:
        print(line, flush=True)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# User code failures


def user_frames_only(exc: BaseException) -> str:
    """The traceback of `exc` without this repository's own frames (the scripts and utils/): what
    is left is the user's code and the libraries it called."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = (os.path.join(root, "utils") + os.sep, os.path.join(root, "train_grpo.py"), os.path.join(root, "train_ppo.py"))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not os.path.abspath(f.filename).startswith(ours)]
    text = "".join(traceback.format_list(frames)) if frames else ""
    head = "Traceback of your code (most recent call last):\n" if frames else ""
    return head + text + "".join(traceback.format_exception_only(type(exc), exc))
