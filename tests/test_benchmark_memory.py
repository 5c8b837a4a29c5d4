"""benchmarks/memory.py: its pieces (shapes, id tokenizer, prompts, reward, metrics parsing,
reports from fake results) and, once the scripts accept --save_strategy and
--tokenizer_name_or_path, a tiny end-to-end run and a 2-config sweep on CPU."""
import json
import os
import subprocess
import sys
from functools import lru_cache

import pytest
from helpers import ROOT

from benchmarks import memory as bench

PAPER_PARAMS = {"qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("shape", list(PAPER_PARAMS))
def test_shapes_have_the_published_parameter_counts(shape):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**bench.SHAPES[shape], **bench.SHAPE_COMMON)
    assert config.max_position_embeddings == 32768 and config.rms_norm_eps == 1e-6
    with torch.device("meta"):  # no memory, no init time
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PAPER_PARAMS[shape]


def test_id_tokenizer_round_trips_ids(tmp_path):
    from transformers import AutoTokenizer

    vocab = bench.SHAPES["tiny"]["vocab_size"]
    bench.build_id_tokenizer(vocab).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # as the scripts load it
    assert len(tokenizer) == vocab
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (vocab - 2, vocab - 1)
    ids = list(range(vocab))
    text = tokenizer.decode(ids)
    assert text == " ".join(f"<{i}>" for i in ids)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    # what the reward sees: special tokens dropped, every other sampled id decodes
    assert tokenizer.batch_decode([[7, 3, 7, vocab - 2, vocab - 1]], skip_special_tokens=True) == ["<7> <3> <7>"]


def test_prompts_have_exact_length_and_no_special_ids(tmp_path):
    path = tmp_path / "p.jsonl"
    bench.write_prompts(path, vocab_size=16, rows=20, length=256)
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 20
    for row in rows:
        ids = [int(t[1:-1]) for t in row["prompt"].split()]
        assert len(ids) == 256 and max(ids) < 14  # 14 is eos, 15 pad
    bench.write_prompts(tmp_path / "q.jsonl", vocab_size=16, rows=20, length=256)
    assert open(path).read() == open(tmp_path / "q.jsonl").read()  # seeded


def test_an_interrupted_build_is_redone(tmp_path):
    folder, calls = str(tmp_path / "model"), []

    def interrupted(path):
        open(os.path.join(path, "half-written"), "w").close()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bench.cached(folder, interrupted)
    assert not os.path.exists(os.path.join(folder, ".complete"))
    bench.cached(folder, lambda path: calls.append(path))
    bench.cached(folder, lambda path: calls.append(path))  # complete: not built again
    assert calls == [folder] and sorted(os.listdir(folder)) == [".complete"]


def test_distinct_fraction():
    completions = ["<1> <2> <1>", "", "<5>", "a b c d", "  x  x\n x y ", "   "]
    assert bench.distinct_fraction(completions, prompts=None, answer=None) == [2 / 3, 0.0, 1.0, 1.0, 0.5, 0.0]


def test_summarize_gpu_and_cpu_rows():
    gpu_rows = [
        {"step": 1, "time/step": 9.0, "time/generate": 5.0, "time/ref": 1.0, "time/actor_update": 3.0,
         "memory/generate/peak_allocated_gib": 10.0, "memory/generate/peak_reserved_gib": 12.0,
         "memory/actor_update/peak_allocated_gib": 20.0, "memory/actor_update/peak_reserved_gib": 22.0,
         "loss/policy": 0.5, "optim/grad_norm": 2.0, "throughput/tokens_per_s": 100.0},
        {"step": 2, "time/step": 4.0, "time/generate": 2.0, "time/ref": 0.5, "time/actor_update": 1.5,
         "memory/generate/peak_allocated_gib": 11.0, "memory/generate/peak_reserved_gib": 13.0,
         "memory/actor_update/peak_allocated_gib": 19.0, "memory/actor_update/peak_reserved_gib": 21.0,
         "loss/policy": 0.4, "optim/grad_norm": 1.0, "throughput/tokens_per_s": 200.0},
        {"step": 3, "time/step": 6.0, "time/generate": 3.0, "time/ref": 0.5, "time/actor_update": 2.5,
         "loss/policy": 0.3, "optim/grad_norm": 1.0, "throughput/tokens_per_s": 150.0},
    ]
    s = bench.summarize(gpu_rows)
    assert list(s["phases"]) == ["generate", "ref", "actor_update"]
    assert s["phases"]["generate"]["peak_reserved_gib"] == 13.0 and s["phases"]["ref"]["peak_reserved_gib"] is None
    assert (s["peak_reserved_gib"], s["peak_allocated_gib"]) == (22.0, 20.0)
    assert s["step_time_s"] == 5.0  # median of steps 2..3; step 1 is warm-up
    assert s["phases"]["actor_update"]["times_s"] == [1.5, 2.5]  # each timed step's, in order
    assert (s["loss"], s["grad_norm"]) == (0.5, 2.0)  # step 1's
    cpu = bench.summarize([{"step": 1, "time/step": 1.0, "time/generate": 0.5, "loss/policy": 0.1}])
    assert cpu["step_time_s"] == 1.0 and cpu["peak_reserved_gib"] is None and cpu["grad_norm"] is None
    assert bench.summarize([])["step_time_s"] is None


