"""Reward functions: the built-in rule rewards, loading user functions, calling them as TRL does,
and a reward model.

A reward function is called once per batch with TRL's keyword arguments (a TRL reward function
runs unchanged) and returns one float per completion, or None where it does not apply (a
completion with no applicable reward gets 0 from it):

    def my_reward(completions, prompts, completion_ids, trainer_state, **kwargs) -> list[float | None]:
        # completions:    list[str] (special tokens removed); when the prompts are chat messages,
        #                 list[list[dict]]: [{"role": "assistant", "content": text}], as in TRL
        # prompts:        the prompt column's values (str, or a list of chat messages)
        # completion_ids: list[list[int]], each completion's token ids (its EOS included)
        # trainer_state:  a transformers.TrainerState: global_step (steps done), max_steps, epoch
        # kwargs:         every other dataset column by its name, as lists, and `answer`, the
        #                 values of --answer_column (whatever that column is called)
        ...

A function without **kwargs receives only the names it takes; one that needs a name that is not
passed is refused at start. Give it as `--reward_funcs path/to/file.py:my_reward`,
`package.module:my_reward` or `package.module.my_reward` (TRL's dotted form, e.g.
`trl.rewards.think_format_reward`). A function that raises or returns something else than one
number (or None) per completion stops the run with a UserCodeError naming it and the step.
"""

import difflib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import warnings

from utils.base import REWARD_BATCH_ROWS
from utils.cli import UsageError, UserCodeError, user_frames_only

# ----------------------------------------------------------------------------------------------
# Built-in rule rewards (GSM8K-style)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")


