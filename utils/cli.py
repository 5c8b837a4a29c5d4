"""Command line plumbing shared by the training scripts: parse an `Args` dataclass with
`transformers.HfArgumentParser`, accept `--config file.yaml` (the command line wins), remember
which flags the user set explicitly, and turn bad input into one readable error line."""

import dataclasses
import difflib
import os
import sys

import yaml


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


class UserCodeError(Exception):
    """The user's code (a reward function, a reward model) failed mid-step. Its message is the
    whole report; the training loop saves the last finished step first (--save_on_error)."""


def fail(message: str, code: int = 2):
    """Print `error: message` on stderr (once per machine in multi-process runs) and exit."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def _config_to_argv(path: str, field_names: set) -> list:
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
        if name not in field_names:
            close = difflib.get_close_matches(name, sorted(field_names), n=3)
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


_UNSET = object()


def parse_args(args_class, argv=None):
    """Parse `argv` (default: sys.argv[1:]) into an `args_class` instance.

    Returns (args, explicit): `explicit` is the set of field names the user set on the command
    line or in `--config`, so that presets like `--debug` only fill in what the user left alone.
    Unknown flags and invalid choices exit with argparse's usual one-line error (code 2)."""
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    field_names = {f.name for f in dataclasses.fields(args_class)}
    parser = HfArgumentParser(args_class)
    config_path = None
    for i, token in enumerate(argv):  # find --config before the real parse
        if token == "--config" and i + 1 < len(argv):
            config_path = argv[i + 1]
        elif token.startswith("--config="):
            config_path = token.split("=", 1)[1]
    if config_path is not None:
        argv = _config_to_argv(config_path, field_names) + argv  # later tokens win in argparse
    (args,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    # second parse with every default replaced by a sentinel tells which flags were given
    parser.set_defaults(**{name: _UNSET for name in field_names})
    namespace, _ = parser.parse_known_args(argv)
    explicit = {name for name in field_names if getattr(namespace, name, _UNSET) is not _UNSET}
    explicit.discard("config")
    return args, explicit


def parse_float_list(text: str, flag: str) -> list:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 1.0,0.5")
