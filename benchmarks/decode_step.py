"""Time per decoding step of each --generation_backend, alone (no training), at a model shape.

    python benchmarks/decode_step.py --shape qwen2.5-1.5b                        # 128 rows, 256-token prompts
    python benchmarks/decode_step.py --shape qwen2.5-7b --backends compiled,hf --dtypes bf16
    python benchmarks/decode_step.py --shape tiny --rows 4 --prompt_length 8     # CPU smoke test
    python benchmarks/decode_step.py --backends compiled --dtypes bf16 --short 400 --long 512 --sdpa
                                                   # attention through SDPA, not the decoding kernel
    python benchmarks/decode_step.py --backends compiled --dtypes fp32 --short 400 --long 512 --generation_copy
                                                   # float32 weights decoded from their bf16 copy (the 1.5b 24GB row);
                                                   # then with --unfused_projections (q/k/v, gate/up as 5 products)
    python benchmarks/decode_step.py --backends compiled --dtypes bf16 --short 400 --long 512 --attention_splits 1
                                                   # the decoding-attention kernel unsplit (one program per row and head)
    python benchmarks/decode_step.py --backends compiled --dtypes fp32 --short 400 --long 512 --generation_copy \
        --max_autotune                             # the step's matrix products autotuned by inductor (side by side)
    python benchmarks/decode_step.py --backends compiled --dtypes bf16 --short 400 --long 512 --profile 12
                                                   # the workload's 768-position cache, and where the time goes
    python benchmarks/decode_step.py --shape qwen2.5-7b --backends compiled --dtypes qlora,lora --rows 32,64,128
                                                   # QLoRA / LoRA as the scripts decode them, by rows per slice
    python benchmarks/decode_step.py --shape qwen2.5-7b --backends compiled --dtypes qlora,qlora_unnested --rows 64
                                                   # --use_bnb_nested_quant false side by side

A random-weight model of the shape (benchmarks/memory.py's config, SDPA attention) is built on
the device, in bf16 and/or in float32 under bf16 autocast (the scripts' default numerics), or as the
scripts load `--use_lora` (lora: bf16 base; qlora: `--load_in_4bit`, bitsandbytes NF4) with an r16
adapter on every Linear, decoding through the unmerged adapter under bf16 autocast (these two are
saved to --cache_dir first and loaded with the scripts' loader). --rows takes a comma list. Each
backend generates through the scripts' own generate_completions `--short` and `--long` new tokens from the same prompts (after one warm-up
rollout, which compiles and captures); the time per decoding step is the difference divided by
the difference in tokens, so the prefill and the one-off costs drop out. Printed with the
bandwidth floor of one step (weights + the KV cache at the mean context, as benchmarks/
throughput.py computes it) and the memory allocated after the backend's rollouts (cudagraph and
compiled keep their KV cache). --short and --long must give one cache length (prompt + new tokens,
rounded up to 128; 256 + 400..512 -> 768, the W-GRPO workload's): a second length would compile and
capture a second step inside the timing. With --profile N, the N kernels that take the most time per
decoding step (one more short and one more long rollout under torch.profiler, differenced like the
step time). Writes nothing.
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
    from utils.base import static_cache_len
    from utils.generation import build_generation_config, generate_completions
    from utils.plan import SHAPES, kv_bytes_per_token, load_shape

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-1.5b", choices=list(SHAPES))
    parser.add_argument("--backends", default="static,cudagraph,compiled,hf")
    parser.add_argument("--dtypes", default="bf16,fp32",
                        help="bf16 weights, float32 weights under bf16 autocast, lora (bf16 base + r16 adapters), "
                             "qlora (NF4 base + r16 adapters), qlora_unnested (the same, --use_bnb_nested_quant false: "
                             "float32 block statistics); comma list")
    parser.add_argument("--rows", default="128", help="rows decoded at once (a generation slice); comma list")
    parser.add_argument("--cache_dir", default="/tmp/lean_rl_bench", help="where lora/qlora's random model is saved")
    parser.add_argument("--prompt_length", type=int, default=256)
    parser.add_argument("--short", type=int, default=16)
    parser.add_argument("--long", type=int, default=80)
    parser.add_argument("--sdpa", action="store_true",
                        help="decoding attention through torch's SDPA instead of utils/decode_attention.py's kernel "
                             "(the default on a CUDA GPU), for a side-by-side run")
    parser.add_argument("--attention_splits", type=int, default=0, metavar="N",
                        help="at most N splits of the positions in the decoding-attention kernel (1: unsplit, as "
                             "before 2026-12-05), for a side-by-side run; default: the kernel's own choice")
    parser.add_argument("--generation_copy", action="store_true",
                        help="decode from the scripts' --generation_copy (a bf16 copy of fp32/LoRA/QLoRA weights; "
                             "bf16 weights are shared, not copied), as generate_completions does")
    parser.add_argument("--unfused_projections", action="store_true",
                        help="with --generation_copy: the copy's q/k/v and gate/up as one product each, not fused "
                             "into one per group (utils/generation.py FUSE_PROJECTIONS, on by default since "
                             "2026-12-05), for a side-by-side run")
    parser.add_argument("--max_autotune", action="store_true",
                        help="the compiled backend's step compiled with inductor's max_autotune (its matrix products "
                             "autotuned over Triton templates and cuBLAS; utils/generation.py DECODE_COMPILE_OPTIONS), "
                             "for a side-by-side run; its first rollout autotunes for minutes (over 4 at 1.5b on an H100)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print the N kernels (ops on a CPU) with the most time per decoding step (torch.profiler)")
    args = parser.parse_args(argv)
    if not 0 < args.short < args.long:
        parser.error("--short and --long: 0 < short < long")
    if args.profile < 0:
        parser.error(f"--profile {args.profile}: the number of kernels to print, 0 (no profile) or more")
    unknown = set(args.dtypes.split(",")) - {"bf16", "fp32", "lora", "qlora", "qlora_unnested"}
    if unknown:
        parser.error(f"--dtypes {args.dtypes}: {', '.join(sorted(unknown))} unknown; bf16, fp32, lora, qlora, "
                     "qlora_unnested")
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows}: a comma list of row counts, e.g. 32,64,128")
    cache = [static_cache_len(args.prompt_length, n) for n in (args.short, args.long)]
    if cache[0] != cache[1]:
        parser.error(f"--short {args.short} and --long {args.long} give static caches of {cache[0]} and {cache[1]} "
                     f"positions after {args.prompt_length}-token prompts: choose both within one multiple of 128")
    if args.attention_splits < 0:
        parser.error(f"--attention_splits {args.attention_splits}: 1 (unsplit) or more, or 0 for the kernel's choice")
    from utils import decode_attention
    if args.sdpa:
        decode_attention.usable = lambda *a: False
    if args.attention_splits:
        decode_attention.MAX_SPLITS = args.attention_splits
    if args.unfused_projections:
        if not args.generation_copy:
            parser.error("--unfused_projections: the copy's projections, so with --generation_copy")
        import utils.generation as generation
        generation.FUSE_PROJECTIONS = False
    if args.max_autotune:
        import utils.generation as generation
        generation.DECODE_COMPILE_OPTIONS = {"max_autotune": True}
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    config = shape_config(args.shape)
    config._attn_implementation = "sdpa"
    shape = load_shape(args.shape)
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
        if dtype in ("lora", "qlora", "qlora_unnested"):
            model = adapted_model(args.shape, dtype, args.cache_dir, device)
        else:
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        model.eval()
        if dtype != "bf16" and on_gpu:
            model.forward = torch.autocast(device, dtype=torch.bfloat16)(model.forward)  # as accelerate's prepare
        # what one step reads: under autocast the float32 weights; NF4 linears at half a byte (their scales left out)
        weight_bytes = (shape.params * 2 if args.generation_copy else
                        shape.linear_params / 2 + (shape.params - shape.linear_params) * 2 if dtype.startswith("qlora")
                        else shape.params * (4 if dtype == "fp32" else 2))
        context = args.prompt_length + (args.short + args.long) / 2
        for rows, backend in [(r, b) for b in args.backends.split(",") for r in row_counts]:
            torch.manual_seed(0)
            ids = torch.randint(0, config.vocab_size - 2, (rows, args.prompt_length), device=device)
            mask = torch.ones_like(ids)
            floor_ms = (weight_bytes + rows * context * kv_bytes_per_token(shape)) / ceilings["bandwidth_gb_s"] / 1e6

            def rollout(n):  # as the scripts generate; no eos id matches, so every row runs n tokens
                generation_config = build_generation_config(n, 1.0, 1.0, 0, config.pad_token_id, [10**9])
                generate_completions(model, ids, mask, generation_config, [10**9], backend=backend,
                                     from_copy=args.generation_copy)
            first = seconds(lambda: rollout(args.short))
            short, long = seconds(lambda: rollout(args.short)), seconds(lambda: rollout(args.long))
            step_ms = (long - short) / (args.long - args.short) * 1e3
            allocated = torch.cuda.memory_allocated() / 2**30 if on_gpu else float("nan")
            print(f"{dtype:14s} {backend:10s} {rows:4d} rows {step_ms:7.2f} ms per step vs {floor_ms:.2f} ms floor "
                  f"({floor_ms / step_ms:.0%}) | first rollout {first:.1f} s | allocated after {allocated:.2f} GiB",
                  flush=True)
            if args.profile:
                print_profile(lambda: rollout(args.short), lambda: rollout(args.long), args.long - args.short,
                              args.profile, on_gpu)
        model.__dict__.pop("_lean_rl_decoder", None)
        copy = model.__dict__.pop("_lean_rl_generation_copy", None)
        if copy is not None:
            copy.__dict__.pop("_lean_rl_decoder", None)
        del model, copy
        torch._dynamo.reset()
        if on_gpu:
            torch.cuda.empty_cache()


def adapted_model(shape, kind, cache_dir, device):
    """The random-weight model of `shape`, saved once under cache_dir and loaded as the scripts load
    --use_lora (lora: bf16; qlora: --load_in_4bit onto `device`; qlora_unnested: with --use_bnb_nested_quant false),
    with r16 adapters on every Linear."""
    from types import SimpleNamespace

    import torch

    from benchmarks.memory import build_model, cached
    from utils.modeling import apply_lora, load_causal_lm

    on_gpu = device == "cuda"
    folder = cached(os.path.join(cache_dir, f"{shape}-{'bf16' if on_gpu else 'fp32'}"),
                    lambda path: build_model(shape, path, on_gpu))
    model = load_causal_lm(folder, SimpleNamespace(pad_token_id=None), torch.bfloat16,
                           quantization={"qlora": "4bit", "qlora_unnested": "4bit_unnested"}.get(kind), device=device)
    if kind == "lora":
        model = model.to(device)
    return apply_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")


def print_profile(short_rollout, long_rollout, steps, top, on_gpu):
    """The `top` kernels (on a CPU: ops) by time per decoding step: each kernel's time in a long rollout
    less its time in a short one, over the difference in steps, so the prefill drops out as it does from
    the step time. Kernels only (not the ops that launched them: those would count the time twice);
    inside a replayed CUDA graph the profiler sees kernels only anyway."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])

    def kernels(fn):
        with torch.no_grad(), profile(activities=activities) as prof:
            fn()
            if on_gpu:
                torch.cuda.synchronize()
        if on_gpu:
            return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
                    if e.device_type == DeviceType.CUDA}
        return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages()}

    short, long = kernels(short_rollout), kernels(long_rollout)
    per_step = {key: ((us - short.get(key, (0, 0))[0]) / steps, (count - short.get(key, (0, 0))[1]) / steps)
                for key, (us, count) in long.items()}
    total = sum(max(us, 0) for us, _ in per_step.values())
    print(f"  profile: {total / 1e3:.3f} ms of {'kernel' if on_gpu else 'CPU op'} time per decoding step, top {top}:")
    for key, (us, count) in sorted(per_step.items(), key=lambda item: -item[1][0])[:top]:
        print(f"    {us / 1e3:7.3f} ms {us / total:5.1%} {count:5.1f} per step  {key[:110]}")


if __name__ == "__main__":
    main()
