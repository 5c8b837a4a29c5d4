"""Prompt datasets: loading (hub id or local file), column checks, chat templates, left
truncation, and a deterministic prompt order that a resumed run can pick up exactly."""

import os
import warnings

from utils.cli import UsageError

def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def load_prompt_dataset(name, config=None, split="train"):
    """A `datasets.Dataset` from a hub id, a local folder, or a local json/jsonl/parquet/csv file."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if os.path.isfile(name):
            ext = os.path.splitext(name)[1].lower()
            if ext not in LOCAL_FORMATS:
                raise UsageError(
                    f"--dataset_name {name}: unsupported file type '{ext}'; use one of {', '.join(LOCAL_FORMATS)}"
                )
            if os.path.getsize(name) == 0:
                raise UsageError(f"dataset {name} is empty (0 rows)")
            if split != "train":
                raise UsageError(f"--dataset_split {split}: a local {ext} file has one split, train; give "
                                 "--dataset_split train, or a folder (or hub dataset) that has that split")
            try:
                return datasets.load_dataset(LOCAL_FORMATS[ext], data_files=name, split="train")
            except ValueError as e:
                if "corresponds to no data" in str(e):
                    raise UsageError(f"dataset {name} is empty (0 rows)")
                raise
        dataset = datasets.load_dataset(name, config, split=split)
    except UsageError:
        raise
    except ValueError as e:
        if "split" in str(e).lower():
            raise UsageError(f"--dataset_split {split}: not found in {name} ({_first_line(e)})")
        raise UsageError(f"--dataset_name {name}: cannot load it ({_first_line(e)})")
    except Exception as e:  # offline hub, missing folder, corrupt file, an empty file ...
        raise UsageError(f"--dataset_name {name}: cannot load it ({_first_line(e)})")
    if isinstance(dataset, datasets.DatasetDict):
        raise UsageError(f"--dataset_name {name}: pick a split with --dataset_split ({', '.join(dataset)})")
    return dataset


def check_columns(dataset, prompt_column, answer_column, answer_required, source):
    """Fail early, naming the columns that exist, when a needed column is missing or empty."""
    if len(dataset) == 0:
        raise UsageError(f"dataset {source} is empty (0 rows)")
    columns = list(dataset.column_names)
    if prompt_column not in columns:
        raise UsageError(f"--prompt_column {prompt_column}: no such column in {source}; columns are {', '.join(columns)}")
    if answer_required and answer_column not in columns:
        raise UsageError(
            f"--answer_column {answer_column}: no such column in {source} (the accuracy reward needs it); "
            f"columns are {', '.join(columns)}"
        )
    check_prompts_are_text(dataset, prompt_column, source)


def check_prompts_are_text(dataset, prompt_column, source):
    """Prompts must be text or chat messages (TRL's conversational format); a column of numbers or
    of token-id lists is refused rather than turned into text. Reads the column's type, and
    checks the first rows' values for columns that hold lists."""
    import datasets
    from trl.data_utils import is_conversational

    feature = dataset.features[prompt_column]
    if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string"):
        return
    for row in range(min(len(dataset), 8)):
        value = dataset[row][prompt_column]
        if not (isinstance(value, str) or is_conversational({"prompt": value})):
            shown = repr(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise UsageError(f"--prompt_column {prompt_column}: row {row} of {source} holds {shown} "
                             f"({_describe(feature)}); prompts must be text or a list of chat messages "
                             '([{"role": "user", "content": ...}])')


def _describe(feature) -> str:
    """`a column of int64`, `a column of lists of int64`, ... from a datasets feature."""
    kind = ""
    while getattr(feature, "feature", None) is not None:  # List / Sequence
        kind, feature = kind + "lists of ", feature.feature
    return f"a column of {kind}{getattr(feature, 'dtype', None) or type(feature).__name__}"


def load_task_dataset(args, accelerator, answer_required):
    """The prompts to train on: --dataset_name (checked) or, when unset, the toy task."""
    with accelerator.main_process_first():
        if args.dataset_name is None:
            from utils import toy

            dataset, source = toy.build_dataset(seed=args.seed), "the toy task"
        else:
            dataset = load_prompt_dataset(args.dataset_name, args.dataset_config, args.dataset_split)
            source = args.dataset_name
    check_columns(dataset, args.prompt_column, args.answer_column, answer_required, source)
    return dataset


def process_batch(dataset, step, prompts_per_step, seed, process_index, num_processes, prompt_column,
                  answer_column, repeat=1):
    """This process's share of `step`'s prompts, each repeated `repeat` times (adjacent).

    Returns (raw prompts [b], prompts [b * repeat], columns {name: [b * repeat]}): the columns
    hold every other dataset column, plus `answer` (the --answer_column values) for rewards."""
    rows = prompt_indices(len(dataset), prompts_per_step, step, seed)
    per_process = prompts_per_step // num_processes
    batch = dataset[rows[process_index * per_process : (process_index + 1) * per_process]]
    raw_prompts = batch[prompt_column]
    prompts = [p for p in raw_prompts for _ in range(repeat)]
    columns = {k: [v for v in values for _ in range(repeat)] for k, values in batch.items() if k != prompt_column}
    if answer_column in columns:
        columns["answer"] = columns[answer_column]
    return raw_prompts, prompts, columns


def render_prompt(prompt, tokenizer, use_chat_template, system_prompt=None) -> str:
    """The text the model sees: the chat template applied to a user turn (or to the given list
    of messages), with the generation prompt; or the raw text."""
    if use_chat_template:
        from trl.data_utils import apply_chat_template

        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if system_prompt and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}] + messages
        # TRL's rendering: the generation prompt after a user turn, or the assistant's turn continued
        return apply_chat_template({"prompt": messages}, tokenizer)["prompt"]
    if isinstance(prompt, list):
        prompt = "\n".join(m["content"] for m in prompt)
    return (system_prompt + "\n" if system_prompt else "") + str(prompt)


