"""Peak GPU memory (allocated and reserved, per phase) and step time of real training runs of
train_grpo.py / train_ppo.py on the reference workloads (W-GRPO, W-PPO), with random weights.

    python benchmarks/memory.py --shape qwen2.5-1.5b                                   # W-GRPO, 2 steps
    python benchmarks/memory.py --shape qwen2.5-1.5b -- --use_gradient_checkpointing   # after --: script flags
    python benchmarks/memory.py --shape qwen2.5-7b --script ppo --steps 5 -- --ref_offload
    python benchmarks/memory.py --shape qwen2.5-1.5b --sweep --parallel_gpus 2         # every config in SWEEP
    python benchmarks/memory.py --shape qwen2.5-0.5b --sweep --configs baseline,grad_ckpt,best
    python benchmarks/memory.py --shape tiny --steps 2                                  # CPU smoke test, seconds
    python benchmarks/memory.py --engines multi_gpu,deepspeed_zero2,deepspeed_zero3,fsdp2 --num_processes 2 \
        -- --use_gradient_checkpointing                                                  # per-GPU memory per engine

Built once per shape and cached in --cache_dir (default /tmp/lean_rl_bench): a Qwen2 model with
random weights (seed 0; bf16, created on the GPU when there is one, else float32), an "id
tokenizer" in its own folder whose tokens are `<0>` ... `<V-1>` for the shape's vocab size V (every
sampled id decodes; eos is `<V-2>`, pad is `<V-1>`), and a jsonl of random prompts of exactly
max_prompt_length ids (256; never eos or pad). A random model almost never emits eos, so
completions run to the full length. The reward is `distinct_fraction` below.

Each config is one subprocess (output to <cache_dir>/runs/<shape>_<script>/<config>/log.txt);
its numbers come from that run's metrics.jsonl: per-phase peaks are the max over steps, the step
time is the median over steps 2.. (step 1 is warm-up), loss and grad norm are step 1's. --sweep writes
<out>/memory_<shape>_<script>.md (table), .json (all results) and .png (bar chart of peak reserved).
"""

import argparse
import json
import os
import queue
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.plan import SHAPES  # noqa: E402 (name -> Qwen2Config fields; `tiny` is for CPU tests)

SHAPE_COMMON = dict(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)

# the workloads' flags (W-GRPO, W-PPO), and the small sizes that make `tiny` run on CPU in seconds
WORKLOADS = {
    "grpo": dict(prompts_per_step=16, num_generations=8, max_prompt_length=256, max_completion_length=512,
                 temperature=1.0, beta=0.04, learning_rate=1e-6, num_iterations=1),
    "ppo": dict(prompts_per_step=128, max_prompt_length=256, max_completion_length=512, learning_rate=1e-6,
                ppo_epochs=1),
}
# (32 new tokens from 512 ids: repeats are common, so rewards vary within a group and gradients are not 0)
TINY_WORKLOADS = {"grpo": dict(prompts_per_step=2, num_generations=4, max_prompt_length=8, max_completion_length=32),
                  "ppo": dict(prompts_per_step=4, max_prompt_length=8, max_completion_length=32)}