def fake(name, flags, reserved, step, loss, grad_norm, status="ok"):
    phases = {p: {"time_s": 1.0, "peak_allocated_gib": reserved and reserved - 1,
                  "peak_reserved_gib": reserved} for p in ("generate", "ref", "actor_update")}
    return dict(name=name, flags=flags.split(), status=status, command=f"python train_grpo.py {flags}",
                phases=phases if status == "ok" else {}, peak_reserved_gib=reserved,
                peak_allocated_gib=reserved and reserved - 1, step_time_s=step, loss=loss, grad_norm=grad_norm)


def test_reports_from_fake_results(tmp_path):
    results = [
        fake("baseline", "", 40.0, 10.0, 0.0123, 1.50),
        fake("grad_ckpt", "--use_gradient_checkpointing", 30.0, 12.0, 0.0126, 1.51),  # within tolerance, +20%
        fake("act_offload", "--use_gradient_checkpointing --activation_offload", 25.0, 14.0, 0.0123, 1.5),  # +40%
        fake("logprob_chunk", "--logprob_chunk_size 1024", 35.0, 10.0, 0.0123, 1.60),  # grad norm off by 6.7%
        fake("dynamic_bsz", "--use_dynamic_bsz --max_token_len_per_gpu 8192", 35.0, 9.0, 0.0200, 1.50),  # loss off
        fake("adamw_8bit", "--optim adamw_8bit", 38.0, 20.0, 0.9, 9.0),  # may change the math: no verdict
        fake("qlora", "--use_lora --load_in_4bit", None, None, None, None, status="OOM"),
        fake("empty_cache", "--empty_cache_between_phases", None, 10.0, 0.0123, 1.5),  # CPU-like: no memory
    ]
    md, js, png = bench.write_reports(results, str(tmp_path), "qwen2.5-1.5b", "grpo", "NVIDIA H200", 2)
    assert os.path.basename(md) == "memory_qwen2.5-1.5b_grpo.md"
    rows = {line.split("|")[1].strip(): line for line in open(md).read().splitlines() if line.startswith("| ")}
    notes = {name: line.split("|")[-2].strip() for name, line in rows.items()}
    assert notes["baseline"] == ""
    assert notes["grad_ckpt"] == "equivalent"
    assert notes["act_offload"] == "costs >30% step time; equivalent"
    assert notes["logprob_chunk"].startswith("DIFFERS") and "grad norm 1.6 vs 1.5" in notes["logprob_chunk"]
    assert notes["dynamic_bsz"].startswith("DIFFERS")
    assert notes["adamw_8bit"] == "costs >30% step time"
    assert "| OOM |" in rows["qlora"] and notes["qlora"] == ""
    assert notes["empty_cache"] == "equivalent" and "| n/a |" in rows["empty_cache"]
    assert "+20%" in rows["grad_ckpt"] and "+100%" in rows["adamw_8bit"]
    assert "critic_update" not in open(md).read()
    assert "python train_grpo.py --optim adamw_8bit" in open(md).read()  # the commands
    data = json.load(open(js))
    assert data["gpu"] == "NVIDIA H200" and [r["name"] for r in data["results"]] == [r["name"] for r in results]
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1000


@pytest.mark.parametrize("message, status", [("torch.OutOfMemoryError: CUDA out of memory. Tried ...", "OOM"),
                                             ("ValueError: something else", "failed")])
def test_a_failing_run_is_recorded(tmp_path, capsys, message, status):
    cmd = [sys.executable, "-c", f"print({message!r}); raise SystemExit(1)"]
    result = bench.run_config("x", ["--flag"], cmd, str(tmp_path / "run"))
    assert result["status"] == status and result["returncode"] == 1 and result["step_time_s"] is None
    assert message in open(result["log"]).read() and message in capsys.readouterr().out  # the last lines, printed
    row = bench.markdown_table([result]).splitlines()[-1]
    assert row.startswith(f"| x | `--flag` | {status} |")


