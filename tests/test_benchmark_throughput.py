"""benchmarks/throughput.py: the roofline arithmetic against a hand count for the 1.5b shape, the
ceilings' measurement, and a tiny end-to-end run on the CPU."""
import json

import pytest

from benchmarks import throughput as bench


def test_roofline_against_a_hand_count():
    # qwen2.5-1.5b by hand: per layer q, o 1536x1536; k, v 1536x256; gate, up, down 1536x8960; 28 layers;
    # the tied LM head 151936 x 1536; all parameters 1,543,714,304 (transformers' count)
    linear = 28 * (2 * 1536 * 1536 + 2 * 1536 * 256 + 3 * 1536 * 8960)
    matmul_params = linear + 151936 * 1536
    tokens = 128 * (256 + 512)  # W-GRPO: 16 x 8 rows of 256 + 512 tokens
    result = {"phases": {"generate": {"time_s": 10.24}, "ref": {"time_s": 0.5}, "actor_update": {"time_s": 3.0}},
              "completion_tokens": 128 * 512}
    ceilings = {"bandwidth_gb_s": 4000.0, "matmul_tflops": 800.0}
    line = bench.roofline("qwen2.5-1.5b", "grpo", ["--use_gradient_checkpointing"], result, ceilings)
    update_tflops = 8 * matmul_params * tokens / 3.0 / 1e12
    assert line["actor_update_tflops"] == pytest.approx(update_tflops)
    assert line["actor_update_fraction_of_matmul"] == pytest.approx(update_tflops / 800)
    assert line["ref_tflops"] == pytest.approx(2 * matmul_params * tokens / 0.5 / 1e12)
    # one decoding step: the fp32 weights once + 128 rows' KV (28 layers x K,V x 2 heads x 128 dims x 2 bytes)
    # at the mean context 256 + 512 / 2
    floor = (1_543_714_304 * 4 + 128 * 512 * 28 * 2 * 2 * 128 * 2) / 4000e9
    assert line["decode_floor_ms"] == pytest.approx(floor * 1e3)
    assert line["decode_step_ms"] == pytest.approx(10.24 / 512 * 1e3)
    assert line["decode_fraction_of_floor"] == pytest.approx(floor / (10.24 / 512))
    # bf16 weights in 4 slices of 32: four passes over half the bytes
    sliced = bench.roofline("qwen2.5-1.5b", "grpo", ["--torch_dtype", "bfloat16", "--generation_slice_size", "32"],
                            result, ceilings)
    assert sliced["decode_floor_ms"] == pytest.approx(
        4 * (1_543_714_304 * 2 + 32 * 512 * 28 * 2 * 2 * 128 * 2) / 4000e9 * 1e3)
    assert sliced["actor_update_tflops"] == pytest.approx(6 * matmul_params * tokens / 3.0 / 1e12)  # no recompute
    # QLoRA reads about 0.55 bytes per weight; generating from the bf16 copy reads 2
    qlora = bench.roofline("qwen2.5-1.5b", "grpo", ["--use_lora", "--load_in_4bit"], result, ceilings)
    copy = bench.roofline("qwen2.5-1.5b", "grpo", ["--use_lora", "--load_in_4bit", "--generation_copy"], result,
                          ceilings)
    kv = 128 * 512 * 28 * 2 * 2 * 128 * 2
    assert qlora["decode_floor_ms"] == pytest.approx((1_543_714_304 * 0.55 + kv) / 4000e9 * 1e3)
    assert copy["decode_floor_ms"] == pytest.approx((1_543_714_304 * 2 + kv) / 4000e9 * 1e3)


def test_ceilings_are_measured():
    ceilings = bench.measure_ceilings(on_gpu=False)
    assert ceilings["bandwidth_gb_s"] > 0.1 and ceilings["matmul_tflops"] > 1e-4 and ceilings["device"] == "CPU"