# (name, flags): baseline, each lever alone, then the best combination. Edit freely.
SWEEP = [
    ("baseline", ""),
    ("grad_ckpt", "--use_gradient_checkpointing"),
    ("act_offload", "--use_gradient_checkpointing --activation_offload"),
    ("dynamic_bsz", "--use_dynamic_bsz --max_token_len_per_gpu 8192"),
    ("logprob_chunk", "--logprob_chunk_size 1024"),
    ("adamw_8bit", "--optim adamw_8bit"),
    ("adamw_4bit", "--optim adamw_4bit"),
    ("bf16_weights", "--torch_dtype bfloat16"),
    ("ref_offload", "--ref_offload"),
    ("param_offload", "--param_offload --offload_policy embedding,lm_head"),
    ("gen_bsz_32", "--generation_slice_size 32"),
    ("empty_cache", "--empty_cache_between_phases"),
    ("lora", "--use_lora"),
    ("qlora", "--use_lora --load_in_4bit"),
    ("prefill_chunk", "--prefill_chunk_size 64"),
    ("kv_fp8", "--kv_cache_dtype fp8"),
    ("gen_copy", "--generation_copy"),
    ("gen_copy_int8", "--generation_copy --generation_copy_dtype int8"),
    ("qlora_copy", "--use_lora --load_in_4bit --generation_copy"),
    ("qlora_copy_int8", "--use_lora --load_in_4bit --generation_copy --generation_copy_dtype int8"),
    ("lora_bf16", "--use_lora --torch_dtype bfloat16"),
    ("lora_bf16_copy", "--use_lora --torch_dtype bfloat16 --generation_copy"),
    ("lora_bf16_copy_in_place", "--use_lora --torch_dtype bfloat16 --generation_copy --generation_copy_in_place"),
    ("best", "--use_gradient_checkpointing --activation_offload --use_dynamic_bsz --max_token_len_per_gpu 8192 "
             "--logprob_chunk_size 1024 --optim adamw_4bit --torch_dtype bfloat16 --ref_offload "
             "--generation_slice_size 32 --empty_cache_between_phases"),
]
# the issue's targets (W-GRPO, peak reserved over the whole step): name -> (shape, flags, GiB limit)
FULL_7B = ("--use_gradient_checkpointing --activation_offload --use_dynamic_bsz --max_token_len_per_gpu 8192 "
           "--logprob_chunk_size 1024 --optim adamw_4bit --torch_dtype bfloat16 --ref_offload "
           "--empty_cache_between_phases")
TARGETS = {
    "7b_full": ("qwen2.5-7b", FULL_7B + " --param_offload --offload_policy embedding,lm_head", 48.0),
    "7b_full_no_param_offload": ("qwen2.5-7b", FULL_7B, 48.0),
    "7b_qlora": ("qwen2.5-7b", "--use_lora --load_in_4bit --use_gradient_checkpointing --activation_offload "
                 "--use_dynamic_bsz --max_token_len_per_gpu 8192 --logprob_chunk_size 1024 --generation_slice_size 32 "
                 "--empty_cache_between_phases --param_offload --offload_policy embedding", 10.0),
    "7b_lora_bf16": ("qwen2.5-7b", "--use_lora --torch_dtype bfloat16 --use_gradient_checkpointing --activation_offload "
                     "--use_dynamic_bsz --max_token_len_per_gpu 8192 --logprob_chunk_size 1024 --generation_slice_size 32 "
                     "--empty_cache_between_phases --param_offload --offload_policy embedding,lm_head", 20.0),
    "1.5b_full": ("qwen2.5-1.5b", FULL_7B.replace("8192", "4096").replace("1024", "256")
                  + " --generation_slice_size 64 --param_offload --offload_policy embedding", 12.0),
}
# flags that must not change the math: a config made only of these must match the baseline's step 1
SAME_MATH_FLAGS = {"--use_gradient_checkpointing", "--activation_offload", "--logprob_chunk_size", "--use_dynamic_bsz",
                   "--max_token_len_per_gpu", "--param_offload", "--offload_policy", "--generation_slice_size",
                   "--empty_cache_between_phases"}
LOSS_ATOL, RTOL = 1e-3, 2e-2  # bf16 tolerance: |loss - base| <= 1e-3 + 2e-2 |base|, |gn - base| <= 2e-2 |base|
SLOW = 0.30  # a config slower than the baseline by more than this is flagged
PHASES = ("generate", "ref", "reward", "old_logprobs", "values", "actor_update", "critic_update")
TABLE_PHASES = ("generate", "ref", "actor_update", "critic_update")


