"""Checkpoints that never lose work: written to a temporary folder and renamed into place (a
crash mid-save leaves the previous checkpoint intact), resumed exactly (model, optimizer,
scheduler, every rank's RNG states, and the step, from which the data position follows), and
saved on SIGTERM/SIGINT before the process exits."""

import json
import os
import re
import shutil
import signal

from utils.cli import UsageError

STATE_FILE = "trainer_state.json"  # written last: its presence marks a complete checkpoint
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir):
    """Complete checkpoints in `output_dir`, oldest first: [(step, path)]."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_resume(resume_from_checkpoint, output_dir):
    """`latest` -> newest complete checkpoint in output_dir; a path -> that checkpoint. Checked
    before any model loads."""
    if resume_from_checkpoint is None:
        return None
    if resume_from_checkpoint == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise UsageError(
                f"--resume_from_checkpoint latest: no complete checkpoint in --output_dir {output_dir} "
                "(looked for checkpoint-<step> folders holding trainer_state.json)"
            )
        return found[-1][1]
    path = resume_from_checkpoint
    if not os.path.isdir(path):
        raise UsageError(f"--resume_from_checkpoint {path}: no such folder")
    if not os.path.isfile(os.path.join(path, STATE_FILE)):
        raise UsageError(
            f"--resume_from_checkpoint {path}: not a complete checkpoint (no {STATE_FILE}); "
            f"complete ones in {output_dir}: {', '.join(p for _, p in list_checkpoints(output_dir)) or 'none'}"
        )
    return path


def _write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(accelerator, output_dir, step, trainer_state, save_total_limit=None):
    """Save everything needed to resume after `step` as output_dir/checkpoint-<step>.

    All ranks write into checkpoint-<step>.tmp (accelerate's save_state: model, optimizer,
    registered objects such as the scheduler, each rank's RNG states); then the main process
    writes trainer_state.json and renames the folder. Older checkpoints beyond
    `save_total_limit` are removed only after the new one is complete."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _write_json(os.path.join(tmp, STATE_FILE), dict(trainer_state, step=step))
        if os.path.exists(final):  # re-saving the same step (e.g. a signal right after a save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        if save_total_limit:
            for _, old in list_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path):
    """Restore what save_checkpoint wrote; returns the trainer state (with `step`)."""
    accelerator.load_state(path)
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def save_pretrained_atomic(accelerator, model, tokenizer, path):
    """The trained model as one folder that `from_pretrained` loads, written atomically. A LoRA
    model is merged into its base weights first (so call this last)."""
    unwrapped = accelerator.unwrap_model(model)
    if hasattr(unwrapped, "merge_and_unload"):  # PEFT
        unwrapped = unwrapped.merge_and_unload()
        state_dict = unwrapped.state_dict()
    else:
        state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


class StopSignal:
    """Turns the first SIGTERM/SIGINT into a request to save and stop at the end of the current
    step (a second SIGINT interrupts at once). All ranks agree through an all-reduce."""

    def __init__(self):
        self.signum = 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        self.signum = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)  # second Ctrl-C stops immediately

    def requested(self, accelerator) -> int:
        """The signal number if any rank received one, else 0 (one tiny all-reduce per step)."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum], device=accelerator.device)
        return int(accelerator.gather(flag).max().item())


class Checkpointer:
    """The run's saving policy: a fresh or resumed start, a checkpoint every `save_steps`, one on
    SIGTERM/SIGINT (then the caller exits), and one at the end; nothing with enabled=False
    (--save_strategy no)."""

    def __init__(self, accelerator, output_dir, save_steps, save_total_limit, enabled=True):
        self.accelerator = accelerator
        self.enabled = enabled
        self.output_dir = output_dir
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.stop = StopSignal()

    def start(self, resume_path) -> dict:
        """Restore `resume_path` (-> its trainer state) or prepare a fresh output_dir (-> {})."""
        if self.accelerator.is_main_process:
            os.makedirs(self.output_dir, exist_ok=True)  # a resumed run may write to a new output_dir
        if resume_path:
            return load_checkpoint(self.accelerator, resume_path)
        if self.accelerator.is_main_process:
            import warnings

            if list_checkpoints(self.output_dir):
                warnings.warn(f"{self.output_dir} already holds checkpoints; this run starts from scratch "
                              "(use --resume_from_checkpoint latest to continue)")
            open(os.path.join(self.output_dir, "metrics.jsonl"), "w").close()
        self.accelerator.wait_for_everyone()
        return {}

    def save_model(self, model, tokenizer):
        """The final model as output_dir/final (from_pretrained-loadable); returns its path, or None
        when saving is off."""
        if not self.enabled:
            return None
        path = os.path.join(self.output_dir, "final")
        save_pretrained_atomic(self.accelerator, model, tokenizer, path)
        return path

    def save(self, step, trainer_state):
        if not self.enabled:
            return None
        return save_checkpoint(self.accelerator, self.output_dir, step, trainer_state, self.save_total_limit)

    def after_step(self, done, max_steps, trainer_state) -> int:
        """Save if it is time; on a signal save and return its number (the caller exits)."""
        if self.save_steps and done % self.save_steps == 0 and done < max_steps:
            self.save(done, trainer_state)
        signum = self.stop.requested(self.accelerator)
        if signum:
            path = self.save(done, trainer_state)
            if self.accelerator.is_main_process:
                print(f"\nreceived signal {signum}: " + (f"saved {path}; resume with --resume_from_checkpoint latest"
                                                        if path else "nothing saved (--save_strategy no)"), flush=True)
        return signum