class PromptEncoder:
    """Tokenizes prompts, left-truncating those over `max_length` tokens (with one warning per
    batch that says how many), and left-pads a batch for generation. use_chat_template=None:
    use the template when the tokenizer has one."""

    def __init__(self, tokenizer, max_length, use_chat_template=None, system_prompt=None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        if use_chat_template is None:
            use_chat_template = getattr(tokenizer, "chat_template", None) is not None
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.num_truncated = 0

    def __call__(self, prompts, device):
        import torch

        texts = [render_prompt(p, self.tokenizer, self.use_chat_template, self.system_prompt) for p in prompts]
        # the chat template already holds the special tokens it wants
        ids = self.tokenizer(texts, add_special_tokens=not self.use_chat_template)["input_ids"]
        too_long = [i for i, x in enumerate(ids) if len(x) > self.max_length]
        if too_long:
            self.num_truncated += len(too_long)
            longest = max(len(ids[i]) for i in too_long)
            warnings.warn(
                f"{len(too_long)} prompts are longer than --max_prompt_length {self.max_length} "
                f"(longest {longest} tokens); they were cut from the left"
            )
            ids = [x[-self.max_length :] for x in ids]
        width = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id
        prompt_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)  # [B, P]
        prompt_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        return prompt_ids, prompt_mask


def prompt_indices(dataset_size, prompts_per_step, step, seed):
    """Dataset rows of `step`'s global prompt batch.

    Rows are read from a stream of epochs, each a fresh permutation seeded by (seed, epoch), so
    the batch of any step is known from the step number alone: resuming needs no sampler state."""
    import torch

    start = step * prompts_per_step
    indices = []
    while len(indices) < prompts_per_step:
        epoch, offset = divmod(start + len(indices), dataset_size)
        generator = torch.Generator().manual_seed(seed * 100003 + epoch)
        order = torch.randperm(dataset_size, generator=generator).tolist()
        indices += order[offset : offset + prompts_per_step - len(indices)]
    return indices