def distinct_fraction(completions, **kwargs):
    """Reward: distinct whitespace-separated tokens / tokens of each completion (0.0 when empty)."""
    fractions = []
    for text in completions:
        tokens = text.split()
        fractions.append(len(set(tokens)) / len(tokens) if tokens else 0.0)
    return fractions


# ---- inputs: model, tokenizer, prompts (each built once, in its own folder, marked when complete) ----


def cached(folder, build):
    """Build into `folder` unless it is complete; the marker is written only after `build` returns,
    so an interrupted build is redone."""
    marker = os.path.join(folder, ".complete")
    if not os.path.exists(marker):
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        build(folder)
        open(marker, "w").close()
    return folder


def shape_config(shape):
    """The Qwen2 config of a workload shape; eos V-2, pad V-1 as the id tokenizer's."""
    from transformers import Qwen2Config

    vocab = SHAPES[shape]["vocab_size"]
    return Qwen2Config(**SHAPES[shape], **SHAPE_COMMON, bos_token_id=vocab - 2, eos_token_id=vocab - 2,
                       pad_token_id=vocab - 1)


def build_model(shape, folder, on_gpu):
    """Random-weight Qwen2 of `shape` (seed 0), saved to `folder`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = shape_config(shape)
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):  # on the GPU: 7B initialises in seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.save_pretrained(folder, safe_serialization=True)


def build_id_tokenizer(vocab_size):
    """Tokens `<0>` ... `<V-1>` split on whitespace and decoded joined by spaces; eos `<V-2>`, pad `<V-1>`, unknown `<0>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # an unknown word (a reward model reads prompt + completion joined, "<7><9>") reads as <0>
    core = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=f"<{vocab_size - 2}>", unk_token="<0>",
                                   pad_token=f"<{vocab_size - 1}>", clean_up_tokenization_spaces=False)


def write_prompts(path, vocab_size, rows, length, seed=0):
    """`rows` lines {"prompt": "<id> <id> ..."} of exactly `length` random ids, never eos or pad."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            ids = [rng.randrange(vocab_size - 2) for _ in range(length)]
            f.write(json.dumps({"prompt": " ".join(f"<{i}>" for i in ids)}) + "\n")


def device_info():
    """(CUDA available, GPU name), asked of a child process so that this one never holds a CUDA
    context on a GPU the runs use."""
    code = ("import torch; ok = torch.cuda.is_available(); "
            "print(ok); print(torch.cuda.get_device_name(0) if ok else 'none (CPU)')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    return out[0] == "True", out[1]


def prepare_inputs(shape, script, steps, cache_dir, on_gpu):
    """(model folder, tokenizer folder, prompts.jsonl), built if missing."""
    vocab = SHAPES[shape]["vocab_size"]
    workload = workload_flags(shape, script)
    rows, length = workload["prompts_per_step"] * steps, workload["max_prompt_length"]
    def model_in_child(folder):  # a fresh interpreter: this one never holds a CUDA context or the weights
        code = f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks.memory import build_model; "
        subprocess.run([sys.executable, "-c", code + f"build_model({shape!r}, {folder!r}, {on_gpu})"], check=True)

    model_dir = cached(os.path.join(cache_dir, f"{shape}-{'bf16' if on_gpu else 'fp32'}"), model_in_child)
    tok_dir = cached(os.path.join(cache_dir, f"id-tokenizer-{vocab}"),
                     lambda folder: build_id_tokenizer(vocab).save_pretrained(folder))
    data_dir = cached(os.path.join(cache_dir, f"prompts-{vocab}-{rows}x{length}"),
                      lambda folder: write_prompts(os.path.join(folder, "prompts.jsonl"), vocab, rows, length))
    return model_dir, tok_dir, os.path.join(data_dir, "prompts.jsonl")


# ---- running a config and reading its metrics ------------------------------------------------------


def workload_flags(shape, script):
    return dict(WORKLOADS[script], **(TINY_WORKLOADS[script] if shape == "tiny" else {}))


def command(shape, script, model_dir, tok_dir, dataset, run_dir, steps, flags):
    cmd = [sys.executable, f"train_{script}.py"]
    for name, value in workload_flags(shape, script).items():
        cmd += [f"--{name}", str(value)]
    return cmd + ["--model_name_or_path", model_dir, "--tokenizer_name_or_path", tok_dir, "--dataset_name", dataset,
                  "--reward_funcs", "benchmarks/memory.py:distinct_fraction", "--use_chat_template", "false",
                  "--max_steps", str(steps), "--save_strategy", "no", "--output_dir", run_dir, "--seed", "0", *flags]


def summarize(rows):
    """One run's numbers from its metrics.jsonl rows; None where absent (memory on CPU)."""
    def numbers(key, subset=rows):
        return [r[key] for r in subset if isinstance(r.get(key), (int, float))]

    timed = rows[1:] or rows  # step 1 is warm-up
    median = lambda key: statistics.median(numbers(key, timed)) if numbers(key, timed) else None  # noqa: E731
    peak = lambda key: max(numbers(key)) if numbers(key) else None  # noqa: E731
    seen = [k[5:] for r in rows for k in r if k.startswith("time/") and k != "time/step"]
    names = [p for p in PHASES if p in seen] + sorted(set(seen) - set(PHASES))
    phases = {p: {"time_s": median(f"time/{p}"), "times_s": numbers(f"time/{p}", timed),  # each timed step's
                  "peak_allocated_gib": peak(f"memory/{p}/peak_allocated_gib"),
                  "peak_reserved_gib": peak(f"memory/{p}/peak_reserved_gib")} for p in names}
    overall = lambda kind: max((v[kind] for v in phases.values() if v[kind] is not None), default=None)  # noqa: E731
    first = rows[0] if rows else {}
    return dict(steps=len(rows), phases=phases, peak_reserved_gib=overall("peak_reserved_gib"),
                peak_allocated_gib=overall("peak_allocated_gib"), step_time_s=median("time/step"),
                step_times_s=numbers("time/step", timed),  # each timed step: a recompile shows as an outlier
                tokens_per_s=median("throughput/tokens_per_s"), host_peak_rss_gib=peak("memory/host_peak_rss_gib"),
                loss=first.get("loss/policy"), grad_norm=first.get("optim/grad_norm"))


def run_config(name, flags, cmd, run_dir, gpu=None, echo=False):
    """Run one config in a subprocess, its output streamed to run_dir/log.txt; returns its result."""
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl is appended to: start clean
    os.makedirs(run_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    log_path, start = os.path.join(run_dir, "log.txt"), time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                                      stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log.write(line)
            if echo:
                sys.stdout.write(line)
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    result = dict(name=name, flags=flags, command=shlex.join(cmd), log=log_path, gpu=gpu, status="ok",
                  returncode=proc.returncode, wall_s=time.perf_counter() - start, **summarize(rows))
    if proc.returncode != 0:
        lines = open(log_path).read().splitlines()
        oom = any("OutOfMemoryError" in line or "out of memory" in line.lower() for line in lines)
        result["status"] = "OOM" if oom else "failed"
        print(f"[{name}] {result['status']} (exit {proc.returncode}); last 30 lines of {log_path}:\n  "
              + "\n  ".join(lines[-30:]), flush=True)
    return result


def run_all(configs, make_cmd, run_root, parallel_gpus, echo, on_result=None):
    """Run (name, flags) configs, up to parallel_gpus at once, each pinned to its own GPU;
    `on_result(results so far)` after each one (a sweep's reports survive an interrupted run)."""
    import threading

    done, lock = [], threading.Lock()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = queue.Queue()
    for gpu in (visible.split(",") if visible else [str(i) for i in range(parallel_gpus)])[:parallel_gpus]:
        gpus.put(gpu)

    def one(config):
        name, flags = config
        gpu = gpus.get()
        try:
            pinned = gpu if parallel_gpus > 1 else None
            where = f" on GPU {gpu}" if pinned else ""
            print(f"[{name}] running{where}: {shlex.join(flags) or '(no extra flags)'}", flush=True)
            run_dir = os.path.join(run_root, name)
            result = run_config(name, flags, make_cmd(run_dir, flags), run_dir, pinned, echo)
            print(f"[{name}] {result['status']}: peak reserved {fmt(result['peak_reserved_gib'])} GiB, "
                  f"step {fmt(result['step_time_s'], '.3g')} s, wall {result['wall_s']:.0f} s", flush=True)
            with lock:
                done.append(result)
                if on_result:
                    on_result(sorted(done, key=lambda r: [c[0] for c in configs].index(r["name"])))
            return result
        finally:
            gpus.put(gpu)

    with ThreadPoolExecutor(max_workers=parallel_gpus) as pool:
        return list(pool.map(one, configs))


# ---- reporting ----------------------------------------------------------------------------------


def fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def close(a, b, atol, rtol):
    return a is not None and b is not None and abs(a - b) <= atol + rtol * abs(b)  # False for NaN


def note(result, baseline):
    """`costs >30% step time` and, for configs that must not change the math, `equivalent` / `DIFFERS`."""
    if result["status"] != "ok" or baseline is None or result is baseline or baseline["status"] != "ok":
        return ""
    notes = []
    t, t0 = result["step_time_s"], baseline["step_time_s"]
    if t is not None and t0 and t / t0 - 1 > SLOW:
        notes.append(f"costs >{SLOW:.0%} step time")
    names = [f for f in result["flags"] if f.startswith("--")]
    if names and all(f in SAME_MATH_FLAGS for f in names):
        if None in (result["loss"], result["grad_norm"], baseline["loss"], baseline["grad_norm"]):
            notes.append("equivalence n/a")
        elif (close(result["loss"], baseline["loss"], LOSS_ATOL, RTOL)
              and close(result["grad_norm"], baseline["grad_norm"], 0.0, RTOL)):
            notes.append("equivalent")
        else:
            notes.append(f"DIFFERS (loss {result['loss']:.5g} vs {baseline['loss']:.5g}, "
                         f"grad norm {result['grad_norm']:.5g} vs {baseline['grad_norm']:.5g})")
    return "; ".join(notes)


def markdown_table(results):
    baseline = next((r for r in results if r["name"] == "baseline"), None)
    phases = [p for p in TABLE_PHASES if p != "critic_update" or any(p in r["phases"] for r in results)]
    head = (["config", "flags", "peak reserved GiB", "peak allocated GiB"] + [f"{p} reserved GiB" for p in phases]
            + ["step time s", "vs baseline", "loss (step 1)", "grad norm (step 1)", "note"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        flags = f"`{shlex.join(r['flags'])}`" if r["flags"] else ""
        if r["status"] != "ok":
            cells = [r["name"], flags, r["status"]] + [""] * (len(head) - 3)
        else:
            t, t0 = r["step_time_s"], baseline and baseline["status"] == "ok" and baseline["step_time_s"]
            vs = f"{100 * (t / t0 - 1):+.0f}%" if t is not None and t0 and r is not baseline else ""
            cells = ([r["name"], flags, fmt(r["peak_reserved_gib"]), fmt(r["peak_allocated_gib"])]
                     + [fmt(r["phases"].get(p, {}).get("peak_reserved_gib")) for p in phases]
                     + [fmt(t, ".3g"), vs, fmt(r["loss"], ".4g"), fmt(r["grad_norm"], ".4g"), note(r, baseline)])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [r["peak_reserved_gib"] or 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.4 * len(results)))
    ax.barh(range(len(results)), values, color=["tab:blue" if r["status"] == "ok" else "tab:red" for r in results])
    ax.set_yticks(range(len(results)), [r["name"] for r in results])
    ax.invert_yaxis()
    for i, r in enumerate(results):
        label = (f" {fmt(r['peak_reserved_gib'])} GiB, {fmt(r['step_time_s'], '.3g')} s/step" if r["status"] == "ok"
                 else f" {r['status']}")
        ax.text(values[i], i, label, va="center", fontsize=8)
    ax.set_xlim(0, 1.4 * max(values + [1.0]))
    ax.set_xlabel("peak reserved GiB (max over phases and steps; n/a without CUDA)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(results, out, shape, script, gpu_name, steps, extra=(), tag=""):
    """<out>/memory_<shape>_<script><tag>.md, .json and .png; returns their paths."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"memory_{shape}_{script}{tag}")
    title = f"{shape}, {script.upper()} ({steps} steps), {gpu_name}"
    text = [f"# Memory: {title}", "", f"Measured {time.strftime('%Y-%m-%d')} with `benchmarks/memory.py`. "
            "Peaks: max over steps of torch.cuda.max_memory_* per phase; step time: median of steps 2.. "
            "(step 1 is warm-up); loss and grad norm: step 1."
            + (f" Every config also has `{shlex.join(extra)}`." if extra else ""), "", markdown_table(results), "",
            "Commands:", "",
            "```"] + [f"# {r['name']}\n{r['command']}" for r in results] + ["```", ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(text))
    with open(stem + ".json", "w") as f:
        json.dump(dict(shape=shape, script=script, gpu=gpu_name, steps=steps, extra_flags=list(extra),
                       results=results), f, indent=1)
    write_plot(results, stem + ".png", title)
    return [stem + ".md", stem + ".json", stem + ".png"]


