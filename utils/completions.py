"""--log_completions: every logged step, a table of the step's completions (prompt, completion,
each reward function's score, the reward and the advantage), appended to
output_dir/completions.jsonl, sent to the tracker (--report_to tensorboard: a text table; wandb: a
table) and, for the first --num_completions_to_print rows, printed under the progress bar."""

import json
import math
import os

COMPLETIONS_FILE = "completions.jsonl"


class CompletionLogger:
    """Gathers every process's rows to the main process, which writes them. `resumed_step`: the
    step a resumed run starts from (rows logged after it by the interrupted run are dropped, so
    each step is in the file once); None: a fresh run (the file is emptied)."""

    def __init__(self, accelerator, output_dir, report_to, num_to_print, resumed_step=None):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, COMPLETIONS_FILE)
        self.report_to = report_to
        self.num_to_print = num_to_print
        if accelerator.is_main_process:
            from utils.logger import keep_rows_up_to

            keep_rows_up_to(self.path, resumed_step)  # as metrics.jsonl: torn last lines dropped too

    def log(self, step, prompts, completions, rewards_per_func, reward_names, rewards, advantages):
        """prompts, completions: this process's [b] lists; rewards_per_func [b, F] (NaN where a
        function does not apply), rewards [b] (the weighted sum), advantages [b]."""
        from accelerate.utils import gather_object

        scores = rewards_per_func.float().cpu().tolist()
        local = [{"step": step, "prompt": p if isinstance(p, str) else str(p), "completion": c,
                  **{name: _finite_or_none(s[j]) for j, name in enumerate(reward_names)},
                  "reward": _finite_or_none(r), "advantage": _finite_or_none(a)}
                 for p, c, s, r, a in zip(prompts, completions, scores, rewards.float().cpu().tolist(),
                                          advantages.float().cpu().tolist())]
        rows = gather_object(local) if self.accelerator.num_processes > 1 else local
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        columns = ["prompt", "completion", *reward_names, "reward", "advantage"]
        if self.report_to == "tensorboard":
            self.accelerator.get_tracker("tensorboard").log({"completions": markdown_table(columns, rows)}, step=step)
        elif self.report_to == "wandb":
            self.accelerator.get_tracker("wandb").log_table("completions", columns=columns,
                                                            data=[[row[c] for c in columns] for row in rows], step=step)
        if self.num_to_print:
            from tqdm.auto import tqdm

            for row in rows[:self.num_to_print]:
                tqdm.write(f"  step {step} | reward {_fmt(row['reward'])} advantage {_fmt(row['advantage'])} | "
                           f"{row['prompt']!r} -> {row['completion']!r}")


def markdown_table(columns, rows):
    """A markdown table (tensorboard's text tab renders it), cells escaped."""
    def cell(value):
        text = _fmt(value) if not isinstance(value, str) else value
        return text.replace("|", "\\|").replace("\n", "\\n")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _finite_or_none(value):
    return value if value is not None and math.isfinite(value) else None


def _fmt(value):
    return "-" if value is None else f"{value:.3f}"
