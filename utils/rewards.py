"""Reward functions: the built-in rule rewards, loading user functions, and a reward model.

A reward function is called once per batch with keyword arguments and returns one float per
completion (or None where it does not apply; a completion with no applicable reward gets 0):

    def my_reward(completions, prompts, **kwargs) -> list[float | None]:
        # completions: list[str], the generated text (special tokens removed)
        # prompts:     list, the prompt column's values (str, or a list of chat messages)
        # kwargs:      every other dataset column by its name, as lists, and `answer`, the
        #              values of --answer_column (whatever that column is called)
        ...

Give it as `--reward_funcs path/to/file.py:my_reward` or `--reward_funcs package.module:my_reward`.
"""

import importlib
import importlib.util
import math
import os
import re
import warnings

from utils.cli import UsageError

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


def accuracy(completions, answer=None, **kwargs):
    """1.0 when the completion's final answer equals the reference answer, else 0.0.

    The reference may be a GSM8K solution (`... #### 42`), `\\boxed{42}` or a bare number; the
    completion's answer is its last \\boxed{}, else what follows `####`, else its last number."""
    if answer is None:
        raise ValueError("the accuracy reward needs an answer column (--answer_column)")
    rewards = []
    for completion, reference in zip(completions, answer):
        expected = extract_answer(str(reference))
        got = extract_answer(completion)
        if expected is None:
            rewards.append(None)  # the reference has no number: this reward does not apply
        else:
            rewards.append(1.0 if got is not None and _numbers_equal(got, expected) else 0.0)
    return rewards


def format(completions, **kwargs):  # noqa: A001 - the name users type in --reward_funcs
    """1.0 when the completion marks a numeric final answer with `#### <number>` or
    `\\boxed{<number>}`, else 0.0."""
    return [0.0 if extract_answer(c, fallback_last_number=False) is None else 1.0 for c in completions]


BUILTIN_REWARDS = {"accuracy": accuracy, "format": format}

# ----------------------------------------------------------------------------------------------
# Resolving --reward_funcs


def load_reward_function(spec: str):
    """`name` (built-in), `path/to/file.py:function` or `package.module:function` -> callable."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise UsageError(
            f"--reward_funcs: unknown reward function '{spec}'; built-ins are {', '.join(BUILTIN_REWARDS)}, "
            "or give path/to/file.py:function or package.module:function"
        )
    source, name = spec.rsplit(":", 1)
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
    fn = getattr(module, name, None)
    if not callable(fn):
        public = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise UsageError(f"--reward_funcs {spec}: {source} has no function '{name}' (it has: {', '.join(public)})")
    return fn


def reward_function_name(spec: str) -> str:
    """Metric name of a reward: `accuracy`, or the function name of `file.py:fn`."""
    return spec.rsplit(":", 1)[-1]


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


def score_completions(reward_fns, completions, prompts, columns, device):
    """Every reward function on every completion -> [B, F] float32 on `device` (nan: not applicable)."""
    import torch

    rewards = torch.zeros(len(completions), len(reward_fns), device=device)
    for j, (name, fn) in enumerate(reward_fns):
        values = call_reward_function(fn, name, completions, prompts, columns)
        rewards[:, j] = torch.tensor(values, dtype=torch.float32, device=device)
    return rewards


def call_reward_function(fn, name, completions, prompts, columns) -> list:
    """Call one reward function and check what it returns: a float per completion, None -> nan."""
    values = fn(completions=completions, prompts=prompts, **columns)
    if values is None or len(values) != len(completions):
        got = "None" if values is None else f"{len(values)} values"
        raise ValueError(f"reward function '{name}' returned {got} for {len(completions)} completions")
    return [math.nan if v is None else float(v) for v in values]


# ----------------------------------------------------------------------------------------------
# Reward model


class RewardModel:
    """A sequence-classification model (num_labels=1) that scores prompt + completion.

    It uses its own tokenizer when its folder has one (text is detokenized by the policy and
    re-tokenized here). Inputs longer than the model's positions are cut from the left, keeping
    the completion's end where the score is read, with a warning, so they never overflow the
    position embeddings."""

    name = "reward_model"

    def __init__(self, path, placement, dtype, fallback_tokenizer=None, batch_size=16, trust_remote_code=False,
                 quantization=None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from utils.modeling import quantization_kwargs
        from utils.placement import place_model

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
        if self.use_chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
            return self.tokenizer.apply_chat_template(
                messages + [{"role": "assistant", "content": completion}], tokenize=False
            )
        if isinstance(prompt, list):
            prompt = "\n".join(m["content"] for m in prompt)
        return str(prompt) + completion

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