def _boxed_contents(text: str) -> list:
    """Contents of every \\boxed{...}, with nested braces balanced; unclosed ones are skipped."""
    found = []
    for match in re.finditer(r"\\boxed\s*\{", text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found.append(text[start:i])
                break
    return found


def _to_number(text: str):
    """A float from a number written like `1,234.5`, `$42`, `-3`, `\\frac{1}{2}`; else None."""
    frac = _FRAC.search(text)
    if frac and int(frac.group(2)) != 0:
        return int(frac.group(1)) / int(frac.group(2))
    match = _NUMBER.search(text)
    return float(match.group().replace(",", "")) if match else None


def extract_answer(text: str, fallback_last_number: bool = True):
    """The final answer a text states: the last \\boxed{...}, else what follows the last `####`,
    else (if `fallback_last_number`) the last number in the text. Returns a float or None."""
    boxed = _boxed_contents(text)
    if boxed:
        return _to_number(boxed[-1])
    if "####" in text:
        return _to_number(text.rsplit("####", 1)[1])
    if fallback_last_number:
        numbers = _NUMBER.findall(text)
        return float(numbers[-1].replace(",", "")) if numbers else None
    return None


def _numbers_equal(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def completion_text(completion) -> str:
    """The text of a completion: a string, or a conversational completion's message contents."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return completion


def accuracy(completions, answer=None, **kwargs):
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    The reference may be a GSM8K solution (`... #### 42`), `\\boxed{42}` or a bare number; the
    completion's answer is its last \\boxed{}, else what follows `####`, else its last number."""
    if answer is None:
        raise ValueError("the accuracy reward needs an answer column (--answer_column)")
    rewards = []
    for completion, reference in zip(completions, answer):
        expected = extract_answer(str(reference))
        got = extract_answer(completion_text(completion))
        if expected is None:
            rewards.append(None)  # the reference has no number: this reward does not apply
        else:
            rewards.append(1.0 if got is not None and _numbers_equal(got, expected) else 0.0)
    return rewards


def format(completions, **kwargs):  # noqa: A001 - the name users type in --reward_funcs
    """1.0 when the completion marks a numeric final answer with `#### <number>` or
    `\\boxed{<number>}`, else 0.0."""
    return [0.0 if extract_answer(completion_text(c), fallback_last_number=False) is None else 1.0 for c in completions]


BUILTIN_REWARDS = {"accuracy": accuracy, "format": format}

# ----------------------------------------------------------------------------------------------
# Resolving --reward_funcs


def load_reward_function(spec: str):
    """`name` (built-in), `path/to/file.py:function`, `package.module:function` or
    `package.module.function` -> callable."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" in spec:
        source, name = spec.rsplit(":", 1)
    elif "." in spec and not spec.endswith(".py"):
        source, name = spec.rsplit(".", 1)
    else:
        raise UsageError(
            f"--reward_funcs: unknown reward function '{spec}'; built-ins are {', '.join(BUILTIN_REWARDS)}, "
            "or give path/to/file.py:function, package.module:function or package.module.function"
        )
    try:
        if source.endswith(".py"):
            if not os.path.isfile(source):
                raise UsageError(f"--reward_funcs {spec}: file {source} does not exist")
            module_name = "lean_rl_reward_" + re.sub(r"\W", "_", os.path.abspath(source))
            module_spec = importlib.util.spec_from_file_location(module_name, source)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
    except UsageError:
        raise
    except Exception as e:  # syntax errors, failing imports inside the user's file, ...
        raise UsageError(f"--reward_funcs {spec}: cannot load {source} ({type(e).__name__}: {e})")
    try:
        fn = getattr(module, name, None)
    except Exception as e:  # a lazy module (trl.rewards) whose member fails to import
        raise UsageError(f"--reward_funcs {spec}: cannot load {name} from {source} ({type(e).__name__}: {e})")
    if not callable(fn):
        public = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        raise UsageError(f"--reward_funcs {spec}: {source} has no function '{name}' (it has: {', '.join(public)})")
    return fn


def reward_function_name(spec: str) -> str:
    """Metric name of a reward: `accuracy`, or the function name of `file.py:fn` / `module.fn`."""
    if spec in BUILTIN_REWARDS:
        return spec
    return spec.rsplit(":", 1)[-1] if ":" in spec else spec.rsplit(".", 1)[-1]


def resolve_rewards(reward_funcs: str, reward_weights, reward_model_name_or_path):
    """Parse --reward_funcs/--reward_weights (before any model loads).

    Returns (specs, [(name, fn)], weights); the reward model, if any, is appended to the
    functions later and takes the last weight."""
    from utils.cli import parse_float_list

    specs = [s.strip() for s in reward_funcs.split(",") if s.strip() and s.strip() != "none"]
    functions = [(reward_function_name(s), load_reward_function(s)) for s in specs]
    names = [n for n, _ in functions] + (["reward_model"] if reward_model_name_or_path else [])
    if not names:
        raise UsageError("no reward: give --reward_funcs and/or --reward_model_name_or_path")
    weights = parse_float_list(reward_weights, "--reward_weights") if reward_weights else [1.0] * len(names)
    if len(weights) != len(names):
        raise UsageError(f"--reward_weights has {len(weights)} values for {len(names)} rewards ({', '.join(names)})")
    return specs, functions, weights


# ----------------------------------------------------------------------------------------------
# Calling reward functions as TRL does

PASSED = ("prompts", "completions", "completion_ids", "trainer_state")  # besides the dataset's columns
TRL_ONLY = ("log_extra", "log_metric", "environments")  # TRL passes these too; this script does not


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: call them with everything
        return None


def accepted_names(fn):
    """The keyword names `fn` takes, or None when it takes **kwargs (or has no signature)."""
    sig = _signature(fn)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return {p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_reward_signatures(reward_fns, column_names, prompt_column, answer_column):
    """Refuse, before any model loads, a reward function whose signature cannot take what is
    passed: a required parameter that is not passed, a positional-only one, or none it can take."""
    columns = [c for c in column_names if c != prompt_column]
    columns += ["answer"] if answer_column in column_names and "answer" not in columns else []
    passed = set(PASSED) | set(columns)
    receives = f"it receives {', '.join(PASSED)} and the columns {', '.join(columns) or '(none)'}"
    for name, fn in reward_fns:
        sig = _signature(fn)
        if sig is None:
            continue
        params = list(sig.parameters.values())
        for p in params:
            required = p.default is p.empty
            if p.kind is p.POSITIONAL_ONLY and required:
                raise UsageError(f"--reward_funcs: reward function '{name}' has the positional-only parameter "
                                 f"'{p.name}'; reward functions are called with keywords ({receives})")
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and required and p.name not in passed:
                if p.name in TRL_ONLY:
                    why = "TRL passes it, this script does not"
                else:
                    close = difflib.get_close_matches(p.name, sorted(passed), n=1)
                    why = f"not passed (did you mean {close[0]}?)" if close else "not passed"
                raise UsageError(f"--reward_funcs: reward function '{name}' needs '{p.name}', {why}; {receives} "
                                 "(give it a default or take **kwargs)")
        names = accepted_names(fn)
        if names is not None and not names & passed:
            raise UsageError(f"--reward_funcs: reward function '{name}' takes none of what is passed; {receives}")


def trainer_state(step, max_steps, epoch=0.0):
    """What TRL passes as `trainer_state`: a transformers.TrainerState, here with global_step =
    the steps finished (rollout + update), max_steps and epoch (passes over the prompts)."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=max_steps, epoch=epoch)


def score_completions(reward_fns, completions, prompts, columns, device, completion_ids=None, completion_mask=None,
                      step=0, max_steps=0, epoch=0.0):
    """Every reward function on every completion -> [B, F] float32 on `device` (nan: not
    applicable). Called as TRL calls reward functions: conversational prompts give
    conversational completions, `completion_ids` without padding, a `trainer_state`. `step` is
    the number of steps done before this one. A failing function raises UserCodeError; a
    function that gives no reward to any completion of the step is warned about."""
    import torch
    from trl.data_utils import is_conversational

    if prompts and is_conversational({"prompt": prompts[0]}):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    ids = None
    if completion_ids is not None:
        mask = completion_mask.bool() if completion_mask is not None else torch.ones_like(completion_ids, dtype=bool)
        ids = [row[keep].tolist() for row, keep in zip(completion_ids.cpu(), mask.cpu())]
    kwargs = dict(columns, prompts=prompts, completions=completions, completion_ids=ids)
    # transformers' TrainerState drags in its trainer's imports (peft, bitsandbytes, deepspeed: 1.5 s or more at
    # a run's first step): made when a function may read it, not for the built-ins and reward models alone
    def may_read_state(fn):
        names = accepted_names(fn)
        return not (fn in BUILTIN_REWARDS.values() or isinstance(fn, RewardModel)) and (
            names is None or "trainer_state" in names)

    if any(may_read_state(fn) for _, fn in reward_fns):
        kwargs["trainer_state"] = trainer_state(step, max_steps, epoch)
    rewards = torch.zeros(len(completions), len(reward_fns), device=device)
    for j, (name, fn) in enumerate(reward_fns):
        values = call_reward_function(fn, name, kwargs, len(completions), step + 1)
        rewards[:, j] = torch.tensor(values, dtype=torch.float32, device=device)
    silent = [name for j, (name, _) in enumerate(reward_fns) if len(completions) and torch.isnan(rewards[:, j]).all()]
    if silent:
        warnings.warn(f"step {step + 1}: {', '.join(silent)} gave no reward (None or NaN) to any of the "
                      f"{len(completions)} completions; they get 0 from " + ("it" if len(silent) == 1 else "them"))
    return rewards


def call_reward_function(fn, name, kwargs, num_completions, step) -> list:
    """Call one reward function with what it takes of `kwargs` and check what it returns: one
    number or None per completion (None -> nan). Raises UserCodeError naming the function and
    the step (1-based) when it raises or returns anything else."""
    import torch

    names = accepted_names(fn)
    who = f"reward model {fn.path}" if isinstance(fn, RewardModel) else f"reward function '{name}'"
    where = f"{who} at step {step}"
    try:
        values = fn(**(kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}))
    except torch.OutOfMemoryError:
        raise  # memory, not the function: the run's out-of-memory report explains it
    except Exception as e:
        raise UserCodeError(f"{where} raised {type(e).__name__}: {e}", user_frames_only(e)) from None
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a tensor or numpy array
        values = values.tolist()
    expected = f"expected a list of {num_completions} numbers (or None), one per completion"
    if values is None or isinstance(values, (str, bytes, dict, numbers.Number)) or not hasattr(values, "__len__"):
        shown = "None" if values is None else f"a {type(values).__name__} ({values!r:.60})"
        raise UserCodeError(f"{where} returned {shown}; {expected}")
    if len(values) != num_completions:
        raise UserCodeError(f"{where} returned {len(values)} values for {num_completions} completions; {expected}")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Number) or (hasattr(v, "item") and getattr(v, "ndim", 1) == 0):
            out.append(float(v))
        else:
            raise UserCodeError(f"{where} returned a {type(v).__name__} ({v!r:.60}) for completion {i}; {expected}")
    return out


