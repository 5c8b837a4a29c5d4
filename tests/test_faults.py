"""Fault injection on the CPU: kill -9 at seeded random points and inside the save, damaged and
missing checkpoint files of every kind, a full disk, a permission error, user code that fails
mid-step, early and repeated signals, SIGTERM to a two-process launcher. Each asserts what the
README's "Outputs, saving, resuming" promises: no traceback for what is not the user's code, the
newest complete checkpoint found, a resume bitwise equal to an uninterrupted run, every metrics
step once. The uninterrupted reference runs are shared (module-scoped)."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, assert_same_weights, free_port, metrics_of, run_script

GRPO = ["--max_steps", "6", "--save_steps", "2", "--debug"]  # toy task, checkpoints 2, 4, 6 (2 kept)
PPO = ["--max_steps", "4", "--save_steps", "2", "--target_kl", "0.5", "--debug"]  # kl_coef moves
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def grpo_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_reference")
    result = run_script([*GRPO, "--output_dir", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def ppo_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_reference")
    result = run_script([*PPO, "--output_dir", str(out)], script="train_ppo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def start(args, out, script="train_grpo.py", env=None):
    """The script in the background; its stdout (the --debug step lines) is read as it runs."""
    stderr = open(str(out) + ".stderr", "w")
    return subprocess.Popen([sys.executable, os.path.join(ROOT, script), *args, "--output_dir", str(out)], cwd=ROOT,
                            env=dict(ENV, **(env or {})), stdout=subprocess.PIPE, stderr=stderr, text=True)


def wait_for_step(proc, step):
    for line in proc.stdout:
        if line.startswith(f"step {step} "):
            return
    raise AssertionError(f"the run ended before step {step}")


def finish(proc, out):
    stdout = proc.stdout.read()
    code = proc.wait(timeout=300)
    with open(str(out) + ".stderr") as f:
        return code, stdout, f.read()


def newest_with_manifest(out):
    """The checkpoint a resume must pick: the newest folder whose manifest (written last) is there."""
    steps = [int(m.group(1)) for name in os.listdir(out) if (m := re.fullmatch(r"checkpoint-(\d+)", name))
             and os.path.isfile(os.path.join(out, name, "manifest.json"))]
    return max(steps, default=0)


def assert_resumes_exactly(reference, out, script="train_grpo.py", args=GRPO, keys=("reward/mean",), env=None,
                           expected_start=None):
    """Resume `out` with `latest`: from the newest complete checkpoint, to the reference's weights,
    every metrics step once with the reference's values."""
    expected_start = newest_with_manifest(out) if expected_start is None else expected_start
    steps = int(args[args.index("--max_steps") + 1])
    resumed = run_script([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"], script=script,
                         env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert f"steps {expected_start}->{steps}" in resumed.stdout
    assert_same_weights(reference / "final", out / "final")
    rows, reference_rows = metrics_of(out), metrics_of(reference)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in keys:
        assert [r[key] for r in rows] == [r[key] for r in reference_rows], key
    return resumed


# ---- kill -9 -------------------------------------------------------------------------------------------

_rng = random.Random(21)
RANDOM_KILLS = [(_rng.randint(1, 5), round(_rng.uniform(0.0, 0.3), 3)) for _ in range(2)]  # (after step, delay s)


def test_kill_9_at_random_points_then_resume_is_exact(grpo_reference, tmp_path):
    """Killed at a seeded point, resumed and killed again at another, then resumed to the end; with
    TensorBoard, which must hold each step once too."""
    import time

    out, args = tmp_path / "run", [*GRPO, "--report_to", "tensorboard"]
    for i, (after_step, delay) in enumerate(RANDOM_KILLS):
        resume = ["--resume_from_checkpoint", "latest"] if i and newest_with_manifest(out) else []
        proc = start([*args, *resume], out)
        wait_for_step(proc, after_step)
        time.sleep(delay)
        proc.kill()
        finish(proc, out)
    assert_resumes_exactly(grpo_reference, out, args=args)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "lean-rl-grpo"))  # every run's event file: the later ones purge
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, 7))