def test_tiny_run_end_to_end(tmp_path, capsys):
    bench.main(["--shape", "tiny", "--steps", "2", "--cache_dir", str(tmp_path / "cache"), "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "median step" in printed and "of bandwidth" in printed and "of matmul" in printed
    data = json.load(open(tmp_path / "throughput_tiny_grpo.json"))
    assert data["flags"] == ["--use_gradient_checkpointing"] and data["result"]["steps"] == 2
    assert data["roofline"]["decode_fraction_of_floor"] > 0


def test_decode_step_benchmark_runs_on_the_cpu(capsys, monkeypatch):
    """benchmarks/decode_step.py end to end at the tiny shape (the numbers mean nothing on a CPU)."""
    from benchmarks import decode_step
    from utils import decode_attention

    monkeypatch.setattr(decode_attention, "MAX_SPLITS", decode_attention.MAX_SPLITS)  # --attention_splits sets it

    decode_step.main(["--shape", "tiny", "--rows", "2", "--prompt_length", "4", "--short", "2", "--long", "4",
                      "--backends", "static,hf", "--dtypes", "fp32", "--profile", "3"])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "ms per step" in line]
    assert [line.split()[1] for line in lines] == ["static", "hf"], lines
    assert out.count("  profile: ") == 2 and out.count(" per step  ") == 6, out
    with pytest.raises(SystemExit):  # 4 + 100 and 4 + 200 tokens: caches of 128 and 256 positions
        decode_step.main(["--shape", "tiny", "--prompt_length", "4", "--short", "100", "--long", "200"])
    assert "choose both within one multiple of 128" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode_step.main(["--shape", "tiny", "--profile", "-1"])
    assert "--profile -1: the number of kernels to print" in capsys.readouterr().err
    decode_step.main(["--shape", "tiny", "--rows", "2", "--prompt_length", "4", "--short", "2", "--long", "4",
                      "--backends", "static", "--dtypes", "fp32", "--generation_copy", "--attention_splits", "1"])
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if "ms per step" in line] == ["static"]
    for bad, message in ((["--unfused_projections"], "with --generation_copy"),
                         (["--attention_splits", "-1"], "1 (unsplit)")):
        with pytest.raises(SystemExit):
            decode_step.main(["--shape", "tiny", *bad])
        assert message in capsys.readouterr().err


def test_decode_step_max_autotune_sets_the_decoding_steps_compile_options(capsys, monkeypatch):
    """--max_autotune sets utils/generation.py's DECODE_COMPILE_OPTIONS (the compiled step's forward takes them:
    tests/test_generation.py) and the run goes on; without it they stay inductor's defaults."""
    import utils.generation as generation
    from benchmarks import decode_step

    monkeypatch.setattr(generation, "DECODE_COMPILE_OPTIONS", None)  # --max_autotune sets it; restored after
    tiny = ["--shape", "tiny", "--rows", "2", "--prompt_length", "4", "--short", "2", "--long", "4",
            "--backends", "static", "--dtypes", "fp32"]
    decode_step.main(tiny)
    assert generation.DECODE_COMPILE_OPTIONS is None
    decode_step.main(tiny + ["--max_autotune"])
    assert generation.DECODE_COMPILE_OPTIONS == {"max_autotune": True}
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines() if "ms per step" in line] == [
        "static", "static"]


def test_decode_step_benchmark_decodes_lora_and_qlora_by_rows_on_the_cpu(capsys, tmp_path):
    """--dtypes lora,qlora: the random model saved once and loaded as the scripts load --use_lora (NF4 for
    qlora) with r16 adapters; one line per row count of --rows."""
    from benchmarks import decode_step

    decode_step.main(["--shape", "tiny", "--rows", "2,3", "--prompt_length", "4", "--short", "2", "--long", "4",
                      "--backends", "static", "--dtypes", "lora,qlora", "--cache_dir", str(tmp_path)])
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if "ms per step" in line]
    assert [(line[0], line[2]) for line in lines] == [("lora", "2"), ("lora", "3"), ("qlora", "2"), ("qlora", "3")]
    assert (tmp_path / "tiny-fp32" / ".complete").exists()
    with pytest.raises(SystemExit):
        decode_step.main(["--shape", "tiny", "--dtypes", "int3"])
    assert "--dtypes int3: int3 unknown; bf16, fp32, lora, qlora" in capsys.readouterr().err
