"""End-to-end runs of train_grpo.py on the embedded tiny model (CPU, subprocesses)."""
import json
import os
import re

from helpers import assert_same_weights, launch_two_cpu_processes, metrics_of, sigterm_then_resume


def test_debug_run_learns_the_toy_task(run, tmp_path):
    result = run(["--debug", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"reward: first (\d+) steps ([\d.]+) -> last \d+ steps ([\d.]+)", result.stdout)
    assert match, result.stdout[-2000:]
    before, after = float(match.group(2)), float(match.group(3))
    print(f"debug run: reward {before:.3f} -> {after:.3f}")
    assert before < 0.25 and after > before + 0.4, (before, after)
    rows = metrics_of(tmp_path)
    assert len(rows) == 250
    for key in ("reward/mean", "reward/std", "reward/accuracy/mean", "advantage/std", "policy/kl", "policy/clipfrac",
                "policy/entropy", "completions/mean_length", "completions/truncated_frac", "optim/lr",
                "optim/grad_norm", "time/generate", "time/ref", "time/reward", "time/actor_update",
                "throughput/tokens_per_s"):
        assert key in rows[-1], key
    assert rows[-1]["policy/kl"] > 0  # the policy moved away from the reference
    assert "generate " in result.stdout and "| ref " in result.stdout  # verbose per-phase lines
    assert "grpo:" in result.stderr  # tqdm progress bar


def test_two_processes_end_with_identical_weights(tmp_path):
    result = launch_two_cpu_processes("train_grpo.py", ["--max_steps", "3", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "num_processes=2" in result.stdout
    prints = dict(re.findall(r"\[rank (\d)\] final weights fingerprint: (\([-\d.e+]+, [-\d.e+]+\))", result.stdout))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"]
    assert len(metrics_of(tmp_path)) == 3


def test_final_model_reloads_with_from_pretrained_and_generates(run, tmp_path):
    result = run(["--max_steps", "2", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = tmp_path / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.decode(tokenizer("1 + 2 = 3")["input_ids"]) == "1 + 2 = 3"  # spaces survive the reload
    model = AutoModelForCausalLM.from_pretrained(final)
    out = model.generate(**tokenizer(["3+4="], return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert out.shape[1] > 4
    assert isinstance(tokenizer.decode(out[0, 4:], skip_special_tokens=True), str)
    assert_same_weights(final, tmp_path / "checkpoint-2")  # the checkpoint holds the same weights


def test_sigterm_saves_and_resume_equals_uninterrupted(tmp_path):
    full, stopped, stopped_at, resumed_out = sigterm_then_resume(
        "train_grpo.py", ["--max_steps", "14", "--save_steps", "0", "--debug"], tmp_path)
    assert 2 <= stopped_at < 14 and f"steps {stopped_at}->14" in resumed_out
    assert_same_weights(full / "final", stopped / "final")
    assert [row["step"] for row in metrics_of(stopped)] == list(range(1, 15))  # every step logged once
    assert [row["reward/mean"] for row in metrics_of(stopped)] == [row["reward/mean"] for row in metrics_of(full)]


def test_user_dataset_reward_file_and_reward_model(run, tmp_path):
    from utils import toy

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"question": f"What is {i}+1?", "solution": f"{i}+1 = {i + 1}\n#### {i + 1}"})
                              for i in range(10)))
    (tmp_path / "my_reward.py").write_text(
        "def short(completions, prompts, answer, solution, **kwargs):\n"
        "    assert answer == solution\n"
        "    return [1.0 if len(c) < 4 else 0.0 for c in completions]\n")
    # a tiny reward model with its own tokenizer (different ids) and only 16 positions
    rm_tokenizer = toy.build_tokenizer()
    rm_tokenizer.add_tokens(["<extra_a>", "<extra_b>"])
    rm_tokenizer.model_max_length = 16
    rm = toy.build_sequence_classifier(rm_tokenizer)
    rm.config.max_position_embeddings = 16
    rm.save_pretrained(tmp_path / "rm")
    rm_tokenizer.save_pretrained(tmp_path / "rm")
    result = run(["--debug", "--max_steps", "3", "--dataset_name", str(data), "--prompt_column", "question",
                  "--answer_column", "solution", "--reward_funcs", f"accuracy,format,{tmp_path}/my_reward.py:short",
                  "--reward_model_name_or_path", str(tmp_path / "rm"), "--reward_weights", "1,0.5,0.5,0.1",
                  "--max_completion_length", "12", "--output_dir", str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "cut from the left" in result.stderr  # prompt + completion exceed the reward model's 16 positions
    last = metrics_of(tmp_path / "out")[-1]
    for name in ("accuracy", "format", "short", "reward_model"):
        assert f"reward/{name}/mean" in last


def test_non_finite_updates_are_skipped_then_abort(run, tmp_path):
    (tmp_path / "bad.py").write_text("def inf(completions, **kwargs):\n    return [float('inf')] * len(completions)\n")
    result = run(["--max_steps", "5", "--reward_funcs", f"{tmp_path}/bad.py:inf", "--max_skipped_steps", "2",
                  "--save_steps", "1", "--output_dir", str(tmp_path)])
    assert result.returncode == 1
    assert "update skipped (1 in a row)" in result.stderr and "update skipped (2 in a row)" in result.stderr
    assert "aborting at step 1: 2 consecutive updates had a non-finite loss" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "checkpoint-1").is_dir()  # work saved before the abort is intact


def test_tensorboard_and_flags_reach_the_loop(run, tmp_path):
    result = run(["--max_steps", "2", "--report_to", "tensorboard", "--loss_type", "grpo", "--scale_rewards", "batch",
                  "--num_iterations", "2", "--mask_truncated_completions", "--epsilon_high", "0.28",
                  "--temperature", "0.9", "--top_k", "20", "--top_p", "0.95", "--lr_scheduler_type", "cosine",
                  "--warmup_steps", "1", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    events = [f for _, _, files in os.walk(tmp_path) for f in files if f.startswith("events.out.tfevents")]
    assert events
    rows = metrics_of(tmp_path)
    assert "time/old_logprobs" in rows[0]  # num_iterations > 1 computes old logprobs
    assert rows[0]["optim/lr"] < 3e-3  # warmup


def test_lora_policy_reference_without_a_copy_and_exact_resume(run, tmp_path):
    common = ["--use_lora", "--lora_r", "4", "--max_steps", "4", "--save_steps", "2", "--learning_rate", "1e-2"]
    full = run([*common, "--output_dir", str(tmp_path / "full")])
    assert full.returncode == 0, full.stderr[-3000:]
    assert "ref     the actor with its LoRA adapter disabled" in full.stdout
    assert metrics_of(tmp_path / "full")[-1]["policy/kl"] > 0  # the adapter moved the policy off the reference
    resumed = run([*common, "--output_dir", str(tmp_path / "resumed"),
                   "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoint-2")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_weights(tmp_path / "full" / "final", tmp_path / "resumed" / "final")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    assert not [k for k in load_file(str(tmp_path / "full" / "final" / "model.safetensors")) if "lora" in k]
    AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")  # merged: plain from_pretrained loads it
