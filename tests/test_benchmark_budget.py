"""benchmarks/budget.py on the CPU (smoke test: the tiny shape, no cap without a GPU)."""
import json

import pytest

from benchmarks import budget


def test_budget_rows_write_their_json_and_the_table(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    budget.main(["--rows", "1.5b_full_24gb,ppo_1.5b_24gb", "--shape", "tiny", "--steps", "2", "--out", str(out),
                 "--cache_dir", str(cache)])
    for name in ("1.5b_full_24gb", "ppo_1.5b_24gb"):
        row = json.load(open(out / "budget" / f"{name}.json"))
        assert row["status"] == "ok" and row["step_time_s"] > 0 and row["card"] == "24GB"
        assert row["budget_gib"] == 21.0 and row["estimated_step_s"] is not None
        assert "--auto_reduce_micro_batch" in row["planner_flags"]  # what --auto_memory added, read off the log
        assert "--auto_memory --gpu_memory 24GB" in row["command"]
        assert set(row["phase_peaks_gib"]) == set(row["phases"]) and "generate" in row["phases"]
    table = open(out / "budget" / "budget.md").read()
    assert table.count("\n") == 4 and "15.1 s at 18.5 GiB" in table
    assert (out / "budget" / "budget.png").stat().st_size > 5000
    # --table alone rebuilds from the JSON files
    (out / "budget" / "budget.md").unlink()
    rows = budget.main(["--table", "--out", str(out)])
    assert [r["row"] for r in rows] == ["1.5b_full_24gb", "ppo_1.5b_24gb"] and (out / "budget" / "budget.md").exists()


def test_baseline_runs_each_row_from_the_named_revision_and_keeps_it_beside_this_trees(tmp_path, capsys):
    """--baseline REV: the row runs first from REV written out of git (its own budget.py and code), then from this
    tree; the row's JSON keeps the baseline's figures with REV's full hash, and one line compares the two. A name
    git does not know is refused before anything runs."""
    import subprocess

    sha = subprocess.run(["git", "-C", budget.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    out, cache = tmp_path / "out", tmp_path / "cache"
    budget.main(["--rows", "1.5b_full_24gb", "--shape", "tiny", "--steps", "2", "--out", str(out),
                 "--cache_dir", str(cache), "--baseline", "HEAD"])
    row = json.load(open(out / "budget" / "1.5b_full_24gb.json"))
    base = row["baseline"]
    assert base["rev"] == sha and base["status"] == "ok" and base["step_time_s"] > 0
    assert set(base["phases"]) == set(row["phases"]) and base["planner_flags"] == row["planner_flags"]
    assert (cache / f"baseline-{sha[:12]}" / "benchmarks" / "budget.py").is_file()
    assert (out / "budget_baseline" / "budget" / "1.5b_full_24gb.json").is_file()
    text = capsys.readouterr().out
    assert f"[1.5b_full_24gb] baseline {sha[:12]} -> this tree: " in text and " -> " in text.split("this tree: ")[-1]
    with pytest.raises(SystemExit) as exit_info:
        budget.main(["--rows", "1.5b_full_24gb", "--shape", "tiny", "--out", str(out), "--cache_dir", str(cache),
                     "--baseline", "no-such-revision"])
    assert exit_info.value.code == 2 and "--baseline no-such-revision: git names no such commit" in capsys.readouterr().err



def test_baseline_may_be_a_git_archive_tar_for_a_machine_without_the_history(tmp_path, capsys):
    """--baseline base.tar, made by `git archive REV`: the tree is written out of the tar under --cache_dir with
    REV's full hash read from the archive's header (what a GPU machine given the working tree without .git can
    use); a tar without that header is refused with exit 2 before anything runs."""
    import subprocess
    import tarfile

    sha = subprocess.run(["git", "-C", budget.ROOT, "rev-parse", "HEAD"], capture_output=True, text=True,
                         check=True).stdout.strip()
    archive, cache = tmp_path / "base.tar", tmp_path / "cache"
    subprocess.run(["git", "-C", budget.ROOT, "archive", "-o", str(archive), "HEAD"], check=True)
    folder, got = budget.baseline_tree(str(archive), str(cache))
    assert got == sha and folder == str(cache / f"baseline-{sha[:12]}")
    assert (cache / f"baseline-{sha[:12]}" / "benchmarks" / "budget.py").read_bytes() == subprocess.run(
        ["git", "-C", budget.ROOT, "show", "HEAD:benchmarks/budget.py"], capture_output=True, check=True).stdout
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        tar.add(budget.__file__, arcname="benchmarks/budget.py")
    with pytest.raises(SystemExit) as exit_info:
        budget.main(["--rows", "1.5b_full_24gb", "--shape", "tiny", "--out", str(tmp_path / "out"), "--cache_dir",
                     str(cache), "--baseline", str(plain)])
    assert exit_info.value.code == 2 and "or a tar file made by `git archive REV`" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

def test_reductions_read_what_the_run_shrank_off_its_log():
    log = ("UserWarning: out of memory in generate: retrying with --prefill_chunk_size 64 (kept for the rest of the run)\n"
           "  warnings.warn(...)\nUserWarning: out of memory in generate: retrying with --generation_slice_size 32 "
           "(kept for the rest of the run)\n")
    assert budget.reductions(log) == ["generate: --prefill_chunk_size 64", "generate: --generation_slice_size 32"]
    assert budget.reductions("plan: fits as it is\n") == []


def test_planned_reads_the_plan_off_a_log():
    log = ("plan: --torch_dtype bfloat16 --optim adamw_8bit\n  numerics changed: ...\n"
           "estimated with the plan: peak reserved 19.0 GiB, step 5.3 s (generate 2.19)\n")
    assert budget.planned(log) == ("--torch_dtype bfloat16 --optim adamw_8bit", 19.0, 5.3)
    assert budget.planned("plan: fits as it is\n")[0] == ""


def test_toggled_sets_or_removes_a_levers_flags_with_their_values():
    plan = ["--use_gradient_checkpointing", "--prefill_chunk_size", "64", "--optim", "adamw_8bit"]
    assert budget.toggled(plan, ["--prefill_chunk_size", "32"], True) == [
        "--use_gradient_checkpointing", "--optim", "adamw_8bit", "--prefill_chunk_size", "32"]
    assert budget.toggled(plan, ["--prefill_chunk_size", "32"], False) == [
        "--use_gradient_checkpointing", "--optim", "adamw_8bit"]
    assert budget.toggled(plan, ["--use_gradient_checkpointing", "--activation_offload"], False) == [
        "--prefill_chunk_size", "64", "--optim", "adamw_8bit"]
    assert budget.toggled(["--use_bnb_nested_quant", "false", "--x"], ["--use_bnb_nested_quant", "false"], False) \
        == ["--x"]
    # unset, the prompt cache is shared in a captured step: the side without the lever says false
    assert budget.toggled(["--x"], ["--share_prompt_cache"], False) == ["--x", "--share_prompt_cache", "false"]
    assert budget.toggled(["--x"], ["--share_prompt_cache"], True) == ["--x", "--share_prompt_cache"]


def test_lever_runs_the_row_without_and_with_it_and_nothing_else_differs(tmp_path, capsys, monkeypatch):
    """--lever FLAGS (twice): the row's planned flags run under its cap without each lever and with it; each JSON
    keeps both sides, whose flags differ by the lever alone, and one line compares them; the plan without either
    lever runs once for both. Without --rows: exit 2."""
    runs = []
    run_config = budget.run_config
    monkeypatch.setattr(budget, "run_config", lambda name, flags, *a, **k: runs.append(flags) or run_config(
        name, flags, *a, **k))
    out, cache = tmp_path / "out", tmp_path / "cache"
    budget.main(["--rows", "1.5b_full_24gb", "--shape", "tiny", "--steps", "2", "--out", str(out),
                 "--cache_dir", str(cache), "--lever", "--prefill_chunk_size 4", "--lever", "--logprob_chunk_size 8"])
    record = json.load(open(out / "levers" / "1.5b_full_24gb__prefill_chunk_size_4.json"))
    without, with_ = record["without"], record["with"]
    assert without["status"] == with_["status"] == "ok" and without["step_time_s"] > 0 and with_["step_time_s"] > 0
    assert with_["flags"] == without["flags"] + ["--prefill_chunk_size", "4"]
    assert without["flags"][-2:] == ["--gpu_memory", "24GB"] and "--auto_memory" not in without["command"]
    assert "generate" in with_["phases"] and record["lever"] == "--prefill_chunk_size 4"
    other = json.load(open(out / "levers" / "1.5b_full_24gb__logprob_chunk_size_8.json"))
    assert other["without"] == without and other["with"]["flags"] == without["flags"] + ["--logprob_chunk_size", "8"]
    assert len(runs) == 3  # the plan without the levers, then each lever's side with it
    table = open(out / "levers" / "levers.md").read().splitlines()
    assert len(table) == 4 and "`--logprob_chunk_size 8`" in table[2] and "`--prefill_chunk_size 4`" in table[3]
    assert f"{without['step_time_s']:.2f} -> {with_['step_time_s']:.2f}" in table[3]
    printed = capsys.readouterr().out
    assert "[1.5b_full_24gb] --prefill_chunk_size 4 (" in printed and "[1.5b_full_24gb] --logprob_chunk_size 8 (" in printed
    assert not (out / "budget").exists()  # the rows' table is not touched
    with pytest.raises(SystemExit) as exit_info:
        budget.main(["--lever", "--prefill_chunk_size 4", "--out", str(out)])
    assert exit_info.value.code == 2


def test_an_unsteady_row_prints_each_phases_time_per_step(tmp_path, capsys, monkeypatch):
    """A row whose timed steps differ by more than 30% is marked unsteady, its line names each phase's time per timed
    step (the phase the slow step lost its time in), and the JSON keeps them (phase_times_s)."""
    log = tmp_path / "log.txt"
    log.write_text("plan: --share_prompt_cache\nestimated with the plan: peak reserved 9.7 GiB, step 5.5 s\n")
    phase = lambda times: {"time_s": sum(times) / 2, "times_s": times, "peak_allocated_gib": 1.0,  # noqa: E731
                           "peak_reserved_gib": 1.0}
    result = dict(status="ok", log=str(log), peak_reserved_gib=9.44, peak_allocated_gib=9.36, step_time_s=9.30,
                  step_times_s=[12.93, 5.67], tokens_per_s=8298.0, command="python train_grpo.py",
                  phases={"generate": phase([2.25, 2.25]), "ref": phase([3.31, 0.63]), "actor_update": phase([7.3, 2.7])})
    monkeypatch.setattr(budget, "run_config", lambda *a, **k: result)
    monkeypatch.setattr(budget, "prepare_inputs", lambda *a: ("model", "tokenizer", "data.jsonl"))
    row = budget.run_row("1.5b_full_12gb", 3, str(tmp_path / "cache"), str(tmp_path / "out"), False, None)
    assert row["unsteady"] and row["phase_times_s"]["ref"] == [3.31, 0.63]
    printed = capsys.readouterr().out
    assert "(unsteady: steps 2.. took 12.93, 5.67 s; by phase: generate 2.25 / 2.25, ref 3.31 / 0.63, " \
           "actor_update 7.30 / 2.70)" in printed
    assert json.load(open(tmp_path / "out" / "budget" / "1.5b_full_12gb.json"))["phase_times_s"]["actor_update"] == [
        7.3, 2.7]
