"""Time per decoding step of each --generation_backend, alone (no training), at a model shape.

    python benchmarks/decode_step.py --shape qwen2.5-1.5b                        # 128 rows, 256-token prompts
    python benchmarks/decode_step.py --shape qwen2.5-7b --backends compiled,hf --dtypes bf16
    python benchmarks/decode_step.py --shape tiny --rows 4 --prompt_length 8     # CPU smoke test
    python benchmarks/decode_step.py --backends compiled --dtypes bf16 --profile 12  # + where a step's time goes

A random-weight model of the shape (benchmarks/memory.py's config, SDPA attention) is built on
the device, in bf16 and/or in float32 under bf16 autocast (the scripts' default numerics). Each
backend generates through the scripts' own generate_completions `--short` and `--long` new tokens from the same prompts (after one warm-up
rollout, which compiles and captures); the time per decoding step is the difference divided by
the difference in tokens, so the prefill and the one-off costs drop out. Printed with the
bandwidth floor of one step (weights + the KV cache at the mean context, as benchmarks/
throughput.py computes it) and the memory allocated after the backend's rollouts (cudagraph and
compiled keep their KV cache). With --profile N, the N ops (kernels on a GPU) that take the most
device time in one more `--long` rollout, per decoding step. Writes nothing.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.memory import shape_config
    from benchmarks.throughput import measure_ceilings
    from utils.generation import build_generation_config, generate_completions
    from utils.plan import SHAPES, kv_bytes_per_token, load_shape

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    parser.add_argument("--backends", default="static,cudagraph,compiled,hf")
    parser.add_argument("--dtypes", default="bf16,fp32", help="bf16 weights, and/or float32 weights under bf16 autocast")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--prompt_length", type=int, default=256)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N ops with the most device time in one --long rollout (torch.profiler)")
    args = parser.parse_args(argv)
    if not 0 < args.short < args.long:
        parser.error("--short and --long: 0 < short < long")
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    config = shape_config(args.shape)
    config._attn_implementation = "sdpa"
    shape = load_shape(args.shape)
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size - 2, (args.rows, args.prompt_length), device=device)
    mask = torch.ones_like(ids)
    ceilings = measure_ceilings(on_gpu)
    print(f"device: {ceilings['device']} | {ceilings['bandwidth_gb_s']:.0f} GB/s | shape {args.shape} | "
          f"{args.rows} rows x {args.prompt_length}-token prompts", flush=True)

    def seconds(fn):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for dtype in args.dtypes.split(","):
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        model.eval()
        if dtype != "bf16" and on_gpu:
            model.forward = torch.autocast(device, dtype=torch.bfloat16)(model.forward)  # as accelerate's prepare
        weight_bytes = shape.params * (2 if dtype == "bf16" else 4)  # under autocast the float32 weights are read
        context = args.prompt_length + (args.short + args.long) / 2
        floor_ms = (weight_bytes + args.rows * context * kv_bytes_per_token(shape)) / ceilings["bandwidth_gb_s"] / 1e6
        for backend in args.backends.split(","):
            def rollout(n):  # as the scripts generate; no eos id matches, so every row runs n tokens
                generation_config = build_generation_config(n, 1.0, 1.0, 0, config.pad_token_id, [10**9])
                generate_completions(model, ids, mask, generation_config, [10**9], backend=backend)
            first = seconds(lambda: rollout(args.short))
            short, long = seconds(lambda: rollout(args.short)), seconds(lambda: rollout(args.long))
            step_ms = (long - short) / (args.long - args.short) * 1e3
            allocated = torch.cuda.memory_allocated() / 2**30 if on_gpu else float("nan")
            print(f"{dtype:5s} {backend:10s} {step_ms:7.2f} ms per step vs {floor_ms:.2f} ms floor "
                  f"({floor_ms / step_ms:.0%}) | first rollout {first:.1f} s | allocated after {allocated:.2f} GiB",
                  flush=True)
            if args.profile:
                print_profile(lambda: seconds(lambda: rollout(args.long)), args.profile, args.long, on_gpu)
        model.__dict__.pop("_lean_rl_decoder", None)
        del model
        torch._dynamo.reset()
        if on_gpu:
            torch.cuda.empty_cache()


def print_profile(fn, top, steps, on_gpu):
    """The `top` ops by device time (self time, so a kernel is not counted again in its caller), per decoding step."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        fn()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0] if on_gpu else list(prof.key_averages())
    time_of = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    events.sort(key=time_of, reverse=True)
    total = sum(time_of(e) for e in events) or 1
    print(f"  profile: {total / 1e3 / steps:.2f} ms of {'device' if on_gpu else 'CPU'} time per step "
          f"(prefill included), top {top}:")
    for e in events[:top]:
        print(f"    {time_of(e) / 1e3 / steps:7.3f} ms/step {time_of(e) / total:5.1%} {e.count / steps:6.1f} calls/step  "
              f"{e.key[:100]}")


if __name__ == "__main__":
    main()