def test_kill_9_inside_the_save_then_resume_is_exact(grpo_reference, tmp_path):
    """Killed inside a save, resumed and killed inside the next, ..., then resumed to the end."""
    out = tmp_path / "run"
    leftovers = []
    for i, (point, step, newest) in enumerate([
        ("state_written", 4, 2),  # accelerate's files written, no manifest: the .tmp folder is never trusted
        ("manifest_written", 4, 2),  # complete but not renamed into place
        ("renamed", 4, 4),  # in place, older ones not pruned yet
        ("pruning", 6, 6),  # checkpoint-2 renamed away, not yet deleted
    ]):
        resume = ["--resume_from_checkpoint", "latest"] if i else []
        code, stdout, stderr = finish(start([*GRPO, *resume], out, env={"LEAN_RL_KILL_AT": f"{point}:{step}"}), out)
        assert code == -signal.SIGKILL and "Traceback" not in stderr, stderr[-3000:]
        if leftovers:  # left by the previous kill, removed when this run started
            assert f"removed {', '.join(leftovers)}" in stdout
        assert newest_with_manifest(out) == newest, point
        leftovers = sorted(n for n in os.listdir(out) if n.endswith((".tmp", ".deleting")))
    assert leftovers == ["checkpoint-2.deleting"]
    resumed = assert_resumes_exactly(grpo_reference, out)
    assert "removed checkpoint-2.deleting" in resumed.stdout
    assert not [n for n in os.listdir(out) if n.endswith((".tmp", ".deleting"))]


def test_kill_9_ppo_restores_kl_coef_and_both_models(ppo_reference, tmp_path):
    out = tmp_path / "run"
    proc = start(PPO, out, script="train_ppo.py")
    wait_for_step(proc, 3)
    proc.kill()
    finish(proc, out)
    assert_resumes_exactly(ppo_reference, out, script="train_ppo.py", args=PPO,
                           keys=("reward/mean", "policy/kl_coef", "loss/value"))


# ---- damaged and missing checkpoint files --------------------------------------------------------------

FILES = ["model.safetensors", "optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "trainer_state.json",
         "manifest.json"]