# ----------------------------------------------------------------------------------------------
# Reward model


class RewardModel:
    """A sequence-classification model (num_labels=1) that scores prompt + completion.

    It uses its own tokenizer when its folder has one (text is detokenized by the policy and
    re-tokenized here). Inputs longer than the model's positions are cut from the left, keeping
    the completion's end where the score is read, with a warning, so they never overflow the
    position embeddings."""

    name = "reward_model"

    def __init__(self, path, placement, dtype, fallback_tokenizer=None, batch_size=REWARD_BATCH_ROWS, trust_remote_code=False,
                 quantization=None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from utils.modeling import quantization_kwargs
        from utils.placement import place_model

        self.path = path
        kwargs = dict(dtype=dtype) | quantization_kwargs(quantization, dtype, placement.device, skip_modules=["score"])
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, trust_remote_code=trust_remote_code, **kwargs
        )
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
        try:
            if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in tokenizer_files):
                # transformers would build an empty tokenizer of the config's type from such a folder
                raise OSError(f"{path} holds no tokenizer files")
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, TypeError):
            if fallback_tokenizer is None:
                raise
            self.tokenizer = fallback_tokenizer
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        limits = [getattr(self.model.config, "max_position_embeddings", None), self.tokenizer.model_max_length]
        limits = [int(x) for x in limits if x is not None and x < 1e9]  # tokenizers say 1e30 for "no limit"
        self.max_length = min(limits) if limits else 2048
        self.model = place_model(self.model.requires_grad_(False).eval(), placement)
        self.device = placement.device
        self.batch_size = batch_size
        self.use_chat_template = getattr(self.tokenizer, "chat_template", None) is not None

    def _text(self, prompt, completion):
        """prompt + completion as this model reads them; either may be chat messages."""
        if self.use_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            return self.tokenizer.apply_chat_template(messages + reply, tokenize=False)
        if isinstance(prompt, list):
            prompt = "\n".join(m["content"] for m in prompt)
        return str(prompt) + completion_text(completion)

    def __call__(self, completions, prompts, **kwargs):
        """One score per completion: the model's output at the last non-pad token."""
        import torch

        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        # the chat template already holds the special tokens it wants
        ids = self.tokenizer(texts, add_special_tokens=not self.use_chat_template)["input_ids"]
        too_long = sum(len(x) > self.max_length for x in ids)
        if too_long:
            warnings.warn(f"reward model: {too_long} inputs are longer than its {self.max_length} positions; "
                          "they were cut from the left (the end of the completion is kept)")
        ids = [x[-self.max_length :] for x in ids]
        pad = self.tokenizer.pad_token_id
        scores = []
        for i in range(0, len(ids), self.batch_size):
            chunk = ids[i : i + self.batch_size]
            width = max(len(x) for x in chunk)
            input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in chunk], device=self.device)  # right-padded
            attention_mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], device=self.device)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
            scores += logits[:, 0].float().tolist()
        return scores
