"""Metrics out: one JSON line per logged step in <output_dir>/metrics.jsonl, accelerate's
trackers (--report_to tensorboard|wandb), and a compact line on the console.

metrics.jsonl is strict JSON (NaN and +-inf are written as null). A resumed run holds each step
once: rows past the checkpoint's step are dropped from metrics.jsonl when it starts, and
TensorBoard is told to hide its events from that step on (purge_step)."""

import importlib.util
import json
import math
import os

from utils.cli import UsageError

REPORT_TO = ("none", "tensorboard", "wandb")


def check_report_to(report_to):
    if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--report_to tensorboard: the tensorboard package is not installed (pip install tensorboard)")
    if report_to == "wandb" and importlib.util.find_spec("wandb") is None:
        raise UsageError("--report_to wandb: the wandb package is not installed (pip install wandb)")


def keep_rows_up_to(path, step):
    """Drop the rows of the jsonl file `path` past `step` (logged after the checkpoint a run resumes
    from, e.g. before a kill -9) and any torn last line; step 0 or None (a fresh run): an empty file.
    Written to a new file, then renamed over the old one; raises OSError (the .tmp removed)."""
    rows = []
    if step and os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                    rows.append(line if line.endswith("\n") else line + "\n")
    try:
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)
    except OSError:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise


class MetricsLogger:
    # (key, label) shown on the console line, in order, when present
    CONSOLE = (("reward/mean", "reward"), ("reward/std", "reward_std"), ("policy/kl", "kl"),
               ("policy/clipfrac", "clipfrac"), ("policy/entropy", "entropy"), ("completions/mean_length", "len"),
               ("loss/policy", "loss"), ("value/loss", "vf_loss"), ("optim/grad_norm", "grad_norm"),
               ("time/step", "step_s"))

    def __init__(self, accelerator, output_dir, report_to, run_name, config, start_step=0):
        self.accelerator = accelerator
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.report_to = report_to
        if accelerator.is_main_process:
            self._keep_rows_up_to(start_step)  # a fresh run (0): an empty file
        accelerator.wait_for_everyone()
        if report_to != "none":
            # trackers want flat, simple values
            flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in config.items()}
            # resumed: TensorBoard hides the earlier run's events from this step on (they are logged again)
            init_kwargs = {"tensorboard": {"purge_step": start_step + 1}} if start_step else {}
            accelerator.init_trackers(run_name, config=flat, init_kwargs=init_kwargs)

    def _keep_rows_up_to(self, step):
        try:
            keep_rows_up_to(self.path, step)
        except OSError as e:
            self._write_failed(e)

    def _write_failed(self, e):
        from utils.cli import fail

        fail(f"could not write {e.filename2 or e.filename or self.path}: [Errno {e.errno}] {e.strerror}; the "
             "checkpoints are untouched (free the space or fix the permission, then resume with --resume_from_checkpoint latest)",
             code=1)

    def log(self, metrics, step):
        # torchao optimizers keep lr as a tensor: scalars of any kind become floats
        clean = {k: (float(v) if isinstance(v, (int, float)) or getattr(v, "numel", lambda: 0)() == 1 else v)
                 for k, v in metrics.items()}
        if self.accelerator.is_main_process:
            row = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
            try:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
            except OSError as e:
                self._write_failed(e)
        if self.report_to != "none":
            self.accelerator.log({k: v for k, v in clean.items() if isinstance(v, float)}, step=step)

    def log_step(self, metrics, step, timer, step_start, verbose=False):
        """Add the step's phase times and memory, its duration and completion tokens/s; write
        the row; with `verbose` print the console line and the per-phase summary."""
        import time

        metrics |= timer.metrics
        metrics["time/step"] = time.perf_counter() - step_start
        metrics["throughput/tokens_per_s"] = metrics["completions/total_tokens"] / metrics["time/step"]
        self.log(metrics, step)
        if verbose and self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(self.console_line(metrics, step) + " || " + timer.summary())
        return metrics

    def console_line(self, metrics, step) -> str:
        parts = [f"step {step}"]
        for key, label in self.CONSOLE:
            if key in metrics and isinstance(metrics[key], (int, float)) and not math.isnan(metrics[key]):
                parts.append(f"{label}={metrics[key]:.4g}")
        return " ".join(parts)

    def close(self):
        """Finish the trackers and tear down the process group (a process group left alive at
        exit can abort the interpreter: "terminate called without an active exception")."""
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()


def rollout_metrics(accelerator, completion_mask, is_truncated, all_rewards_per_func, reward_names):
    """Completion lengths and per-reward-function statistics over all processes."""
    lengths = accelerator.gather(completion_mask.sum(1).float())
    metrics = {
        "completions/mean_length": lengths.mean().item(),
        "completions/max_length": lengths.max().item(),
        "completions/min_length": lengths.min().item(),
        "completions/truncated_frac": accelerator.gather(is_truncated.float()).mean().item(),
        "completions/total_tokens": lengths.sum().item(),
    }
    for j, name in enumerate(reward_names):
        metrics[f"reward/{name}/mean"] = all_rewards_per_func[:, j].nanmean().item()
        metrics[f"reward/{name}/std"] = all_rewards_per_func[:, j].std().item() if len(all_rewards_per_func) > 1 else 0.0
    return metrics


def first_last_line(history, final_dir) -> str:
    """`reward: first 10 steps 0.079 -> last 10 steps 0.943 | saved ...`, the run's last word."""
    k = max(1, min(10, len(history) // 4))
    before, after = sum(history[:k]) / k, sum(history[-k:]) / k
    saved = f"saved {final_dir}" if final_dir else "nothing saved (--save_strategy no)"
    return f"reward: first {k} steps {before:.3f} -> last {k} steps {after:.3f} | {saved}"
