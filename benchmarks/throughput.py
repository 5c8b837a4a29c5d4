"""Speed of the W-GRPO / W-PPO workloads per phase, against the limits of the hardware it runs on.

    python benchmarks/throughput.py --shape qwen2.5-1.5b                    # W-GRPO, 5 steps, checkpointing on
    python benchmarks/throughput.py --shape qwen2.5-1.5b -- --generation_backend compiled   # after --: script flags
    python benchmarks/throughput.py --shape qwen2.5-7b --steps 3 -- --torch_dtype bfloat16 --optim adamw_8bit
    python benchmarks/throughput.py --shape qwen2.5-1.5b --script ppo
    python benchmarks/throughput.py --shape tiny --steps 2                  # CPU smoke test

It first measures the two ceilings itself, in a child process: memory bandwidth (a large
device-to-device copy; bytes read + written per second) and the matmul rate (a large bf16 matmul
on a GPU, float32 on a CPU). Then it runs the script once (benchmarks/memory.py's random-weight
model, id tokenizer and prompts; completions run to the full length, as a random model almost
never samples eos) and prints, from the run's metrics.jsonl: the median step time over steps 2..
(step 1 is warm-up), seconds per phase, completion tokens/s, peak memory, and two ratios:

- decode: the generate phase's time per new token (prefill included) against the bandwidth floor,
  the time to read the weights once plus every row's KV cache at the mean context length, per
  decoding step, for each --generation_slice_size slice;
- update and reference: achieved TFLOP/s (6 x matmul parameters x tokens for forward+backward,
  8 with --use_gradient_checkpointing's recompute, 2 for a no-grad forward) against the matmul
  rate. Attention's own FLOPs are left out (they are under 10% at 768 tokens).

Results go to <out>/throughput_<shape>_<script>.json.
"""
import hashlib
import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory import (benchmark_parser, command, device_info, prepare_inputs, run_config,  # noqa: E402
                               workload_flags)


def measure_ceilings(on_gpu=None) -> dict:
    """{"bandwidth_gb_s", "matmul_tflops", "device"}: a timed copy and a timed matmul."""
    import time

    import torch

    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    device = "cuda" if on_gpu else "cpu"
    nbytes, n, dtype = (2 << 30, 8192, torch.bfloat16) if on_gpu else (64 << 20, 512, torch.float32)

    def timed(fn, repeats):
        fn()  # warm-up
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        if on_gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / repeats

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = timed(lambda: dst.copy_(src), 20)
    del src, dst
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    matmul_s = timed(lambda: a @ b, 20)
    name = torch.cuda.get_device_name(0) if on_gpu else "CPU"
    return dict(device=name, bandwidth_gb_s=2 * nbytes / copy_s / 1e9, matmul_tflops=2 * n ** 3 / matmul_s / 1e12)


