"""Both scripts under the engines of accelerate_configs/ on the CPU: DeepSpeed ZeRO-2 / ZeRO-3 (and
ZeRO-3 with offload) in one process give the same losses, gradient norms and final weights as a
plain run, save a from_pretrained-loadable model, and resume exactly; flags an engine cannot
honour fail before any model loads. On two CPU processes every engine config (ZeRO-2, ZeRO-3,
ZeRO-3 offload, FSDP2) matches DDP on the same two processes, and FSDP2 resumes exactly from its
sharded checkpoint. The same configs on GPUs: tests/gpu/test_gpu_engines.py."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, assert_same_weights, metrics_of, run_script

COMMON = ["--max_steps", "3", "--lr_scheduler_type", "linear", "--warmup_steps", "1", "--max_grad_norm", "0.5"]
SCRIPT_ARGS = {"train_grpo.py": ["--per_device_train_batch_size", "64"], "train_ppo.py": []}


def launch_engine(config, script, args, timeout=600):
    """accelerate launch with one of accelerate_configs/, one CPU process (the DeepSpeed engine runs;
    accelerate drops DeepSpeed when asked for several CPU processes, see the skipped test below)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"), "--num_processes", "1",
           "--mixed_precision", "no", os.path.join(ROOT, script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """Each script's plain single-process run of COMMON: the reference the engines must match."""
    out = {}
    for script, extra in SCRIPT_ARGS.items():
        path = tmp_path_factory.mktemp(script.split(".")[0])
        result = run_script(COMMON + extra + ["--output_dir", str(path)], script=script)
        assert result.returncode == 0, result.stderr[-3000:]
        out[script] = path
    return out


def _assert_same_run(plain, engine_dir):
    for a, b in zip(metrics_of(plain), metrics_of(engine_dir), strict=True):
        for key in a:
            if key.startswith(("loss/", "optim/", "reward/", "score/")):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    wa, wb = load_file(os.path.join(plain, "final", "model.safetensors")), \
        load_file(os.path.join(engine_dir, "final", "model.safetensors"))
    for name in wa:  # the engine may also write a tied head separately
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("script", list(SCRIPT_ARGS))
@pytest.mark.parametrize("config, extra", [
    ("deepspeed_zero2", []),
    ("deepspeed_zero3", []),
    ("deepspeed_zero3", ["--gather_for_generation", "false"]),
    ("deepspeed_zero3_offload", []),
], ids=["zero2", "zero3", "zero3-layerwise-generation", "zero3-offload"])
def test_deepspeed_one_process_matches_the_plain_run(plain_runs, tmp_path, script, config, extra):
    if script == "train_ppo.py" and extra:  # one generation variant is enough
        pytest.skip("covered by train_grpo.py")
    result = launch_engine(config, script, COMMON + SCRIPT_ARGS[script] + extra + ["--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "DeepSpeed" in result.stderr + result.stdout  # the engine really ran
    _assert_same_run(plain_runs[script], tmp_path)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # one loadable folder


def test_memory_levers_under_zero3_match_the_plain_run(tmp_path):
    """The chunked LM head (recomputed in backward, where ZeRO-3 gathers the head's weight again),
    checkpointing and an entropy bonus under ZeRO-3: the plain run's numbers."""
    levers = ["--logprob_chunk_size", "8", "--use_gradient_checkpointing", "--entropy_coef", "0.01"]
    args = COMMON + SCRIPT_ARGS["train_grpo.py"] + levers
    plain = run_script(args + ["--output_dir", str(tmp_path / "plain")])
    assert plain.returncode == 0, plain.stderr[-3000:]
    engine = launch_engine("deepspeed_zero3", "train_grpo.py", args + ["--output_dir", str(tmp_path / "zero3")])
    assert engine.returncode == 0, engine.stderr[-3000:]
    _assert_same_run(tmp_path / "plain", tmp_path / "zero3")


@pytest.mark.parametrize("script", list(SCRIPT_ARGS))
def test_lora_under_zero2_matches_the_plain_run(tmp_path, script):
    """LoRA under ZeRO-2 (whole replicas): the plain run's numbers, and the saved model has the
    trained adapter merged in."""
    args = COMMON + SCRIPT_ARGS[script] + ["--use_lora", "--learning_rate", "1e-3"]
    plain = run_script(args + ["--output_dir", str(tmp_path / "plain")], script=script)
    assert plain.returncode == 0, plain.stderr[-3000:]
    engine = launch_engine("deepspeed_zero2", script, args + ["--output_dir", str(tmp_path / "zero2")])
    assert engine.returncode == 0, engine.stderr[-3000:]
    _assert_same_run(tmp_path / "plain", tmp_path / "zero2")
    from utils import toy

    initial = toy.build_model(toy.build_tokenizer(), seed=42).state_dict()  # the scripts' default --seed
    merged = load_file(tmp_path / "zero2" / "final" / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])  # same start
    assert (merged[name] - initial[name]).abs().max() > 1e-6  # the adapter trained and was merged


def test_deepspeed_zero3_resumes_exactly(tmp_path):
    """PPO (two engines: actor, critic) under ZeRO-3, stopped after 2 steps and resumed to 3,
    ends with the same weights as 3 steps at once."""
    straight = launch_engine("deepspeed_zero3", "train_ppo.py", ["--max_steps", "3", "--output_dir",
                                                                 str(tmp_path / "a")])
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = launch_engine("deepspeed_zero3", "train_ppo.py", ["--max_steps", "2", "--output_dir", str(tmp_path / "b")])
    assert first.returncode == 0 and (tmp_path / "b" / "checkpoint-2" / "trainer_state.json").exists()
    resumed = launch_engine("deepspeed_zero3", "train_ppo.py", ["--max_steps", "3", "--output_dir",
                                                                str(tmp_path / "b"), "--resume_from_checkpoint",
                                                                "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(tmp_path / "a" / "final", tmp_path / "b" / "final")
    steps = [json.loads(line)["step"] for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert steps == [1, 2, 3]  # the resumed run appended the step it ran, nothing twice


ZERO3_HOOKS_SCRIPT = r'''
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
sys.path.insert(0, os.environ["ROOT"])
import deepspeed, torch
from utils import toy
from utils.engines import gathered_for_generation

def hook_count(module):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())

tokenizer = toy.build_tokenizer()
model = toy.build_model(tokenizer)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
before = hook_count(engine.module)
ids = torch.tensor([[5, 6, 7, 8]])
with gathered_for_generation("zero3", engine):
    inside = hook_count(engine.module)
    out = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
after = hook_count(engine.module)
loss = engine(input_ids=out, labels=out).loss  # training forward and backward work with the hooks back
engine.backward(loss); engine.step()
print("HOOKS", before, inside, after, float(loss))
'''


def test_zero3_generation_runs_without_deepspeed_hooks(tmp_path):
    """Under ZeRO-3, gathered_for_generation takes DeepSpeed's per-module hooks off for the rollout
    (with the weights gathered they only cost time, at every module of every decoding step) and
    puts them all back: the next training step runs. (On 2 CPU cores the toy model's generate phase
    went from 0.11 to 0.08 s per step, the plain run's time.)"""
    import re

    from helpers import free_port

    (tmp_path / "hooks.py").write_text(ZERO3_HOOKS_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PORT=str(free_port()), ROOT=ROOT)
    result = subprocess.run([sys.executable, str(tmp_path / "hooks.py")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    before, inside, after = map(int, re.search(r"HOOKS (\d+) (\d+) (\d+)", result.stdout).groups())
    assert before > 100 and inside < 5 and after == before, (before, inside, after)


@pytest.mark.parametrize("flags, engine, message", [
    (["--param_offload"], "zero3", "--param_offload under zero3"),
    (["--optimizer_offload"], "zero2", "--optimizer_offload under zero2"),
    (["--use_lora", "--load_in_4bit"], "zero2", "--load_in_4bit under zero2"),
    (["--use_lora"], "fsdp2", "--use_lora under fsdp2"),
    (["--optim", "adamw_8bit"], "zero2", "--optim adamw_8bit under zero2"),
    (["--torch_dtype", "bfloat16"], "fsdp2", "--torch_dtype bfloat16 under fsdp2"),
    (["--actor_device", "cuda:1"], "zero2", "--actor_device cuda:1 under zero2"),
    (["--ref_device", "cpu"], "zero3", "--ref_device cpu under zero3"),
    ([], "fsdp1", "FSDP version 1"),
    (["--generation_backend", "cudagraph"], "zero3", "--generation_backend cudagraph under zero3"),
    (["--generation_backend", "compiled"], "fsdp2", "--generation_backend compiled under fsdp2"),
    (["--generation_copy"], "zero3", "--generation_copy under zero3"),
    (["--torch_compile"], "fsdp2", "--torch_compile under fsdp2"),
])
def test_flags_an_engine_cannot_honour_fail_early(flags, engine, message):
    import train_grpo
    from utils.cli import UsageError, parse_args
    from utils.engines import check_engine_args

    args, _ = parse_args(train_grpo.Args, flags)
    with pytest.raises(UsageError, match=message):
        check_engine_args(args, engine)
    check_engine_args(args, "ddp")  # DDP takes them all


def test_the_scripts_refuse_before_loading_a_model(tmp_path):
    result = launch_engine("deepspeed_zero3", "train_ppo.py", ["--param_offload", "--output_dir", str(tmp_path)],
                           timeout=300)
    assert result.returncode != 0 and "error: --param_offload under zero3" in result.stderr, result.stderr[-2000:]
    assert "role " not in result.stdout and not (tmp_path / "metrics.jsonl").exists()  # no model was loaded


TWO_PROCESS_ARGS = ["--save_steps", "2", "--logprob_chunk_size", "8", "--use_gradient_checkpointing"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Each script under accelerate_configs/multi_gpu.yaml (DDP) on two CPU processes: the
    reference the engines must match with the same two processes."""
    from helpers import launch_two_cpu_processes

    out = {}
    for script, extra in SCRIPT_ARGS.items():
        path = tmp_path_factory.mktemp("ddp_" + script.split(".")[0])
        result = launch_two_cpu_processes(script, COMMON + extra + TWO_PROCESS_ARGS + ["--output_dir", str(path)],
                                          config="multi_gpu")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "num_processes=2" in result.stdout
        out[script] = path
    return out


# what each engine's save_state writes for the first model of a checkpoint
CHECKPOINT_OF = {"deepspeed_zero2": "pytorch_model", "deepspeed_zero3": "pytorch_model",
                 "deepspeed_zero3_offload": "pytorch_model", "fsdp2": "pytorch_model_fsdp_0"}


@pytest.mark.parametrize("script", list(SCRIPT_ARGS))
@pytest.mark.parametrize("config, extra", [
    ("deepspeed_zero2", []),
    ("deepspeed_zero3", []),
    ("deepspeed_zero3_offload", []),
    ("fsdp2", []),
    ("fsdp2", ["--gather_for_generation", "false"]),
], ids=["zero2", "zero3", "zero3-offload", "fsdp2", "fsdp2-layerwise-generation"])
def test_engines_on_two_cpu_processes_match_ddp(ddp_runs, tmp_path, script, config, extra):
    """Each engine config on two CPU processes (gloo; tests/engine_on_cpu.py keeps the engine that
    accelerate would drop on CPU) with the chunked LM head and checkpointing: the losses, gradient
    norms and final weights of DDP with the same two processes; the engine's own checkpoint format,
    sharded per process where the engine shards; one from_pretrained-loadable final folder. Under
    ZeRO-2 the script itself also checks that both ranks end with equal weights."""
    from helpers import launch_two_cpu_processes

    if script == "train_ppo.py" and extra:  # one generation variant is enough
        pytest.skip("covered by train_grpo.py")
    args = COMMON + SCRIPT_ARGS[script] + TWO_PROCESS_ARGS + extra
    result = launch_two_cpu_processes(script, args + ["--output_dir", str(tmp_path)], config=config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "num_processes=2" in result.stdout
    saved = tmp_path / "checkpoint-2" / CHECKPOINT_OF[config]
    assert saved.is_dir(), sorted(os.listdir(tmp_path / "checkpoint-2"))  # the engine's format: it really ran
    if config == "fsdp2":
        assert sorted(f for f in os.listdir(saved) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    _assert_same_run(ddp_runs[script], tmp_path)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "final")


def test_fsdp2_resumes_exactly(tmp_path):
    """PPO (actor and critic, both sharded) under FSDP2 on two CPU processes, stopped after 2 steps
    and resumed from the sharded checkpoint to 3: the weights of 3 steps at once."""
    from helpers import launch_two_cpu_processes

    args = ["--per_device_train_batch_size", "32"]
    straight = launch_two_cpu_processes("train_ppo.py", ["--max_steps", "3", *args, "--output_dir",
                                                         str(tmp_path / "a")], config="fsdp2")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = launch_two_cpu_processes("train_ppo.py", ["--max_steps", "2", *args, "--output_dir", str(tmp_path / "b")],
                                     config="fsdp2")
    assert first.returncode == 0 and (tmp_path / "b" / "checkpoint-2" / "pytorch_model_fsdp_1").is_dir()
    resumed = launch_two_cpu_processes("train_ppo.py", ["--max_steps", "3", *args, "--output_dir", str(tmp_path / "b"),
                                                        "--resume_from_checkpoint", "latest"], config="fsdp2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(tmp_path / "a" / "final", tmp_path / "b" / "final")