def test_notes_without_a_baseline_are_empty():
    results = [fake("grad_ckpt", "--use_gradient_checkpointing", 30.0, 12.0, 0.1, 1.0)]
    assert "equivalent" not in bench.markdown_table(results)


# ---- end to end on CPU (tiny shape) --------------------------------------------------------------------


@lru_cache(maxsize=None)
def scripts_missing_flags():
    helps = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "--help"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300).stdout
    return [f for f in ("--save_strategy", "--tokenizer_name_or_path") if f not in helps]


@pytest.fixture
def needs_new_flags():
    missing = scripts_missing_flags()
    if missing:
        pytest.skip(f"train_grpo.py does not accept {', '.join(missing)} yet (benchmarks/memory.py passes them)")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("bench_cache"))  # the tiny model, tokenizer and prompts, built once


def run_benchmark(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "memory.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_tiny_grpo_run_end_to_end(needs_new_flags, cache_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_benchmark(["--shape", "tiny", "--steps", "2", "--cache_dir", cache_dir, "--out", str(out), "--",
                          "--per_device_train_batch_size", "4"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "\nGPU: " in proc.stdout
    command = next(line for line in proc.stdout.splitlines() if line.startswith("command (run): "))
    assert "--save_strategy no" in command and "--tokenizer_name_or_path" in command
    assert command.endswith("--seed 0 --per_device_train_batch_size 4")  # the flags after --, last
    assert "micro-batches of 4" in proc.stdout  # the script got it (its output is echoed in a single run)
    assert "run: ok" in proc.stdout and "actor_update" in proc.stdout
    for name in (".complete", "config.json", "model.safetensors"):
        assert os.path.exists(os.path.join(cache_dir, "tiny-fp32", name))
    run_dir = os.path.join(cache_dir, "runs", "tiny_grpo", "run")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert len(rows) == 2 and "reward/distinct_fraction/mean" in rows[0]
    assert 0.0 < rows[0]["reward/distinct_fraction/mean"] <= 1.0
    assert sorted(os.listdir(run_dir)) == ["log.txt", "metrics.jsonl"]  # --save_strategy no: nothing else
    assert not out.exists()  # a single run writes no report


def test_tiny_two_config_sweep(needs_new_flags, cache_dir, tmp_path):
    out = tmp_path / "out"
    proc = run_benchmark(["--shape", "tiny", "--sweep", "--configs", "baseline,grad_ckpt", "--cache_dir", cache_dir,
                          "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stem = out / "memory_tiny_grpo"
    for ext in (".md", ".json", ".png"):
        assert os.path.getsize(f"{stem}{ext}") > 0, ext
    results = json.load(open(f"{stem}.json"))["results"]
    assert [r["name"] for r in results] == ["baseline", "grad_ckpt"]
    for r in results:
        assert r["status"] == "ok" and r["steps"] == 2
        assert r["step_time_s"] > 0 and r["loss"] is not None and r["grad_norm"] > 0  # rewards vary: a real check
        assert "generate" in r["phases"] and "actor_update" in r["phases"]
    md = open(f"{stem}.md").read()
    if results[0]["peak_reserved_gib"] is None:  # CPU: no CUDA memory numbers
        assert "| n/a |" in md
    # checkpointing recomputes the same activations: same step-1 loss and grad norm on CPU (fp32)
    assert "equivalent" in md.split("| grad_ckpt |")[1].splitlines()[0]


def test_engines_mode_runs_each_accelerate_config(tmp_path):
    """--engines: one run per accelerate config (here DeepSpeed ZeRO-2 in one CPU process), its own
    report files; an unknown config name is a usage error."""
    results = bench.main(["--shape", "tiny", "--steps", "2", "--engines", "deepspeed_zero2", "--num_processes", "1",
                          "--cache_dir", str(tmp_path / "cache"), "--out", str(tmp_path)])
    assert [r["status"] for r in results] == ["ok"] and "accelerate.commands.launch" in results[0]["command"]
    assert "deepspeed_zero2.yaml" in results[0]["command"] and results[0]["loss"] is not None
    assert (tmp_path / "memory_tiny_grpo_engines_1proc.md").exists()
    with pytest.raises(SystemExit):
        bench.main(["--shape", "tiny", "--engines", "zero9", "--out", str(tmp_path)])
