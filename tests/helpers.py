"""Helpers shared by the test modules (imported as `helpers`; conftest.py only holds fixtures)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(args, timeout=600, env=None, script="train_grpo.py"):
    """Run a training script in a subprocess; returns CompletedProcess with text output."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def metrics_of(output_dir):
    """The rows of output_dir/metrics.jsonl."""
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_weights(a, b):
    """Two saved folders hold bit-identical model.safetensors."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# gloo's teardown at interpreter exit can abort a rank after all its work is done (1 launch in about 30 on
# the 2-core CI replica, 2026-11-30; not reproduced in isolation): such a launch is run once more
EXIT_ABORT = "terminate called without an active exception"


def free_port() -> int:
    """A TCP port nobody listens on now, so back-to-back launches never collide."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_cpu_processes(script, args, timeout=600, config=None):
    """The launch line that really starts two CPU processes (`accelerate launch --cpu` starts one). With
    `config` (a name in accelerate_configs/), that config's launch, its engine kept on the CPU
    processes by tests/engine_on_cpu.py (accelerate keeps DeepSpeed and FSDP for accelerators)."""
    import warnings

    for attempt in range(2):
        port = free_port()
        env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="true", PYTHONUNBUFFERED="1")
        if config is None:
            launch = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                      "--dynamo_backend", "no", "--main_process_port", str(port)]
        else:
            launch = ["--config_file", os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"), "--num_processes",
                      "2", "--mixed_precision", "no", "--main_process_port", str(port),
                      os.path.join(ROOT, "tests", "engine_on_cpu.py")]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, os.path.join(ROOT, script), *args]
        result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if result.returncode == 0 or EXIT_ABORT not in result.stderr or attempt == 1:
            return result
        warnings.warn(f"{script}: a rank aborted at exit ({EXIT_ABORT}); launching once more")


def sigterm_then_resume(script, common, tmp_path):
    """Run `common` uninterrupted, and again stopped by SIGTERM after its second logged step then
    resumed with `latest`. Returns (full_dir, stopped_dir, step the stop saved at)."""
    import re
    import signal

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    path = os.path.join(ROOT, script)
    full = subprocess.run([sys.executable, path, *common, "--output_dir", str(tmp_path / "full")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, path, *common, "--output_dir", str(stopped)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:  # wait for the second step to finish, then stop the run
        if line.startswith("step 2 "):
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=300) == 128 + signal.SIGTERM
    match = re.search(r"saved (\S+checkpoint-(\d+)); resume with --resume_from_checkpoint latest", rest)
    assert match, rest[-2000:]
    assert os.path.isfile(os.path.join(match.group(1), "trainer_state.json"))
    assert not (stopped / "final").exists()
    resumed = subprocess.run([sys.executable, path, *common, "--output_dir", str(stopped),
                              "--resume_from_checkpoint", "latest"], env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return tmp_path / "full", stopped, int(match.group(2)), resumed.stdout


def one_row_batched_products(model_dir, device):
    """The shapes of every one-row batched product (aten::bmm of [rows, 1, hidden] by a weight broadcast over
    the rows: how F.linear multiplies an input it cannot fold into one matrix) in a greedy rollout of `model_dir`
    loaded as QLoRA (bitsandbytes NF4, r16 adapters, bf16 autocast on a GPU as the scripts run it) through the
    compiled decoding step, under torch.profiler; and whether bitsandbytes' 4-bit product ran at all (its op is
    gemm_4bit or gemv_4bit: on one 2-core AMD EPYC CPU, 2026-12-07, bitsandbytes 0.50.2 ran gemv_4bit for the same
    rollout where the machine of the day before had run gemm_4bit)."""
    from types import SimpleNamespace

    import torch
    from torch.profiler import ProfilerActivity, profile

    from utils.generation import static_cache_generate
    from utils.modeling import apply_lora, load_causal_lm

    model = load_causal_lm(model_dir, SimpleNamespace(pad_token_id=None), torch.bfloat16, quantization="4bit",
                           device=device)
    model = apply_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    if device != "cpu":
        model.forward = torch.autocast(device, dtype=torch.bfloat16)(model.forward)
    torch.manual_seed(0)
    ids = torch.randint(5, 40, (8, 12), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with torch.no_grad(), profile(activities=activities, record_shapes=True) as prof:
        static_cache_generate(model, ids, torch.ones_like(ids), 4, 1.0, 1.0, 0, [10**9], model.config.pad_token_id,
                              step_mode="compiled", greedy=True)
    events = prof.events()
    return ([e.input_shapes for e in events if e.name == "aten::bmm" and e.input_shapes
             and e.input_shapes[0][1:] == [1, model.config.hidden_size]],
            any("gemm_4bit" in e.name or "gemv_4bit" in e.name for e in events))
