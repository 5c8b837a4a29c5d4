"""The README stays true: every flag has a row, and CI runs the README's test command."""
import dataclasses
import os
import re

import pytest

import train_grpo
import train_ppo
from helpers import ROOT


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


@pytest.mark.parametrize("script", [train_grpo, train_ppo])
def test_every_flag_has_a_readme_row(script):
    rows = set(re.findall(r"^\| `--(\w+)` \|", readme(), flags=re.M))
    missing = [f.name for f in dataclasses.fields(script.Args) if f.name not in rows]
    assert not missing, f"flags without a README row: {missing}"


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", readme(), flags=re.S)
    install_and_run, install_and_test = blocks[0], blocks[1]
    assert install_and_run.endswith("python train_grpo.py --debug")
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        commands = [line for line in f.read().splitlines() if line and not line.startswith("#")]
    assert install_and_test in commands