def damage(path, how):
    size = os.path.getsize(path)
    if how == "deleted":
        os.remove(path)
    elif how == "emptied":
        open(path, "w").close()
    elif how == "truncated":
        os.truncate(path, size // 2)
    elif how == "flipped":  # one bit in the middle: same size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("how", ["truncated", "emptied", "deleted", "flipped"])
@pytest.mark.parametrize("name", FILES)
def test_every_damaged_file_is_named_in_one_line(grpo_reference, tmp_path, name, how):
    from utils.checkpoint import CheckpointError, verify_checkpoint

    path = tmp_path / "checkpoint-4"
    shutil.copytree(grpo_reference / "checkpoint-4", path)
    verify_checkpoint(str(path), 1)
    damage(path / name, how)
    with pytest.raises(CheckpointError) as error:
        verify_checkpoint(str(path), 1)
    line = str(error.value)
    assert "\n" not in line
    if name != "manifest.json" or how != "flipped":  # a flipped manifest may name the entry it no longer matches
        assert name in line, line


@pytest.mark.parametrize("how,name,expected", [
    (None, None, None),
    ("truncated", "random_states_0.pkl", "not a complete torch.save archive"),
    ("flipped", "optimizer.bin", "fails its CRC|not a complete torch.save archive"),
    ("truncated", "model.safetensors", "truncated"),
    ("deleted", "optimizer.bin", "0 optimizer"),
    ("deleted", "custom_checkpoint_0.pkl", "0 scheduler"),
    ("deleted", "random_states_0.pkl", "random_states_0.pkl is missing"),
    ("emptied", "trainer_state.json", "not valid JSON"),
])
def test_checkpoints_without_a_manifest_are_checked_by_their_structure(grpo_reference, tmp_path, how, name, expected):
    """As saved before manifests existed: no manifest.json, trainer_state.json without the marker."""
    from utils.checkpoint import CheckpointError, verify_checkpoint

    path = tmp_path / "checkpoint-4"
    shutil.copytree(grpo_reference / "checkpoint-4", path)
    os.remove(path / "manifest.json")
    (path / "trainer_state.json").write_text(json.dumps({"total_skipped": 0, "step": 4}, indent=2))
    if how is None:
        verify_checkpoint(str(path), 1)
        with pytest.raises(CheckpointError, match=r"random_states_1.pkl is missing \(rank 1's RNG states"):
            verify_checkpoint(str(path), 2)
        return
    damage(path / name, how)
    with pytest.raises(CheckpointError, match=expected):
        verify_checkpoint(str(path), 1)


def test_a_checkpoint_without_a_manifest_resumes_exactly(grpo_reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(grpo_reference / "checkpoint-4", out / "checkpoint-4")
    os.remove(out / "checkpoint-4" / "manifest.json")
    (out / "checkpoint-4" / "trainer_state.json").write_text(json.dumps({"total_skipped": 0, "step": 4}))
    resumed = run_script([*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-4")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "has no manifest.json (saved by an earlier version): its files were checked by their structure" \
        in resumed.stderr
    assert_same_weights(grpo_reference / "final", out / "final")


def test_damaged_latest_is_skipped_and_a_named_one_stops_the_run(grpo_reference, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(grpo_reference, out, ignore=shutil.ignore_patterns("final"))
    damage(out / "checkpoint-6" / "random_states_0.pkl", "flipped")  # trusted silently before manifests
    named = run_script([*GRPO, "--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-6")])
    assert named.returncode == 2 and "Traceback" not in named.stderr, named.stderr[-3000:]
    error = [line for line in named.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "checkpoint-6/random_states_0.pkl: bytes 0-" in error[0], named.stderr[-2000:]
    assert "checkpoint-4" in error[0]  # the complete one it could use instead
    assert "num_processes=" not in named.stdout  # stopped before any model loaded
    resumed = assert_resumes_exactly(grpo_reference, out, expected_start=4)
    assert "warning: skipping a damaged checkpoint: " in resumed.stderr and "random_states_0.pkl" in resumed.stderr


def test_resume_with_another_seed_or_script_is_refused(grpo_reference, tmp_path):
    result = run_script([*GRPO, "--seed", "7", "--output_dir", str(tmp_path / "run"),
                         "--resume_from_checkpoint", str(grpo_reference / "checkpoint-4")])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "saved with seed 42 and this run has 7" in result.stderr
    import torch
    from accelerate import Accelerator

    from utils import toy
    from utils.checkpoint import CheckpointError, load_checkpoint

    accelerator = Accelerator(cpu=True)  # PPO's layout: two trained models
    models = [toy.build_model(toy.build_tokenizer()) for _ in range(2)]
    accelerator.prepare(*models, *[torch.optim.AdamW(m.parameters()) for m in models])
    with pytest.raises(CheckpointError, match="it holds 1 models, 1 optimizers, 0 schedulers, 1 custom_objects and "
                                              "this run has 2 models, 2 optimizers, 0 schedulers, 0 custom_objects"):
        load_checkpoint(accelerator, str(grpo_reference / "checkpoint-4"))


def test_metrics_are_strict_json_and_a_resume_drops_the_rows_past_its_step(tmp_path, capsys):
    from accelerate import Accelerator

    from utils.logger import MetricsLogger

    accelerator = Accelerator(cpu=True)
    logger = MetricsLogger(accelerator, str(tmp_path), "none", "run", {})
    for step in (1, 2, 3):
        logger.log({"reward/mean": float("nan") if step == 2 else 0.5, "optim/grad_norm": float("inf")}, step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # cut short by a kill -9

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line, parse_constant=refuse) for line in f if line.endswith("}\n")]
    assert rows[1] == {"step": 2, "reward/mean": None, "optim/grad_norm": None}
    MetricsLogger(accelerator, str(tmp_path), "none", "run", {}, start_step=2)  # resumed from checkpoint-2
    assert [r["step"] for r in metrics_of(tmp_path)] == [1, 2]
    os.remove(tmp_path / "metrics.jsonl")
    os.mkdir(tmp_path / "metrics.jsonl")  # a write that fails (here: EISDIR)
    with pytest.raises(SystemExit) as stop:
        MetricsLogger(accelerator, str(tmp_path), "none", "run", {})
    assert stop.value.code == 1
    assert f"error: could not write {tmp_path / 'metrics.jsonl'}: [Errno 21] Is a directory" in capsys.readouterr().err


# ---- a full disk, a permission error -------------------------------------------------------------------


def _mount_small_disk(path, size):
    """A tmpfs of `size` at `path` where this machine lets the tests mount one (root), else None."""
    os.makedirs(path)
    if shutil.which("mount") is None:
        return None
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return path if done.returncode == 0 else None


def test_disk_full_while_saving(grpo_reference, tmp_path):
    disk = _mount_small_disk(tmp_path / "disk", "2600k")  # room for checkpoint-2 (1.6 MB), not checkpoint-4 too
    try:
        out = (disk or tmp_path / "disk") / "run"
        env = None if disk else {"LEAN_RL_FAKE_SAVE_ERROR": "28:4"}  # no tmpfs here: ENOSPC injected
        result = run_script([*GRPO, "--output_dir", str(out)], env=env)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
        error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(error) == 1, result.stderr[-3000:]
        assert re.search(r"could not save checkpoint-4: \[Errno 28 ENOSPC\] No space left on device.*: "
                         + re.escape(str(out / "checkpoint-4.tmp")), error[0]), error[0]
        assert "checkpoint-2, is untouched" in error[0]
        assert sorted(os.listdir(out)) == ["checkpoint-2", "metrics.jsonl"]  # the .tmp folder removed
        resumed = run_script([*GRPO, "--output_dir", str(tmp_path / "elsewhere"),
                              "--resume_from_checkpoint", str(out / "checkpoint-2")])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert_same_weights(grpo_reference / "final", tmp_path / "elsewhere" / "final")
    finally:
        if disk:
            subprocess.run(["umount", str(disk)])


def test_permission_error_while_saving(tmp_path):
    out = tmp_path / "run"
    result = run_script(["--max_steps", "4", "--save_steps", "2", "--output_dir", str(out)],
                        env={"LEAN_RL_FAKE_SAVE_ERROR": "13:4"})  # root writes anywhere: injected
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "[Errno 13 EACCES] Permission denied" in error[0], result.stderr[-3000:]
    assert str(out / "checkpoint-4.tmp" / "optimizer.bin") in error[0]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "metrics.jsonl"]


# ---- user code that fails mid-step ---------------------------------------------------------------------

FLAKY = '''
import os

from utils.rewards import accuracy

calls = 0


def flaky(completions, **columns):
    global calls
    calls += 1
    if calls == int(os.environ.get("FLAKY_FAILS_AT_CALL", "0")) and os.environ.get("RANK", "0") == os.environ.get(
            "FLAKY_FAILS_ON_RANK", os.environ.get("RANK", "0")):
        1 / 0  # the scripts report it (utils/rewards.py) as this function failing at this step
    return accuracy(completions, **columns)
'''


def test_failing_reward_saves_the_last_finished_step_and_resumes_exactly(grpo_reference, tmp_path):
    (tmp_path / "flaky.py").write_text(FLAKY)
    args = ["--max_steps", "6", "--save_steps", "0", "--debug", "--reward_funcs", f"{tmp_path / 'flaky.py'}:flaky"]
    out = tmp_path / "run"
    failed = run_script([*args, "--output_dir", str(out)], env={"FLAKY_FAILS_AT_CALL": "3"})
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "ZeroDivisionError" in failed.stderr  # the user's own traceback is kept
    assert "error: reward function 'flaky' at step 3 raised ZeroDivisionError: division by zero\n" in failed.stderr
    assert (f"\nstep 3 failed in user code (rank 0); saved {out / 'checkpoint-2'}, the state after step 2: fix the "
            f"code, then resume with --resume_from_checkpoint {out / 'checkpoint-2'}\n") in failed.stderr
    # generation in step 3 had moved the RNGs on: the checkpoint holds them as step 2 left them
    resumed = run_script([*args, "--output_dir", str(out), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "steps 2->6" in resumed.stdout
    assert_same_weights(grpo_reference / "final", out / "final")
    assert [r["reward/mean"] for r in metrics_of(out)] == [r["reward/mean"] for r in metrics_of(grpo_reference)]

    off = run_script([*args, "--save_on_error", "false", "--output_dir", str(tmp_path / "off")],
                     env={"FLAKY_FAILS_AT_CALL": "1"})
    assert off.returncode == 1 and "nothing saved (--save_on_error false)" in off.stderr, off.stderr[-3000:]
    assert not [n for n in os.listdir(tmp_path / "off") if n.startswith("checkpoint-")]


# ---- signals -------------------------------------------------------------------------------------------


def test_sigterm_during_setup_stops_unsaved_with_exit_1(tmp_path):
    import time

    proc = start(["--max_steps", "3"], tmp_path / "run")
    time.sleep(1.0)  # importing torch: long before the models load
    proc.send_signal(signal.SIGTERM)
    code, _, stderr = finish(proc, tmp_path / "run")
    assert code == 1, stderr[-3000:]  # not 128 + 15, which means "saved"
    assert "Traceback" not in stderr
    assert "received signal 15 during setup, before any step: stopped, nothing trained, nothing saved" in stderr


def test_a_second_signal_stops_at_once_unsaved(tmp_path):
    out = tmp_path / "run"
    import time

    proc = start(["--max_steps", "30", "--save_steps", "0", "--prompts_per_step", "128", "--debug"], out)  # 0.6 s steps
    wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    while "finishing this step" not in open(str(out) + ".stderr").read():  # one handled (two at once are one)
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code, _, stderr = finish(proc, out)
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "received signal 15 again: stopped at once, the current step is not saved (exit code 1)" in stderr
    assert newest_with_manifest(out) == 0


def test_sigterm_to_the_launcher_of_two_processes_saves_every_rank(tmp_path):
    args = ["--max_steps", "4", "--save_steps", "0", "--debug"]
    env = dict(ENV, ACCELERATE_USE_CPU="true")

    def launch(out, *extra):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), os.path.join(ROOT, "train_grpo.py"), *args, *extra,
               "--output_dir", str(out)]
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(str(out) + ".stderr", "w"),
                                text=True)

    full = launch(tmp_path / "full")
    code, _, stderr = finish(full, tmp_path / "full")
    assert code == 0, stderr[-3000:]
    stopped = launch(tmp_path / "stopped")
    wait_for_step(stopped, 2)
    stopped.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(stopped, tmp_path / "stopped")
    match = re.search(r"received signal 15: saved (\S+checkpoint-(\d+)); resume with --resume_from_checkpoint latest; "
                      r"every process exits 143 \(under accelerate launch, the launcher itself then exits 1", stdout)
    assert match, stdout[-3000:] + stderr[-3000:]
    assert code == 1 and stderr.count("Traceback") == 1 and "SignalException" in stderr  # torch's launcher, not ours
    manifest = json.loads(open(os.path.join(match.group(1), "manifest.json")).read())
    assert manifest["num_processes"] == 2 and {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"])
    resumed = launch(tmp_path / "stopped", "--resume_from_checkpoint", "latest")
    code, stdout, stderr = finish(resumed, tmp_path / "stopped")
    assert code == 0, stderr[-3000:]
    assert f"steps {match.group(2)}->4" in stdout
    assert_same_weights(tmp_path / "full" / "final", tmp_path / "stopped" / "final")
    assert [r["step"] for r in metrics_of(tmp_path / "stopped")] == list(range(1, 5))


def test_a_reward_failing_on_one_of_two_processes_saves_every_rank(tmp_path):
    """Rank 1's reward fails in step 3; rank 0's does not: both stop, checkpoint-2 holds both ranks."""
    (tmp_path / "flaky.py").write_text(FLAKY)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           os.path.join(ROOT, "train_grpo.py"), "--max_steps", "4", "--save_steps", "0",
           "--reward_funcs", f"{tmp_path / 'flaky.py'}:flaky", "--output_dir", str(out)]
    env = dict(ENV, ACCELERATE_USE_CPU="true", FLAKY_FAILS_AT_CALL="3", FLAKY_FAILS_ON_RANK="1")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "[rank 1] error: reward function 'flaky' at step 3 raised ZeroDivisionError" in result.stderr, result.stderr[-3000:]
    assert f"step 3 failed in user code (rank 1); saved {out / 'checkpoint-2'}" in result.stderr
    manifest = json.loads((out / "checkpoint-2" / "manifest.json").read_text())
    assert manifest["num_processes"] == 2 and {"random_states_0.pkl", "random_states_1.pkl"} <= set(manifest["files"])
