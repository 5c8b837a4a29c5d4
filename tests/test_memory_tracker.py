"""The per-role memory tracker (utils/memory.py): byte counts against hand counts, the table and
report files, and the flags in both scripts."""
import json

import pytest
import torch

from helpers import metrics_of
from utils import toy
from utils.memory import MemoryTracker, human_bytes, role_memory


def test_role_memory_counts_weights_gradients_and_optimizer_state():
    model = toy.build_model(toy.build_tokenizer())
    params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    tensors = len(list(model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = role_memory(model, optimizer)
    assert before["weights_cpu"] == params * 4 and before["gradients_cpu"] == params * 4
    assert before["optimizer_cpu"] == 0 and before["weights_gpu"] == 0
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    # two fp32 moments per weight, and AdamW's step counter: one fp32 scalar per tensor
    assert role_memory(model, optimizer)["optimizer_cpu"] == params * 8 + tensors * 4
    model.requires_grad_(False)
    assert role_memory(model)["gradients_cpu"] == 0  # a frozen role has no gradients


def test_tracker_table_and_report(tmp_path):
    model = toy.build_model(toy.build_tokenizer())
    tracker = MemoryTracker({"actor": (model, None)}, every=2, report_dir=str(tmp_path))
    fake = {"memory/generate/peak_allocated_gib": 1.5, "memory/generate/peak_reserved_gib": 2.0,
            "memory/actor_update/peak_allocated_gib": 3.0, "memory/actor_update/peak_reserved_gib": 3.5,
            "time/generate": 0.1}
    assert tracker.after_step(1, fake) is None  # every 2 steps
    table = tracker.after_step(2, fake)
    assert "actor" in table and "generate 1.50/2.00" in table and "actor_update 3.00/3.50" in table
    paths = tracker.write()
    data = json.load(open(paths[0]))
    assert [row["step"] for row in data["timeline"]] == [1, 2]
    assert data["timeline"][1]["actor_update"] == {"allocated": 3.0, "reserved": 3.5}
    for png in paths[1:]:
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert not MemoryTracker({"actor": (model, None)}).enabled
    assert human_bytes(3 * 1024**3) == "3.00 GiB" and human_bytes(2048) == "2.00 KiB"


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_scripts_write_the_memory_report(run, tmp_path, script):
    result = run(["--max_steps", "2", "--log_memory_every", "1", "--memory_report", str(tmp_path / "report"),
                  "--output_dir", str(tmp_path / "out"), "--save_strategy", "no"], script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("weights GPU") == 3  # steps 1, 2 and the end
    assert (tmp_path / "report" / "memory_breakdown.png").exists()
    assert len(json.load(open(tmp_path / "report" / "memory.json"))["timeline"]) == len(metrics_of(tmp_path / "out"))


def test_memory_snapshot_needs_a_gpu(run, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU error")
    result = run(["--memory_snapshot", str(tmp_path / "s.pickle"), "--output_dir", str(tmp_path)])
    assert result.returncode == 2 and "--memory_snapshot records the CUDA allocator" in result.stderr


def test_phase_profile_table_counts_each_op_in_the_phase_it_started_in():
    """phase_profile_table against hand sums over constructed events: kernels (GPU) counted by their elapsed time in
    the phase whose range holds their start, CPU ops by self time where no kernel ran, the largest first."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from utils.memory import phase_profile_table

    def event(name, start, end, device=DeviceType.CPU, self_cpu=0.0, annotation=False):
        return SimpleNamespace(name=name, time_range=Interval(start, end), device_type=device,
                               self_cpu_time_total=self_cpu, is_user_annotation=annotation)

    phases = [event("phase/generate", 0, 10_000), event("phase/actor_update", 10_000, 30_000),
              # the ranges as the GPU's timeline shows them (H200 trace): neither a phase again nor a kernel
              event("phase/generate", 20, 9_990, DeviceType.CUDA, annotation=True),
              event("phase/actor_update", 10_020, 29_000, DeviceType.CUDA, annotation=True),
              event("## forward ##", 12_000, 13_000, DeviceType.CUDA, annotation=True)]
    kernels = [event("gemm", 100, 2_100, DeviceType.CUDA), event("gemm", 3_000, 4_000, DeviceType.CUDA),
               event("softmax", 5_000, 5_500, DeviceType.CUDA), event("gemm", 12_000, 20_000, DeviceType.CUDA),
               event("adam", 29_000, 31_000, DeviceType.CUDA)]  # starts in the update, ends after it
    cpu_ops = [event("aten::mm", 50, 9_000, self_cpu=7_000.0)]  # not counted: kernels ran
    table = phase_profile_table(phases + kernels + cpu_ops, top=5)
    generate, update = table.split("  actor_update:")
    assert table.count("  generate:") == 1 and "phase/" not in table and "forward" not in table
    assert "GPU time" in table and "aten::mm" not in table
    assert "generate: 3.5 ms of GPU time in 2 kernels, 10.0 ms of wall time" in generate
    assert generate.index("3.00 ms  85.7%  gemm") < generate.index("0.50 ms  14.3%  softmax")
    assert " 10.0 ms of GPU time in 2 kernels, 20.0 ms of wall time" in update
    assert "8.00 ms  80.0%  gemm" in update and "2.00 ms  20.0%  adam" in update
    cpu = phase_profile_table(phases + cpu_ops + [event("aten::add", 15_000, 16_000, self_cpu=400.0)], top=5)
    assert "generate: 7.0 ms of CPU time in 1 ops" in cpu and "0.40 ms 100.0%  aten::add" in cpu


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_profile_step_writes_a_trace_with_the_phases_and_prints_their_top_ops(run, tmp_path, script):
    """--profile_step 2: a trace of step 2 only (each phase a `phase/<name>` range) and a table per phase."""
    result = run(["--max_steps", "2", "--profile_step", "2", "--output_dir", str(tmp_path), "--save_strategy", "no"],
                 script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    trace = json.load(open(tmp_path / "profile_step2.json"))
    names = {e.get("name") for e in trace["traceEvents"]}
    phases = ["generate", "ref", "actor_update"] + (["critic_update"] if script == "train_ppo.py" else [])
    assert {f"phase/{p}" for p in phases} <= names
    assert result.stdout.count("profile: CPU time per phase") == 1
    for p in phases:
        assert f"\n  {p}: " in result.stdout
    assert "aten::mm" in result.stdout  # the matmuls are among the top ops of some phase


@pytest.mark.parametrize("flag", ["--profile_step", "--memory_snapshot_step"])
@pytest.mark.parametrize("value", ["0", "3"])
def test_a_profiled_or_snapshot_step_outside_the_run_is_refused_before_loading(run, tmp_path, flag, value):
    result = run(["--max_steps", "2", flag, value, "--output_dir", str(tmp_path)])
    assert result.returncode == 2 and f"{flag} {value}: a step of this run, 1 to --max_steps (2)" in result.stderr
    assert "rewards:" not in result.stdout  # the banner printed once the models are loaded


@pytest.mark.parametrize("script, phase", [("train_grpo.py", "actor_update"), ("train_grpo.py", "generate"),
                                           ("train_ppo.py", "critic_update"), ("train_ppo.py", "ref")])
def test_out_of_memory_is_explained_and_the_checkpoint_survives(run, tmp_path, script, phase):
    """An OOM injected in a phase of step 2 (LEAN_RL_FAKE_OOM_PHASE=phase@2): the run exits
    non-zero with the report (phase, step, roles, flags that would help), checkpoint-1 is intact
    and the run resumes from it to the end."""
    out = tmp_path / "out"
    common = ["--max_steps", "3", "--save_steps", "1", "--output_dir", str(out)]
    result = run(common, script=script, env={"LEAN_RL_FAKE_OOM_PHASE": f"{phase}@2"})
    assert result.returncode == 1
    assert f"OUT OF MEMORY in phase '{phase}' of step 2" in result.stderr
    assert "where the memory is, per role" in result.stderr and "saves ~" in result.stderr
    assert "resume with --resume_from_checkpoint latest" in result.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    resumed = run(common + ["--resume_from_checkpoint", "latest"], script=script)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row["step"] for row in metrics_of(out)] == [1, 2, 3]


@pytest.mark.parametrize("script, extra, sizes", [
    ("train_grpo.py", [], ["--per_device_train_batch_size", "32", "--generation_slice_size", "32"]),
    ("train_grpo.py", ["--beta", "0"], ["--per_device_train_batch_size", "32", "--generation_slice_size", "32"]),
    ("train_ppo.py", [], ["--per_device_train_batch_size", "16", "--generation_slice_size", "16"]),
])
def test_auto_reduce_micro_batch_redoes_passes_exactly(run, tmp_path, script, extra, sizes):
    """Every forward over more than 40 (GRPO) / 20 (PPO) rows runs out of memory (injected). With
    --auto_reduce_micro_batch the generation batch and the micro-batch halve until they fit (with
    --beta 0 the first OOM is in the update itself), and the run's losses and gradient norms equal
    those of a run started at the sizes it shrank to."""
    limit = "40" if script == "train_grpo.py" else "20"
    common = ["--max_steps", "2", "--save_strategy", "no"] + extra
    shrunk = run(common + ["--auto_reduce_micro_batch", "--output_dir", str(tmp_path / "shrunk")], script=script,
                 env={"LEAN_RL_FAKE_OOM_ROWS": limit})
    assert shrunk.returncode == 0, shrunk.stderr[-3000:]
    assert "out of memory in generate: retrying with --generation_slice_size" in shrunk.stderr
    first_oom_pass = "actor_update" if extra else ("ref" if script == "train_grpo.py" else "old_logprobs")
    assert f"out of memory in {first_oom_pass}: retrying with --per_device_train_batch_size" in shrunk.stderr
    plain = run(common + sizes + ["--output_dir", str(tmp_path / "plain")], script=script)
    assert plain.returncode == 0, plain.stderr[-3000:]
    rows_shrunk, rows_plain = metrics_of(tmp_path / "shrunk"), metrics_of(tmp_path / "plain")
    assert rows_shrunk[-1]["memory/auto_reductions"] > 0
    for a, b in zip(rows_shrunk, rows_plain):
        for key in ("loss/policy", "optim/grad_norm", "reward/mean"):
            assert a[key] == b[key], key


def test_shrinker_zeroes_partial_gradients_before_the_retry():
    """An OOM after some micro-batches already added their gradients: the retry starts from zero."""
    from types import SimpleNamespace

    from utils.memory import MicroBatchShrinker

    weight = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    args = SimpleNamespace(per_device_train_batch_size=4, use_dynamic_bsz=False, generation_slice_size=None,
                           max_prompt_length=4, max_completion_length=4)
    data = torch.arange(8.0)

    def accumulate():
        size = args.per_device_train_batch_size
        for start in range(0, 8, size):
            if start > 0 and size > 2:
                raise torch.OutOfMemoryError("second micro-batch too big")
            (weight * data[start:start + size].sum()).sum().backward()
        return weight.grad.clone()

    shrink = MicroBatchShrinker(args, True, rows=8)
    grad = shrink.retry(accumulate, "actor_update", optimizers=[optimizer])
    assert args.per_device_train_batch_size == 2 and shrink.reductions == 1
    assert torch.equal(grad, torch.full((3,), data.sum().item()))  # each sample counted once
    args.per_device_train_batch_size = 1
    with pytest.raises(torch.OutOfMemoryError):  # nothing left to halve: the error goes through
        MicroBatchShrinker(args, True, rows=8).retry(lambda: (_ for _ in ()).throw(torch.OutOfMemoryError()), "x")


def test_generation_out_of_memory_first_chunks_the_prefill_then_halves_the_slices():
    """A rollout that runs out of memory: with prompts longer than 64 positions the first retry
    prefills them 64 at a time (the slices stay), the next ones halve the slices; with short prompts
    the slices halve at once."""
    from types import SimpleNamespace

    from utils.memory import MicroBatchShrinker

    def rollout(fits):
        def fn():
            if not fits(args):
                raise torch.OutOfMemoryError("rollout too big")
            return args.prefill_chunk_size, args.generation_slice_size
        return fn

    args = SimpleNamespace(generation_slice_size=None, prefill_chunk_size=None, max_prompt_length=256)
    shrink = MicroBatchShrinker(args, True, rows=128)
    assert shrink.retry(rollout(lambda a: a.prefill_chunk_size), "generate", kind="generation") == (64, None)
    assert shrink.reductions == 1
    args = SimpleNamespace(generation_slice_size=None, prefill_chunk_size=None, max_prompt_length=256)
    shrink = MicroBatchShrinker(args, True, rows=128)
    assert shrink.retry(rollout(lambda a: (a.generation_slice_size or 128) <= 32), "generate",
                        kind="generation") == (64, 32)
    assert shrink.reductions == 3  # chunked, then 64, then 32
    args = SimpleNamespace(generation_slice_size=None, prefill_chunk_size=None, max_prompt_length=48)
    shrink = MicroBatchShrinker(args, True, rows=128)
    assert shrink.retry(rollout(lambda a: (a.generation_slice_size or 128) <= 64), "generate",
                        kind="generation") == (None, 64)


def test_auto_reduce_is_one_process_only():
    import train_grpo
    from utils.cli import UsageError, parse_args

    args, explicit = parse_args(train_grpo.Args, ["--auto_reduce_micro_batch", "--prompts_per_step", "4"])
    with pytest.raises(UsageError, match="needs one process"):
        train_grpo.check_args(args, 2, explicit)


def test_best_levers_name_only_what_the_runs_processes_and_engine_accept():
    """The out-of-memory report's three flags (best_levers): for W-PPO 1.5b with everything on the GPU the critic swap
    and --optimizer_offload save the most in one process; with two DDP processes a swapped critic and --param_offload
    are refused (utils/placement.py, utils/args.py), so neither is named, --optimizer_offload still is; under ZeRO-2
    (the engine holds the optimizer state) --optimizer_offload is not named either."""
    from utils.memory import best_levers
    from utils.plan import WORKLOAD_PPO, script_args

    args = script_args("ppo", WORKLOAD_PPO + ["--model_name_or_path", "qwen2.5-1.5b", "--reward_model_name_or_path",
                                              "x", "--use_gradient_checkpointing", "--logprob_chunk_size", "1024",
                                              "--generation_backend", "compiled"])  # as a run resolves auto on a GPU

    def named(*a):
        return {line.split(":")[0] for line in best_levers(args, "ppo", *a, count=50)}

    alone, ddp, zero2 = named(1, "single"), named(2, "ddp"), named(2, "zero2")
    assert {"--critic_device swap", "--optimizer_offload"} <= alone
    assert "--param_offload --offload_policy embedding,lm_head" in alone
    assert not {"--critic_device swap", "--param_offload --offload_policy embedding,lm_head"} & ddp
    assert "--optimizer_offload" in ddp and "--optimizer_offload" not in zero2
