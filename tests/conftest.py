import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: helpers.py
from helpers import ROOT, run_script  # noqa: E402

sys.path.insert(0, ROOT)  # the scripts and utils/
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def run():
    """run(args, timeout=600, env=None, script="train_grpo.py") -> CompletedProcess (text)."""
    return run_script
