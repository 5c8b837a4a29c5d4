"""--log_completions' file and table (utils/completions.py), without a training run."""
import json
import math
from types import SimpleNamespace

import torch

from utils.completions import COMPLETIONS_FILE, CompletionLogger, markdown_table


def one_process():
    return SimpleNamespace(is_main_process=True, num_processes=1)


def log_step(logger, step):
    rewards_per_func = torch.tensor([[1.0, -0.5], [0.0, math.nan]])
    logger.log(step, ["1+2=", [{"role": "user", "content": "3+4="}]], ["3", "a|b\nc"], rewards_per_func,
               ["accuracy", "overlong_penalty"], torch.tensor([0.5, 0.0]), torch.tensor([0.75, -0.75]))


def test_rows_per_completion_and_a_resumed_run_drops_later_rows(tmp_path, capsys):
    logger = CompletionLogger(one_process(), str(tmp_path), "none", num_to_print=1)
    for step in (1, 2, 3):
        log_step(logger, step)
    rows = [json.loads(line) for line in open(tmp_path / COMPLETIONS_FILE)]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert rows[0] == {"step": 1, "prompt": "1+2=", "completion": "3", "accuracy": 1.0, "overlong_penalty": -0.5,
                       "reward": 0.5, "advantage": 0.75}
    assert rows[1]["overlong_penalty"] is None and "3+4=" in rows[1]["prompt"]  # NaN: the function did not apply
    assert capsys.readouterr().out.count("reward 0.500 advantage 0.750 | '1+2=' -> '3'") == 3  # one printed per step
    # resumed from checkpoint-2: step 3's rows (logged after it) go, and the resumed run writes them again
    log_step(CompletionLogger(one_process(), str(tmp_path), "none", 0, resumed_step=2), 3)
    assert [json.loads(line)["step"] for line in open(tmp_path / COMPLETIONS_FILE)] == [1, 1, 2, 2, 3, 3]
    CompletionLogger(one_process(), str(tmp_path), "none", 0)  # a fresh run empties the file
    assert (tmp_path / COMPLETIONS_FILE).read_text() == ""


def test_a_resume_after_a_kill_drops_the_torn_last_row(tmp_path):
    """kill -9 inside a write leaves half a line: the resumed run drops it (as metrics.jsonl's rows)."""
    logger = CompletionLogger(one_process(), str(tmp_path), "none", 0)
    for step in (1, 2):
        log_step(logger, step)
    with open(tmp_path / COMPLETIONS_FILE, "a") as f:
        f.write('{"step": 3, "prompt": "1+')
    CompletionLogger(one_process(), str(tmp_path), "none", 0, resumed_step=2)
    assert [json.loads(line)["step"] for line in open(tmp_path / COMPLETIONS_FILE)] == [1, 1, 2, 2]


def test_markdown_table_escapes_cells():
    table = markdown_table(["prompt", "reward"], [{"prompt": "a|b\nc", "reward": None}, {"prompt": "x", "reward": 1}])
    assert table.splitlines() == ["| prompt | reward |", "|---|---|", "| a\\|b\\nc | - |", "| x | 1.000 |"]
