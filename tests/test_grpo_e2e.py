"""End-to-end runs of train_grpo.py on the embedded tiny model (CPU, subprocesses)."""
import json
import os
import re

import pytest

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


def accuracy_rise(rows):
    accuracy = [r["reward/accuracy/mean"] for r in rows]
    return sum(accuracy[:10]) / 10, sum(accuracy[-10:]) / 10


def test_debug_run_with_the_loss_variants_learns_the_toy_task(run, tmp_path):
    """GSPO's sequence ratio (with two updates per batch, so the ratio moves), the two-sided clip, the
    bias-corrected KL, the top-entropy tokens, the rollout correction and the completion log, in one
    debug run of 150 of the preset's 250 steps (accuracy 0.89 and 0.97 at seeds 42 and 1)."""
    result = run(["--debug", "--max_steps", "150", "--importance_sampling_level", "sequence", "--num_iterations", "2",
                  "--delta", "1.5", "--use_bias_correction_kl", "--top_entropy_quantile", "0.8",
                  "--rollout_importance_correction", "sequence_truncate", "--log_completions",
                  "--num_completions_to_print", "1", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    before, after = accuracy_rise(rows)
    print(f"debug run with the loss variants: accuracy {before:.3f} -> {after:.3f}")
    assert before < 0.25 and after > before + 0.4, (before, after)
    for row in rows:
        # the top 80% (more where tokens tie at the threshold: a group's first tokens share one context)
        assert 0.8 - 1e-3 <= row["policy/high_entropy_frac"] < 0.9
        assert 0 <= row["policy/rollout_train_logprob_diff/mean"] < 1e-4  # float32 on both sides (CPU)
        assert row["policy/rollout_train_logprob_diff/max"] >= row["policy/rollout_train_logprob_diff/mean"]
        assert row["policy/rollout_is_weight_mean"] == pytest.approx(1, abs=1e-3)
    assert max(r["policy/clipfrac"] for r in rows) > 0  # the second update's sequence ratios were clipped
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert len(logged) == 150 * 512 and set(logged[0]) == {"step", "prompt", "completion", "accuracy", "reward",
                                                             "advantage"}
    assert "step 1 | reward " in result.stdout


def test_debug_run_with_dynamic_sampling_and_the_overlong_penalty_learns_the_toy_task(run, tmp_path):
    """Dynamic sampling and DAPO's overlong penalty, 150 of the preset's 250 steps (accuracy 0.75 and 0.64
    at seeds 42 and 1). On the toy task both need settings of their own: dynamic sampling half the
    preset's learning rate (every token of its batch carries an advantage; at 3e-3 accuracy stalled
    near 0.5), and the penalty --scale_rewards batch (with group scaling, a group of wrong answers
    whose lengths differ gets unit advantages from the penalty alone, and the toy learns length)."""
    result = run(["--debug", "--max_steps", "150", "--learning_rate", "1.5e-3", "--dynamic_sampling",
                  "--max_generation_rounds", "3", "--overlong_buffer_len", "1", "--overlong_penalty_factor", "0.1",
                  "--scale_rewards", "batch", "--log_completions", "--num_completions_to_print", "0",
                  "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    before, after = accuracy_rise(rows)
    print(f"debug run with dynamic sampling and the overlong penalty: accuracy {before:.3f} -> {after:.3f}")
    assert before < 0.25 and after > before + 0.4, (before, after)
    drawn = 0
    for row in rows:  # every group generated is counted once
        n = {k.split("/")[1]: v for k, v in row.items() if k.startswith("dynamic_sampling/")}
        assert n["prompts_generated"] == 32 * n["rounds"] <= 32 * 3
        assert n["prompts_used"] + n["prompts_filler"] == 32
        assert n["prompts_used"] + n["prompts_unused"] + n["prompts_dropped"] + n["prompts_filler"] == n["prompts_generated"]
        assert n["prompts_filler"] == 0 or n["rounds"] == 3  # short only when the rounds ran out
        drawn += n["prompts_generated"]
        assert n["prompts_drawn_total"] == drawn
        assert row["reward/mean"] == pytest.approx(row["reward/accuracy/mean"] + row["reward/overlong_penalty/mean"],
                                                   abs=1e-5)
    assert any(r["dynamic_sampling/rounds"] > 1 for r in rows)
    # the trained groups: rewards that differ within each group (unless it filled a short batch), and
    # advantages that are the group-normalised rewards
    logged = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert len(logged) == 150 * 512
    fillers = {r["step"]: r["dynamic_sampling/prompts_filler"] for r in rows}
    for start in range(0, len(logged), 16):
        group = logged[start:start + 16]
        assert len({r["prompt"] for r in group}) == 1 and len({r["step"] for r in group}) == 1
        rewards = [r["reward"] for r in group]
        assert len(set(rewards)) > 1 or fillers[group[0]["step"]] > 0
        assert sum(r["advantage"] for r in group) == pytest.approx(0, abs=1e-3)


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
                  "--warmup_steps", "1", "--log_completions", "--num_completions_to_print", "0",
                  "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    events = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files
              if f.startswith("events.out.tfevents")]
    assert events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tables = []  # --log_completions: a markdown table per step in the text tab
    for path in events:
        accumulator = EventAccumulator(path)
        accumulator.Reload()
        if "completions/text_summary" in accumulator.Tags()["tensors"]:
            tables += [e.tensor_proto.string_val[0].decode() for e in accumulator.Tensors("completions/text_summary")]
    assert len(tables) == 2 and tables[0].startswith("| prompt | completion | accuracy | reward | advantage |")
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


def test_reward_functions_see_the_epoch_of_the_prompts_they_score_with_dynamic_sampling(run, tmp_path):
    """trainer_state.epoch is the data position of the round being scored (rounds of prompts drawn so far), not
    step x prompts_per_step: a step of three rounds scores prompts a third and two thirds further on."""
    (tmp_path / "recorder.py").write_text(
        "def record(completions, trainer_state, **kwargs):\n"
        f"    open({str(tmp_path / 'epochs.txt')!r}, 'a').write(f'{{trainer_state.global_step}} {{trainer_state.epoch!r}}\\n')\n"
        "    return [0.0] * len(completions)\n")
    result = run(["--debug", "--max_steps", "4", "--dynamic_sampling", "--max_generation_rounds", "3",
                  "--reward_funcs", "accuracy," + str(tmp_path / "recorder.py") + ":record", "--output_dir",
                  str(tmp_path / "out")])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path / "out")
    calls = [line.split() for line in open(tmp_path / "epochs.txt")]
    assert len(calls) == sum(r["dynamic_sampling/rounds"] for r in rows) > len(rows)  # some step drew 2+ rounds
    per_round = float(calls[1][1])  # prompts_per_step / len(dataset)
    assert per_round > 0
    assert [float(e) for _, e in calls] == pytest.approx([k * per_round for k in range(len(calls))])
    steps = [int(s) for s, _ in calls]
    assert steps == sorted(steps) and len(set(steps)) == len(rows)


def test_dynamic_sampling_sigterm_then_resume_equals_uninterrupted(tmp_path):
    """Dynamic sampling draws more prompts than the step count says: the data position (rounds drawn)
    is saved with the checkpoint, so the resumed run draws the prompts the uninterrupted one did."""
    full, stopped, stopped_at, resumed_out = sigterm_then_resume(
        "train_grpo.py", ["--max_steps", "8", "--save_steps", "0", "--debug", "--dynamic_sampling",
                          "--max_generation_rounds", "3", "--log_completions", "--num_completions_to_print", "0"],
        tmp_path)
    assert 2 <= stopped_at < 8 and f"steps {stopped_at}->8" in resumed_out
    assert_same_weights(full / "final", stopped / "final")
    rows_full, rows_stopped = metrics_of(full), metrics_of(stopped)
    assert [r["step"] for r in rows_stopped] == list(range(1, 9))
    for key in ("reward/mean", "dynamic_sampling/rounds", "dynamic_sampling/prompts_drawn_total", "loss/policy"):
        assert [r[key] for r in rows_stopped] == [r[key] for r in rows_full], key
    # the stop came after a step of several rounds: the data position was not the step count
    assert max(r["dynamic_sampling/rounds"] for r in rows_full[:stopped_at]) > 1
    assert (full / "completions.jsonl").read_text() == (stopped / "completions.jsonl").read_text()


def test_two_processes_with_dynamic_sampling_top_entropy_and_completion_logs(tmp_path):
    result = launch_two_cpu_processes("train_grpo.py", [
        "--max_steps", "3", "--dynamic_sampling", "--top_entropy_quantile", "0.5", "--rollout_importance_correction",
        "token_truncate", "--log_completions", "--num_completions_to_print", "0", "--output_dir", str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    prints = dict(re.findall(r"\[rank (\d)\] final weights fingerprint: (\([-\d.e+]+, [-\d.e+]+\))", result.stdout))
    assert set(prints) == {"0", "1"} and prints["0"] == prints["1"]
    rows = metrics_of(tmp_path)
    for row in rows:  # the entropy threshold is the whole step's, over both processes' tokens (ties kept)
        assert 0.5 - 1e-3 <= row["policy/high_entropy_frac"] < 0.6
        assert row["dynamic_sampling/prompts_used"] + row["dynamic_sampling/prompts_filler"] == 32
    completions = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert len(completions) == 3 * 32 * 16  # both processes' completions, every step


@pytest.mark.parametrize("argv, message", [
    (["--delta", "1.1"], "--delta 1.1 must be > 1 + --epsilon_high (1.2)"),
    (["--top_entropy_quantile", "1.5"], "--top_entropy_quantile must be in [0, 1]"),
    (["--max_generation_rounds", "0"], "--max_generation_rounds must be at least 1"),
    (["--overlong_buffer_len", "300", "--max_completion_length", "256"], "--overlong_buffer_len must be in [0, "),
    (["--rollout_importance_clip", "0"], "--rollout_importance_clip must be > 0"),
    (["--rollout_importance_correction", "token"], "invalid choice: 'token'"),
])
def test_bad_new_flags_fail_before_models_load(argv, message, capsys, monkeypatch, tmp_path):
    import utils.modeling

    import train_grpo

    monkeypatch.setattr(utils.modeling, "load_causal_lm", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exc:
        train_grpo.main(argv + ["--output_dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