def ceilings_in_child():
    """measure_ceilings in a fresh interpreter: this process never holds a CUDA context or memory."""
    code = (f"import sys, json; sys.path.insert(0, {ROOT!r}); from benchmarks.throughput import measure_ceilings; "
            "print(json.dumps(measure_ceilings()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def flag_value(flags, name, default=None):
    return flags[flags.index(name) + 1] if name in flags else default


def roofline(shape_name, script, flags, result, ceilings) -> dict:
    """The ratios of the module docstring, from one run's summary (benchmarks.memory.summarize)."""
    from utils.plan import kv_bytes_per_token, load_shape

    shape = load_shape(shape_name)
    work = workload_flags(shape_name, script)
    rows = work["prompts_per_step"] * work.get("num_generations", 1)
    prompt_len, max_new = work["max_prompt_length"], work["max_completion_length"]
    new_tokens = result.get("completion_tokens") or rows * max_new  # per step, all rows
    mean_len = new_tokens / rows
    matmul_params = shape.linear_params + shape.vocab * shape.hidden  # decoder Linears + the LM head
    # generation reads the weights in their storage dtype (float32 unless --torch_dtype bfloat16 or 4/8-bit)
    weight_bytes = {"bfloat16": 2, "float16": 2}.get(flag_value(flags, "--torch_dtype", "float32"), 4)
    if "--load_in_4bit" in flags:
        weight_bytes = 0.55
    elif "--load_in_8bit" in flags:
        weight_bytes = 1.05
    if "--generation_copy" in flags:  # generation reads the bf16 copy
        weight_bytes = 2
    slice_rows = min(int(flag_value(flags, "--generation_slice_size", rows)), rows)
    slices = -(-rows // slice_rows)
    context = prompt_len + mean_len / 2
    floor_per_step = slices * (shape.params * weight_bytes + slice_rows * context * kv_bytes_per_token(shape)) / (
        ceilings["bandwidth_gb_s"] * 1e9)
    phases = result["phases"]
    out = dict(rows=rows, new_tokens=new_tokens, decode_floor_ms=floor_per_step * 1e3)
    if phases.get("generate", {}).get("time_s"):
        measured = phases["generate"]["time_s"] / mean_len
        out.update(decode_step_ms=measured * 1e3, decode_fraction_of_floor=floor_per_step / measured,
                   generate_floor_s=floor_per_step * mean_len)
    tokens = rows * (prompt_len + mean_len)  # every forward covers prompt and completion
    factor = 8 if "--use_gradient_checkpointing" in flags else 6
    peak = ceilings["matmul_tflops"]
    for phase, f in (("actor_update", factor), ("ref", 2), ("critic_update", factor)):
        if phases.get(phase, {}).get("time_s"):
            tflops = f * matmul_params * tokens / phases[phase]["time_s"] / 1e12
            out[f"{phase}_tflops"], out[f"{phase}_fraction_of_matmul"] = tflops, tflops / peak
            out[f"{phase}_floor_s"] = f * matmul_params * tokens / (peak * 1e12)
    return out


def report(shape, script, flags, result, ceilings, line) -> str:
    p = result["phases"]
    lines = [f"device: {ceilings['device']} | ceilings: {ceilings['bandwidth_gb_s']:.0f} GB/s copy, "
             f"{ceilings['matmul_tflops']:.1f} TFLOP/s matmul",
             f"{shape} {script.upper()} {shlex.join(flags) or '(script defaults)'}: median step "
             f"{result['step_time_s'] or float('nan'):.2f} s (steps 2..{result['steps']}), "
             f"{result.get('tokens_per_s') or float('nan'):.0f} completion tokens/s, peak reserved "
             f"{result['peak_reserved_gib'] if result['peak_reserved_gib'] is not None else float('nan'):.2f} GiB",
             f"  {'phase':<15}{'time s':>9}{'floor s':>9}  against the limit"]
    floors = {"generate": line.get("generate_floor_s"), "ref": line.get("ref_floor_s"),
              "actor_update": line.get("actor_update_floor_s"), "critic_update": line.get("critic_update_floor_s")}
    for name, values in p.items():
        floor = floors.get(name)
        what = ""
        if name == "generate" and "decode_step_ms" in line:
            what = (f"{line['decode_step_ms']:.1f} ms per token vs {line['decode_floor_ms']:.2f} ms floor: "
                    f"{line['decode_fraction_of_floor']:.0%} of bandwidth")
        elif f"{name}_tflops" in line:
            what = f"{line[name + '_tflops']:.3g} TFLOP/s: {line[name + '_fraction_of_matmul']:.0%} of matmul"
        lines.append(f"  {name:<15}{values['time_s'] or 0:>9.2f}{floor if floor is not None else float('nan'):>9.2f}  {what}")
    return "\n".join(lines)


def main(argv=None):
    parser, argv, flags = benchmark_parser(argv, __doc__)
    parser.add_argument("--steps", type=int, default=5, help="training steps (median over steps 2..)")
    parser.add_argument("--no_checkpointing", action="store_true",
                        help="leave out --use_gradient_checkpointing (on by default, as in the issue's targets)")
    parser.add_argument("--cache_dir", default="/tmp/lean_rl_bench")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (step 1 is warm-up)")
    if not args.no_checkpointing and "--use_gradient_checkpointing" not in flags:
        flags = ["--use_gradient_checkpointing", *flags]
    on_gpu, _ = device_info()
    ceilings = ceilings_in_child()
    print(f"ceilings on {ceilings['device']}: {ceilings['bandwidth_gb_s']:.0f} GB/s, "
          f"{ceilings['matmul_tflops']:.1f} TFLOP/s", flush=True)
    cache_dir, out = os.path.abspath(args.cache_dir), os.path.abspath(args.out)
    model_dir, tok_dir, dataset = prepare_inputs(args.shape, args.script, args.steps, cache_dir, on_gpu)
    tag = hashlib.sha1(" ".join(flags).encode()).hexdigest()[:8]  # runs with other flags never share a folder
    run_dir = os.path.join(cache_dir, "runs", f"throughput_{args.shape}_{args.script}_{tag}")
    cmd = command(args.shape, args.script, model_dir, tok_dir, dataset, run_dir, args.steps, flags)
    result = run_config("throughput", flags, cmd, run_dir, echo=True)
    if result["status"] != "ok":
        sys.exit(1)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][1:]
    if rows and all("completions/total_tokens" in r for r in rows):
        result["completion_tokens"] = sum(r["completions/total_tokens"] for r in rows) / len(rows)
    line = roofline(args.shape, args.script, flags, result, ceilings)
    print("\n" + report(args.shape, args.script, flags, result, ceilings, line), flush=True)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"throughput_{args.shape}_{args.script}.json")
    with open(path, "w") as f:
        json.dump(dict(shape=args.shape, script=args.script, flags=flags, ceilings=ceilings, result=result,
                       roofline=line), f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