def print_run(r):
    """The config's summary line and its per-phase table."""
    print(f"\n{r['name']}: {r['status']} | peak reserved {fmt(r['peak_reserved_gib'])} GiB, allocated "
          f"{fmt(r['peak_allocated_gib'])} GiB | step {fmt(r['step_time_s'], '.3g')} s, "
          f"{fmt(r['tokens_per_s'], '.0f')} tokens/s | step 1 loss {fmt(r['loss'], '.4g')}, "
          f"grad norm {fmt(r['grad_norm'], '.4g')}")
    print(f"  {'phase':<14}{'time s':>9}{'allocated GiB':>15}{'reserved GiB':>14}")
    for name, p in r["phases"].items():
        print(f"  {name:<14}{fmt(p['time_s'], '.3f'):>9}{fmt(p['peak_allocated_gib']):>15}"
              f"{fmt(p['peak_reserved_gib']):>14}")


def benchmark_parser(argv, doc):
    """(parser with --shape and --script, this benchmark's argv, the script flags after `--`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_flags = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    parser.add_argument("--script", default="grpo", choices=["grpo", "ppo"])
    return parser, argv, script_flags


def main(argv=None):
    parser, argv, extra = benchmark_parser(argv, __doc__)
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (step 1 is warm-up)")
    parser.add_argument("--sweep", action="store_true", help="run the configs in SWEEP and write md/json/png")
    parser.add_argument("--configs", help="comma list of SWEEP names to run (with --sweep); default: all")
    parser.add_argument("--target", choices=list(TARGETS), help="run one of TARGETS (its shape and flags) and say "
                        "whether its peak reserved memory is within the limit")
    parser.add_argument("--parallel_gpus", type=int, default=1, help="run up to N configs at once, one GPU each")
    parser.add_argument("--engines", help="comma list of accelerate_configs/ names (multi_gpu,deepspeed_zero2,"
                        "deepspeed_zero3,fsdp2): one run under each, launched with --num_processes")
    parser.add_argument("--num_processes", type=int, default=2, help="processes per run with --engines")
    parser.add_argument("--cache_dir", default="/tmp/lean_rl_bench", help="random-weight models, tokenizers, prompts")
    parser.add_argument("--out", default="benchmarks/results", help="where --sweep writes its md, json and png")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.parallel_gpus < 1 or args.num_processes < 1:
        parser.error("--steps, --parallel_gpus and --num_processes must be at least 1")
    configs = [("run", [])]
    if args.target:
        args.shape, flags, limit = TARGETS[args.target]
        configs = [(args.target, shlex.split(flags))]
    if args.sweep:
        wanted = args.configs.split(",") if args.configs else [name for name, _ in SWEEP]
        unknown = sorted(set(wanted) - {name for name, _ in SWEEP})
        if unknown:
            parser.error(f"--configs: unknown {', '.join(unknown)}; SWEEP has {', '.join(n for n, _ in SWEEP)}")
        configs = [(name, shlex.split(flags)) for name, flags in SWEEP if name in wanted]
    if args.engines:
        configs = [(name, []) for name in args.engines.split(",")]
        missing = [n for n, _ in configs if not os.path.exists(os.path.join(ROOT, "accelerate_configs", n + ".yaml"))]
        if missing or args.sweep or args.target:
            parser.error(f"--engines: {', '.join(missing)} not in accelerate_configs/" if missing else
                         "--engines runs the flags after -- under each engine; not with --sweep or --target")

    on_gpu, gpu_name = device_info()
    cache_dir, out = os.path.abspath(args.cache_dir), os.path.abspath(args.out)  # the runs' cwd is the repo root
    print(f"device: {gpu_name} | shape {args.shape} | {args.script} | {args.steps} steps | cache {cache_dir}",
          flush=True)
    model_dir, tok_dir, dataset = prepare_inputs(args.shape, args.script, args.steps, cache_dir, on_gpu)
    run_root = os.path.join(cache_dir, "runs", f"{args.shape}_{args.script}")  # logs, metrics.jsonl

    def make_cmd(run_dir, flags):
        cmd = command(args.shape, args.script, model_dir, tok_dir, dataset, run_dir, args.steps, extra + flags)
        if args.engines:  # run_dir is named after the engine's config
            config = os.path.join(ROOT, "accelerate_configs", os.path.basename(run_dir) + ".yaml")
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes",
                   str(args.num_processes), "--main_process_port", str(29500 + len(os.path.basename(run_dir))),
                   *cmd[1:]]
        return cmd

    tag = f"_engines_{args.num_processes}proc" if args.engines else ""

    def write_so_far(results):
        write_reports(results, out, args.shape, args.script, gpu_name, args.steps, extra, tag)

    results = run_all(configs, make_cmd, run_root, args.parallel_gpus, echo=not (args.sweep or args.engines),
                      on_result=write_so_far if args.sweep or args.engines else None)
    print(f"\nGPU: {gpu_name}")
    for r in results:
        print(f"command ({r['name']}): {r['command']}")
        print_run(r)
    if args.target:
        peak = results[0]["peak_reserved_gib"]
        verdict = "n/a" if peak is None else ("MET" if peak <= limit else f"MISSED by {peak - limit:.2f} GiB")
        print(f"\ntarget {args.target}: peak reserved {fmt(peak)} GiB vs limit {limit:.0f} GiB: {verdict}")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"target_{args.target}.json"), "w") as f:
            json.dump({**results[0], "target": args.target, "limit_gib": limit, "gpu_name": gpu_name,
                       "verdict": verdict}, f, indent=1)
    if args.engines:  # every rank's own peak, as each printed it at the end
        for r in results:
            peaks = re.findall(r"\[rank \d+\] peak GPU memory allocated: .*", open(r["log"]).read())
            print(f"{r['name']} ({args.num_processes} processes): " + ("; ".join(sorted(peaks)) or "no peaks printed"))
    if args.sweep or args.engines:
        print("\n" + markdown_table(results))
        print("\nwrote " + ", ".join(write_reports(results, out, args.shape, args.script, gpu_name, args.steps,
                                                      extra, tag)))
    return results


if __name__ == "__main__":
    results = main()
    sys.exit(0 if all(r["status"] == "ok" for r in results) else 1)
