"""The rollout/training numerics mismatch: for each generation backend and numerics, how far the decoding
loop's logprob of each sampled token is from the training forward's (the metric
`policy/rollout_train_logprob_diff/mean|max` that --rollout_importance_correction corrects).

    python benchmarks/rollout_mismatch.py                          # every row, 1.5b, results in benchmarks/results/
    python benchmarks/rollout_mismatch.py --rows hf,compiled --steps 2
    python benchmarks/rollout_mismatch.py --table                  # the table from the rows' JSON files only
    python benchmarks/rollout_mismatch.py --shape tiny --rows hf --steps 2   # CPU smoke test

Each row runs train_grpo.py on W-GRPO's shapes (benchmarks/README.md; benchmarks/memory.py's random-weight model,
so the sampling distribution is near uniform: a trained model's peaked one puts more of the mismatch on its rare
tokens) with fewer prompts per step (the statistic is per token; 4 prompts x 8 completions x 512 tokens is 16k
tokens a step) and the row's flags. Written per row: <out>/rollout_mismatch/<row>.json, and rollout_mismatch.md
from every row's JSON in the folder.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory import SHAPES, command, device_info, fmt, prepare_inputs, run_config  # noqa: E402

# name -> (what generates, what trains, flags)
ROWS = {
    "hf": ("HF generate, float32 master weights under bf16 autocast", "same weights, bf16 autocast",
           ["--generation_backend", "hf"]),
    "compiled": ("compiled captured step, same weights under bf16 autocast", "same weights, bf16 autocast",
                 ["--generation_backend", "compiled"]),
    "compiled_copy": ("compiled captured step on a bf16 copy (--generation_copy)", "float32 weights, bf16 autocast",
                      ["--generation_backend", "compiled", "--generation_copy"]),
    "bf16_weights": ("compiled captured step, bf16 weights", "bf16 weights (--torch_dtype bfloat16)",
                     ["--generation_backend", "compiled", "--torch_dtype", "bfloat16"]),
    "qlora": ("compiled captured step through bitsandbytes 4-bit + unmerged LoRA", "same, under bf16 autocast",
              ["--use_lora", "--load_in_4bit", "--generation_backend", "compiled"]),
    "qlora_copy": ("compiled captured step on a dequantised, merged bf16 copy (--generation_copy)",
                   "bitsandbytes 4-bit + LoRA", ["--use_lora", "--load_in_4bit", "--generation_backend", "compiled",
                                                 "--generation_copy"]),
    "qlora_int8_copy": ("compiled captured step on an int8 copy (--generation_copy --generation_copy_dtype int8)",
                       "bitsandbytes 4-bit + LoRA", ["--use_lora", "--load_in_4bit", "--generation_backend", "compiled",
                                                     "--generation_copy", "--generation_copy_dtype", "int8"]),
    "compiled_fp8kv": ("compiled captured step, keys and values in an fp8 cache (--kv_cache_dtype fp8)",
                       "same weights, bf16 autocast", ["--generation_backend", "compiled", "--kv_cache_dtype", "fp8"]),
    "qlora_fp8kv": ("compiled captured step through 4-bit + LoRA, fp8 KV cache", "bitsandbytes 4-bit + LoRA",
                    ["--use_lora", "--load_in_4bit", "--generation_backend", "compiled", "--kv_cache_dtype", "fp8"]),
}
PROMPTS_PER_STEP = 4


def run_row(name, shape, steps, cache_dir, out, on_gpu, gpu_name):
    generates, trains, flags = ROWS[name]
    model_dir, tok_dir, dataset = prepare_inputs(shape, "grpo", steps, cache_dir, on_gpu)
    flags = flags + ["--prompts_per_step", str(PROMPTS_PER_STEP)]  # after the workload's: the last value counts
    run_dir = os.path.join(cache_dir, "runs", f"mismatch_{name}_{shape}")
    result = run_config(name, flags, command(shape, "grpo", model_dir, tok_dir, dataset, run_dir, steps, flags),
                        run_dir)
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    means = [r["policy/rollout_train_logprob_diff/mean"] for r in rows]
    maxima = [r["policy/rollout_train_logprob_diff/max"] for r in rows]
    record = dict(row=name, shape=shape, gpu=gpu_name, generates=generates, trains=trains, flags=flags,
                  status=result["status"], steps=len(rows), diff_mean=statistics.median(means) if means else None,
                  diff_max=max(maxima) if maxima else None, diff_mean_per_step=means, diff_max_per_step=maxima,
                  entropy=statistics.median(r["policy/entropy"] for r in rows) if rows else None,
                  command=result["command"])
    os.makedirs(os.path.join(out, "rollout_mismatch"), exist_ok=True)
    with open(os.path.join(out, "rollout_mismatch", f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"[{name}] {record['status']}: mean |diff| {fmt(record['diff_mean'], '.2e')}, "
          f"max {fmt(record['diff_max'], '.3g')}, entropy {fmt(record['entropy'], '.3g')} nats", flush=True)
    return record


def table(out):
    folder = os.path.join(out, "rollout_mismatch")
    records = [json.load(open(os.path.join(folder, f))) for f in sorted(os.listdir(folder)) if f.endswith(".json")]
    records.sort(key=lambda r: list(ROWS).index(r["row"]) if r["row"] in ROWS else len(ROWS))
    lines = ["| row | generates with | trains with | mean abs diff (median over steps) | max abs diff | "
             "entropy (nats) | steps | status |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['row']} | {r['generates']} | {r['trains']} | {fmt(r['diff_mean'], '.2e')} | "
                     f"{fmt(r['diff_max'], '.3g')} | {fmt(r['entropy'], '.3g')} | {r['steps']} | {r['status']} |")
    gpus = sorted({r["gpu"] for r in records})
    text = (f"Rollout/training logprob mismatch, W-GRPO shapes with {PROMPTS_PER_STEP} prompts per step, "
            f"{', '.join(sorted({r['shape'] for r in records}))}, on {', '.join(gpus)}\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(folder, "rollout_mismatch.md"), "w") as f:
        f.write(text)
    print(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    parser.add_argument("--steps", type=int, default=3, help="training steps per row")
    parser.add_argument("--table", action="store_true", help="only write the table from the rows' JSON files")
    parser.add_argument("--cache_dir", default="/tmp/lean_rl_bench", help="random-weight models, tokenizers, prompts")
    parser.add_argument("--out", default="benchmarks/results", help="where rollout_mismatch/ is written")
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out)
    if not args.table:
        rows = args.rows.split(",")
        unknown = [r for r in rows if r not in ROWS]
        if unknown or args.steps < 1:
            parser.error(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(ROWS)}" if unknown else
                         "--steps must be at least 1")
        on_gpu, gpu_name = device_info()
        for name in rows:
            run_row(name, args.shape, args.steps, os.path.abspath(args.cache_dir), out, on_gpu, gpu_name)
    table(out)


if __name__ == "__main__":
    main()
