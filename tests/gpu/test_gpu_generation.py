"""--generation_backend static / cudagraph / compiled on a GPU (skipped without CUDA): greedy
tokens equal `generate` in float32 (also on the replayed graph's second rollout), every replay
draws fresh random numbers, memory stays near the KV cache, and a script trains with each."""
import pytest
import torch

from gpu_fixtures import QWEN_7B_DECODE_MATRICES, local_model  # noqa: F401 (fixture)
from helpers import metrics_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


MODES = ["eager", "cudagraph", "compiled"]


def _small_model_and_prompts(initializer_range=0.3):
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils import toy

    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=initializer_range, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda().eval()
    enc = tokenizer(["1+2=", "12+34=", "7+7=", "100+1="], return_tensors="pt", padding=True, padding_side="left")
    return model, tokenizer.pad_token_id, enc["input_ids"].cuda(), enc["attention_mask"].cuda()


@pytest.mark.parametrize("step_mode", MODES)
def test_greedy_tokens_equal_generate_on_gpu(step_mode):
    """Twice: the second rollout (other prompts, same shape) replays the kept graph into the
    emptied cache."""
    from transformers import GenerationConfig

    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    no_eos = [10**9]
    for prompts in [(ids, mask), (ids.flip(0), mask.flip(0))]:
        ours = static_cache_generate(model, *prompts, 48, 1.0, 1.0, 0, no_eos, pad, step_mode=step_mode, greedy=True)
        reference = model.generate(input_ids=prompts[0], attention_mask=prompts[1], generation_config=GenerationConfig(
            max_new_tokens=48, do_sample=False, pad_token_id=pad, eos_token_id=no_eos))[:, ids.shape[1]:]
        assert ours.shape == reference.shape and len(set(ours.flatten().tolist())) > 3
        agree = (ours == reference).float().mean().item()
        print(f"\n{step_mode}: {agree:.1%} of greedy tokens equal generate's")
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("step_mode", MODES)
def test_prefill_in_chunks_gives_the_same_greedy_tokens_and_a_smaller_peak_on_gpu(step_mode):
    """--prefill_chunk_size 32 over 64 rows of 256 prompt positions (float32): the greedy tokens equal the
    one-forward prefill's, and the rollout's peak above what was allocated before it is smaller (the
    prefill's MLP activations come 32 positions at a time); prints both peaks and times."""
    import time

    from utils.generation import static_cache_generate

    model, pad, _, _ = _small_model_and_prompts()
    torch.manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (64, 256), device="cuda")
    mask = torch.ones_like(ids)
    mask[::2, :100] = 0  # left padding on half the rows
    results = {}
    for chunk in (None, 32):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = static_cache_generate(model, ids, mask, 16, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                    greedy=True, prefill_chunk_size=chunk)
        torch.cuda.synchronize()
        results[chunk] = (out, (torch.cuda.max_memory_allocated() - base) / 2**20, time.perf_counter() - start)
        model.__dict__.pop("_lean_rl_decoder", None)
    print(f"\n{step_mode}: peak above the weights {results[None][1]:.1f} -> {results[32][1]:.1f} MiB with chunks of 32; "
          f"{results[None][2]:.2f} -> {results[32][2]:.2f} s (the first includes any compiling)")
    assert torch.equal(results[32][0], results[None][0])
    assert results[32][1] < results[None][1]


@pytest.mark.parametrize("step_mode", MODES)
def test_fp8_kv_cache_on_gpu_halves_the_cache_and_keeps_the_first_greedy_token(step_mode):
    """--kv_cache_dtype fp8 in each step mode (bf16 weights, 64 rows x 256 prompt positions): the first
    greedy token equals the bf16 cache's on at least 95% of rows (a near tie may flip; later tokens part
    after a flip), the kept cache is about
    half the bytes (the captured modes keep it), and the time per rollout is printed beside bf16's.
    The model has transformers' default initializer_range (0.02), not the 0.3 of the other tests: at
    0.3 a float32 cache against a bf16 one already flips 14% of first tokens (measured on CPU), so no
    cache error could be told from the model's own chaos; at 0.02 float32 and fp8 agree with bf16 on
    every first token and a cache that halved its values agreed on 20% (CPU, 2026-12-01)."""
    import time
    import warnings

    from utils.generation import static_cache_generate

    model, pad, _, _ = _small_model_and_prompts(initializer_range=0.02)
    model = model.to(torch.bfloat16)
    torch.manual_seed(2)
    ids = torch.randint(5, model.config.vocab_size, (64, 256), device="cuda")
    mask = torch.ones_like(ids)
    out, kept, seconds = {}, {}, {}
    for dtype in ("auto", "fp8"):
        model.__dict__.pop("_lean_rl_decoder", None)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        for _ in range(2):  # the second rollout replays what the first compiled and captured
            start = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out[dtype] = static_cache_generate(model, ids, mask, 32, 1.0, 1.0, 0, [10**9], pad,
                                                   step_mode=step_mode, greedy=True, kv_cache_dtype=dtype)
            # compiled must compile the fp8 cache's codes, not fall back to an uncompiled step
            assert not [w for w in caught if "torch.compile failed" in str(w.message)], caught[0].message
            torch.cuda.synchronize()
            seconds[dtype] = time.perf_counter() - start
        kept[dtype] = (torch.cuda.memory_allocated() - base) / 2**20
    model.__dict__.pop("_lean_rl_decoder", None)
    agree = (out["fp8"] == out["auto"]).float().mean().item()
    print(f"\n{step_mode}: fp8 cache {kept['fp8']:.1f} MiB kept vs {kept['auto']:.1f}; rollout {seconds['fp8']:.3f} s "
          f"vs {seconds['auto']:.3f}; {agree:.0%} of greedy tokens equal")
    assert (out["fp8"][:, 0] == out["auto"][:, 0]).float().mean().item() >= 0.95
    if step_mode != "eager":
        assert kept["fp8"] < 0.6 * kept["auto"]


@pytest.mark.parametrize("step_mode", MODES)
def test_every_replayed_step_draws_new_random_numbers(step_mode):
    """At a huge temperature every token is (nearly) uniform over the vocabulary: a graph that
    replayed the same random numbers would repeat one token per row at every step."""
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    out = static_cache_generate(model, ids, mask, 64, 1e6, 1.0, 0, [10**9], pad, step_mode=step_mode)
    distinct_per_row = [len(set(row.tolist())) for row in out]
    print(f"\n{step_mode}: distinct tokens per row of 64: {distinct_per_row}")
    assert min(distinct_per_row) > 20, distinct_per_row


@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_the_same_seed_samples_the_same_tokens_whether_or_not_the_step_was_captured_before(step_mode):
    """A shape's first capture warms up 3 times, later ones once (_CAPTURED_BEFORE); the warm-ups draw random numbers.
    Their draws are put back after the capture, so with one seed the first rollout (3 warm-ups), one from a decoder
    captured again (1 warm-up) and one replaying the kept graph sample the same tokens (before the fork the first two
    differed: test_in_place_copy_in_a_captured_step_on_gpu failed at 0.021 of its tokens equal)."""
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    rollouts = []
    for keep in (True, False, True):
        torch.manual_seed(5)
        rollouts.append(static_cache_generate(model, ids, mask, 32, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode))
        if not keep:
            model.__dict__.pop("_lean_rl_decoder", None)  # the next rollout captures its step again
    assert len(set(rollouts[0].flatten().tolist())) > 3
    assert torch.equal(rollouts[0], rollouts[1]) and torch.equal(rollouts[1], rollouts[2])


@pytest.mark.parametrize("backend", ["static", "cudagraph", "compiled"])
def test_grpo_trains_with_the_backend_on_gpu(run, tmp_path, local_model, backend):
    result = run(["--model_name_or_path", local_model, "--max_steps", "3", "--prompts_per_step", "8",
                  "--num_generations", "4", "--max_completion_length", "32", "--generation_backend", backend,
                  "--output_dir", str(tmp_path), "--save_strategy", "no"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert len(rows) == 3 and "needs a GPU" not in result.stderr
    print(f"\n{backend}: generate {rows[-1]['time/generate']:.2f} s, step {rows[-1]['time/step']:.2f} s")


@pytest.mark.parametrize("step_mode", MODES)
def test_generation_memory_and_step_time_on_gpu(step_mode):
    """A 32k vocabulary, 128 rows x 256 prompt tokens under bf16 autocast over float32 weights, as
    the scripts generate: the loop's peak above the weights stays near the static KV cache (the
    prefill once built [B, P, V] float32 logits, 4.2 GB here; the compiled loop then held every
    step's output), and prints the time per decoding step against `generate`'s."""
    import time

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from utils.generation import static_cache_generate

    config = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda().eval()
    model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)  # as accelerate's prepare does
    ids = torch.randint(1, 32000, (128, 256), device="cuda")
    mask, steps = torch.ones_like(ids), 128
    kv_bytes = 2 * 8 * 128 * (256 + steps) * 2 * 64 * 2  # keys + values, layers, rows, positions, kv heads x dim, bf16
    timings = {}
    for name in ("ours", "generate"):
        for _ in range(2):  # the second run is timed (the first compiles)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start = time.perf_counter()
            with torch.no_grad():
                if name == "ours":
                    static_cache_generate(model, ids, mask, steps, 1.0, 1.0, 0, [10**9], 0, step_mode=step_mode)
                else:
                    model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(
                        max_new_tokens=steps, min_new_tokens=steps, do_sample=True, pad_token_id=0))
            torch.cuda.synchronize()
            timings[name] = ((time.perf_counter() - start) / steps * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30)
    ours, theirs = timings["ours"], timings["generate"]
    print(f"\n{step_mode}: {ours[0]:.2f} ms per step, peak +{ours[1]:.2f} GiB | "
          f"generate: {theirs[0]:.2f} ms, +{theirs[1]:.2f} GiB | KV cache {kv_bytes / 2**30:.2f} GiB")
    assert ours[1] < 3 * kv_bytes / 2**30 + 1.0, timings


def test_captured_step_reads_the_refreshed_generation_copy():
    """--generation_copy with a captured step: the policy changes, the copy is refreshed in place,
    and the replayed graph (kept from the first rollout) decodes with the new weights: its greedy
    tokens equal an eager rollout of the refreshed copy."""
    from utils.generation import generation_copy, static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    copy = generation_copy(model)
    before = static_cache_generate(copy, ids, mask, 24, 1.0, 1.0, 0, [10**9], pad, step_mode="cudagraph", greedy=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert generation_copy(model) is copy
    after = static_cache_generate(copy, ids, mask, 24, 1.0, 1.0, 0, [10**9], pad, step_mode="cudagraph", greedy=True)
    eager = static_cache_generate(copy, ids, mask, 24, 1.0, 1.0, 0, [10**9], pad, step_mode="eager", greedy=True)
    assert not torch.equal(before, after) and torch.equal(after, eager)


def test_building_the_generation_copy_on_gpu_allocates_only_its_own_tensors():
    """The copy built on the meta device: a bf16 policy's copy (every weight the policy's) raises the allocator's
    peak by no weight while it is built (built on the GPU, it held a whole bf16 model for a moment: the 7b runs'
    +4.2 GiB in generation); a float32 tied policy's copy by one bf16 copy of its weights, the tied head once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils.generation import generation_copy

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to("cuda", dtype)
        bf16_bytes = 2 * sum(p.numel() for p in model.parameters())  # a tied weight once
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        copy = generation_copy(model)
        torch.cuda.synchronize()
        above, kept = torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start
        print(f"\n{dtype}: weights {bf16_bytes / 2**20:.0f} MiB in bf16; building the copy: peak +{above / 2**20:.1f} "
              f"MiB, kept +{kept / 2**20:.1f} MiB")
        if dtype == torch.bfloat16:
            assert above < bf16_bytes / 100
        else:
            assert copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()
            # one bf16 copy (H200: 239.0 MiB kept for 234.5 MiB of weights, the allocator's rounding), plus one
            # fused group at a time (q/k/v, gate/up) held twice while it is made (peak +250.5 MiB)
            assert 0.99 * bf16_bytes <= kept <= 1.05 * bf16_bytes and above <= 1.1 * bf16_bytes
        del model, copy




@pytest.mark.parametrize("rows", [1, 7, 64, 128])
def test_int8_kernel_matches_converted_matmul_and_prints_its_time(rows):
    """utils/int8.py's Triton kernel, at every split of K it may choose, against the codes converted to bf16 and
    multiplied by torch (its fallback), at 7b's decoding shapes and row counts: equal up to bf16 summation order.
    Each shape is timed in a CUDA graph beside a bf16 F.linear of the same matrix, and a 7b decoding step's
    matrix products summed (printed, not asserted)."""
    import torch.nn.functional as F

    from gpu_fixtures import graph_microseconds as timed
    from utils import int8
    from utils.int8 import int8_linear, quantize_rows, split_candidates

    torch.manual_seed(rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step_int8 = step_bf16 = 0.0
    for name, (n, k, count) in {**QWEN_7B_DECODE_MATRICES, "lm_head": (152064, 3584, 1 / 28)}.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        codes, scale = quantize_rows(weight)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        reference = (F.linear(x, codes.to(torch.bfloat16)) * scale).float()
        ours = int8_linear(x, codes, scale).float()  # defines the kernel, chooses the split
        for split in split_candidates(n, k, sms):
            forced = int8.LAUNCH[0](x, codes, scale, split).float()
            error = ((forced - reference).norm() / reference.norm()).item()
            assert error < 1e-2, (name, split, error)
        error = ((ours - reference).norm() / reference.norm()).item()
        assert error < 1e-2, (name, error)
        chosen = int8._SPLITS[(int8.block_rows(rows), n, k)]
        t_int8, t_bf16 = timed(lambda: int8_linear(x, codes, scale)), timed(lambda: F.linear(x, weight))
        step_int8, step_bf16 = step_int8 + 28 * count * t_int8, step_bf16 + 28 * count * t_bf16
        print(f"\nrows {rows} {name} [{n} x {k}]: int8 kernel {t_int8:.1f} us (split {chosen}), bf16 {t_bf16:.1f} us, "
              f"floor {n * k / 4.8e6:.1f} us; relative difference {error:.2e}")
    print(f"rows {rows}: a 7b decoding step's matrix products: int8 {step_int8 / 1e3:.2f} ms, "
          f"bf16 {step_bf16 / 1e3:.2f} ms (ratio {step_bf16 / step_int8:.2f})")


@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_int8_copy_in_a_captured_step_follows_the_policy_on_gpu(step_mode):
    """--generation_copy_dtype int8 in a captured step: the greedy tokens mostly equal the bf16 copy's, follow
    the policy after a refresh in place, and equal the int8 copy's eager ones (cudagraph: the same kernels;
    compiled: the first tokens mostly)."""
    from utils.generation import generation_copy, static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts(initializer_range=0.02)
    bf16 = static_cache_generate(generation_copy(model), ids, mask, 16, 1.0, 1.0, 0, [10**9], pad,
                                 step_mode="eager", greedy=True)
    model.__dict__.pop("_lean_rl_generation_copy")
    copy = generation_copy(model, "int8")
    before = static_cache_generate(copy, ids, mask, 16, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode, greedy=True)
    assert (before[:, 0] == bf16[:, 0]).float().mean() >= 0.75
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert generation_copy(model, "int8") is copy
    after = static_cache_generate(copy, ids, mask, 16, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode, greedy=True)
    eager = static_cache_generate(copy, ids, mask, 16, 1.0, 1.0, 0, [10**9], pad, step_mode="eager", greedy=True)
    assert not torch.equal(before, after)
    if step_mode == "cudagraph":  # the same kernels replayed
        assert torch.equal(after, eager)
    else:  # inductor fuses the scale, bias and norms: other rounding, a near tie may flip a first token
        assert (after[:, 0] == eager[:, 0]).float().mean() >= 0.75


@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_in_place_copy_in_a_captured_step_on_gpu(step_mode):
    """--generation_copy_in_place on a GPU: sampled tokens (same seed) of a captured step equal the usual bf16 copy's (the
    same weights: the merged base), a second rollout after an adapter update replays the kept graph over the
    merged-again base, the exact base comes back from pinned memory after each rollout, and the rollout holds
    no copy of the weights (allocated memory during it stays within the KV cache's of the adapter-free one)."""
    from transformers import GenerationConfig

    from utils.generation import generate_completions
    from utils.modeling import apply_lora

    model, pad, ids, mask = _small_model_and_prompts(initializer_range=0.02)
    model.to(torch.bfloat16)
    for module in model.modules():  # RoPE's frequencies in float32, as from_pretrained(dtype=bf16) keeps them
        if hasattr(module, "inv_freq"):
            module.inv_freq = module.inv_freq.float()
    policy = apply_lora(model, r=8, alpha=16, dropout=0.0, target_modules="all-linear")
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.05)
    base = policy.get_base_model()
    before = {n: p.detach().clone() for n, p in base.named_parameters() if "lora_" not in n}
    config = GenerationConfig(max_new_tokens=24, do_sample=True, temperature=1.0, pad_token_id=pad,
                              eos_token_id=[10**9])

    def rollout(in_place):
        torch.manual_seed(3)  # the same draws: the same tokens where the weights and kernels are the same
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = generate_completions(policy, ids, mask, config, [10**9], backend=step_mode, from_copy=True,
                                   copy_in_place=in_place, keep_decoder=True)[0]
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - start

    usual, usual_bytes = rollout(False)
    policy.__dict__.pop("_lean_rl_generation_copy"), policy.__dict__.pop("_lean_rl_decoder", None)
    in_place, in_place_bytes = rollout(True)
    print(f"\n{step_mode}: tokens equal to the usual copy's: {(in_place == usual).float().mean().item():.3f}")
    if step_mode == "cudagraph":  # the same kernels replayed over the same bf16 weights
        assert torch.equal(in_place, usual)
    else:  # compiled again for the new copy: the same graph, near ties aside
        assert (in_place == usual).float().mean() >= 0.9
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters() if n in before)
    weights = sum(p.numel() * 2 for n, p in base.named_parameters() if n in before)
    print(f"\n{step_mode}: rollout peak above start: usual copy {usual_bytes / 2**20:.1f} MiB, in place "
          f"{in_place_bytes / 2**20:.1f} MiB (weights {weights / 2**20:.1f} MiB)")
    assert in_place_bytes < usual_bytes - 0.8 * weights
    copy = policy.__dict__["_lean_rl_generation_copy"]
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)
    again, _ = rollout(True)
    assert policy.__dict__["_lean_rl_generation_copy"] is copy and not torch.equal(again, in_place)
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters() if n in before)


def test_grpo_trains_qlora_from_an_int8_copy_on_gpu(run, tmp_path, local_model):
    result = run(["--model_name_or_path", local_model, "--max_steps", "2", "--prompts_per_step", "8",
                  "--num_generations", "4", "--max_completion_length", "32", "--use_lora", "--load_in_4bit",
                  "--generation_copy", "--generation_copy_dtype", "int8", "--generation_backend", "compiled",
                  "--output_dir", str(tmp_path), "--save_strategy", "no"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert len(rows) == 2 and all(r["optim/grad_norm"] > 0 for r in rows)


def test_qlora_with_float32_statistics_trains_and_decodes_on_gpu(run, tmp_path, local_model):
    """--use_bnb_nested_quant false on a GPU: the 4-bit weights load with float32 statistics (no double
    quantisation) onto the GPU, and a QLoRA run decoding through bitsandbytes' products in the compiled step
    trains."""
    from types import SimpleNamespace

    from utils.modeling import load_causal_lm

    model = load_causal_lm(local_model, SimpleNamespace(pad_token_id=None), torch.bfloat16,
                           quantization="4bit_unnested", device="cuda")
    state = model.model.layers[0].mlp.down_proj.weight.quant_state
    assert not state.nested and state.absmax.dtype == torch.float32 and state.absmax.is_cuda
    del model
    result = run(["--model_name_or_path", local_model, "--max_steps", "2", "--prompts_per_step", "8",
                  "--num_generations", "4", "--max_completion_length", "32", "--use_lora", "--load_in_4bit",
                  "--use_bnb_nested_quant", "false", "--generation_backend", "compiled",
                  "--output_dir", str(tmp_path), "--save_strategy", "no"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert len(rows) == 2 and all(r["optim/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("quantised", [False, True, "in_place"], ids=["lora", "qlora", "lora_in_place"])
def test_grpo_trains_lora_generating_from_the_copy_on_gpu(run, tmp_path, local_model, quantised):
    result = run(["--model_name_or_path", local_model, "--max_steps", "3", "--prompts_per_step", "8",
                  "--num_generations", "4", "--max_completion_length", "32", "--use_lora", "--generation_copy",
                  "--generation_backend", "compiled", "--output_dir", str(tmp_path), "--save_strategy", "no"]
                 + (["--torch_dtype", "bfloat16", "--generation_copy_in_place"] if quantised == "in_place" else
                    ["--load_in_4bit"] if quantised else []))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert len(rows) == 3 and all(r["optim/grad_norm"] > 0 for r in rows)
    print(f"\n{'LoRA in place' if quantised == 'in_place' else 'QLoRA' if quantised else 'LoRA'} + copy: generate {rows[-1]['time/generate']:.2f} s, "
          f"step {rows[-1]['time/step']:.2f} s")


@pytest.mark.parametrize("backend", ["cudagraph", "compiled"])
def test_dropped_decoder_gives_its_memory_back_on_gpu(backend):
    """--empty_cache_between_phases (keep_decoder=False): after each rollout the KV cache and the
    graph are freed, so allocated memory stays level from rollout to rollout (what stays is
    cuBLAS's per-stream workspaces, allocated once) and below what a kept decoder holds. On the
    H200 the first version grew by 32 MiB per rollout (a new warm-up stream per capture, each with
    its own cuBLAS workspace): cudagraph [96, 128, 160] MiB, compiled [20.8, 52.8, 84.8]."""
    from utils.generation import build_generation_config, generate_completions

    model, pad, ids, mask = _small_model_and_prompts()
    config = build_generation_config(48, 1.0, 1.0, 0, pad, [10**9])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    left = []
    for _ in range(3):
        generate_completions(model, ids, mask, config, [10**9], backend=backend, keep_decoder=False)
        torch.cuda.synchronize()
        left.append((torch.cuda.memory_allocated() - base) / 2**20)
    kept = generate_completions(model, ids, mask, config, [10**9], backend=backend)  # noqa: F841
    held = (torch.cuda.memory_allocated() - base) / 2**20
    print(f"\n{backend}: MiB left after each dropped rollout {[round(x, 2) for x in left]}; kept decoder {held:.2f} MiB")
    assert max(left) - min(left) < 0.5 and held - left[0] > 1


@pytest.mark.parametrize("backend", ["static", "cudagraph", "compiled"])
def test_generation_slice_size_slices_give_each_row_its_own_completion_on_gpu(backend):
    """--generation_slice_size on a GPU: slices of similar prompt length (each trimmed of the left
    padding its rows share, so the captured backends capture a graph per slice shape) give every
    row the greedy-like completion (temperature 1e-4) it gets in one batch, in the rows' order."""
    from utils import toy
    from utils.generation import build_generation_config, generate_completions

    model, pad, _, _ = _small_model_and_prompts()
    tokenizer = toy.build_tokenizer()
    enc = tokenizer(["1+2=", "123+456=", "7=", "10+1=", "99+99+99=", "5+5="], return_tensors="pt", padding=True,
                    padding_side="left")
    ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
    config = build_generation_config(24, 1e-4, 1.0, 0, pad, [10**9])
    torch.manual_seed(0)
    whole = generate_completions(model, ids, mask, config, [10**9], backend=backend)[0]
    sliced = generate_completions(model, ids, mask, config, [10**9], batch_size=2, backend=backend)[0]
    agree = (sliced == whole).float().mean().item()
    print(f"\n{backend}: sliced rows equal the whole batch's on {agree:.1%} of tokens")
    assert len({tuple(row) for row in whole.tolist()}) > 3 and torch.equal(sliced, whole)


@pytest.mark.parametrize("shape", ["qwen2.5-7b", "qwen2.5-1.5b"])
def test_decode_attention_matches_sdpa_reads_only_kept_positions_and_prints_its_time(shape):
    """utils/decode_attention.py's kernel against SDPA (the packed grouped-query product with the step's mask)
    at the shape's heads, 128 rows (some left-padded) and the W-GRPO 768-position cache, at three decoding
    positions: equal up to bf16 rounding, with every position past the current one poisoned with NaN (the
    kernel never reads it). Timed in a CUDA graph against SDPA at the rollout's mean position, with a few
    launch configurations (printed, not asserted)."""
    import time

    from utils import decode_attention
    from utils.plan import SHAPES

    config = SHAPES[shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    rows, length, prompt = 128, 768, 256
    assert decode_attention.ready()
    torch.manual_seed(0)
    query = torch.randn(rows, kv_heads, heads // kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(rows, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16)
    scale = dim ** -0.5

    def keep_at(position):
        keep = torch.zeros(rows, length, dtype=torch.bool, device="cuda")
        keep[:, :position + 1] = True
        keep[::3, :17] = False  # left padding on every third row
        return keep

    for position in (prompt, prompt + 255, length - 1):
        keep = keep_at(position)
        want = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=keep[:, None, None, :],
                                                                scale=scale).float()
        poisoned_key, poisoned_value = key.clone(), value.clone()
        poisoned_key[:, :, position + 1:] = float("nan")
        poisoned_value[:, :, position + 1:] = float("nan")
        unsplit = None
        for block, warps, stages, splits in [(None, None, None, None), (32, 4, 2, 1), (128, 8, 3, 1), (32, 4, 3, 1),
                                             (32, 4, 3, 2), (32, 4, 3, 8), (64, 4, 3, 4)]:
            ours = decode_attention.LAUNCH[0](query, poisoned_key, poisoned_value, keep.view(torch.uint8), scale,
                                              block, warps, stages, splits).float()
            assert torch.isfinite(ours).all()
            error = (ours - want).abs().max().item()
            assert error < 2e-2, (position, block, splits, error)
            if (block, splits) == (32, 1):
                unsplit = ours
            elif block == 32:  # the split's combine: float32 sums in another order, then one bf16 rounding
                assert (ours - unsplit).abs().max().item() <= 1.6e-2 * unsplit.abs().max().item(), (position, splits)
        op = decode_attention.decode_attention(query, poisoned_key, poisoned_value, keep, scale).float()
        assert (op - want).abs().max().item() < 2e-2

    def graph_us(fn, calls=28):  # one decoding step's layers
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / (20 * calls) * 1e6

    keep = keep_at(prompt + 256)  # the rollout's mean position
    mask4 = keep[:, None, None, :]
    sdpa = graph_us(lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask4,
                                                                             scale=scale))
    keep_u8 = keep.view(torch.uint8)
    times = {}
    for block in (32, 64):
        for warps in (4, 8):
            for splits in (1, 2, 4, 8):
                times[(block, warps, 3, splits)] = graph_us(
                    lambda: decode_attention.LAUNCH[0](query, key, value, keep_u8, scale, block, warps, 3, splits))
    chosen = graph_us(lambda: decode_attention.LAUNCH[0](query, key, value, keep_u8, scale))
    default = decode_attention.default_splits(rows * kv_heads, query.device)
    unsplit = times[(decode_attention.BLOCK_N, decode_attention.NUM_WARPS, decode_attention.NUM_STAGES, 1)]
    best = min(times, key=times.get)
    kv_bytes = 2 * rows * kv_heads * (prompt + 257) * dim * 2
    print(f"\n{shape} ({rows} rows, {kv_heads} kv heads x {heads // kv_heads}, position {prompt + 256} of {length}, "
          f"{torch.cuda.get_device_name()}): SDPA {sdpa:.1f} us a layer, the kernel {chosen:.1f} us as configured "
          f"({default} splits; unsplit {unsplit:.1f}; best {times[best]:.1f} at block, warps, stages, splits {best}); "
          f"the kept keys and values {kv_bytes / 1e6:.1f} MB: {kv_bytes / chosen / 1e3:.0f} GB/s; a 28-layer step "
          f"{28 * (sdpa - chosen) / 1e3:.2f} ms shorter than SDPA's, {28 * (unsplit - chosen) / 1e3:.2f} than unsplit")
    print("  " + ", ".join(f"{k}: {v:.1f}" for k, v in sorted(times.items())))


def _assert_as_greedy(referee, ids, mask, ours, theirs, label, ours_name, theirs_name):
    """Two greedy rollouts of the same prompts, judged by one referee (a full forward over prompt + completion, no
    cache): a rounding difference may flip a near tie and the rollouts then part ways, so their tokens are not
    compared one by one; the first token is, and `ours` must be about as greedy by the referee (its largest logit
    minus the chosen token's, per generated token) as `theirs`."""
    def gaps(tokens):
        with torch.no_grad():
            logits = referee(input_ids=torch.cat([ids, tokens], dim=1),
                             attention_mask=torch.cat([mask, torch.ones_like(tokens)], dim=1)).logits
        logits = logits[:, ids.shape[1] - 1:-1].float()
        return logits.max(-1).values - logits.gather(-1, tokens[..., None]).squeeze(-1)

    ours_gap, theirs_gap = gaps(ours), gaps(theirs)
    print(f"\n{label}: {(ours == theirs).float().mean():.1%} of greedy tokens equal {theirs_name}'s; the referee's "
          f"logit gap mean/max: {ours_name} {ours_gap.mean():.4f}/{ours_gap.max():.3f}, {theirs_name} "
          f"{theirs_gap.mean():.4f}/{theirs_gap.max():.3f}")
    assert torch.equal(ours[:, 0], theirs[:, 0])
    assert ours_gap.mean() <= 2 * theirs_gap.mean() + 0.02 and ours_gap.max() <= 2 * theirs_gap.max() + 0.1


@pytest.mark.parametrize("policy", ["bf16", "float32_autocast"])
@pytest.mark.parametrize("step_mode", ["eager", "cudagraph", "compiled"])
def test_decode_attention_in_the_decoding_step_keeps_the_greedy_tokens_on_gpu(step_mode, policy, monkeypatch):
    """A bf16 model's greedy rollout through the kernel (it is called; compiled: no fallback to the uncompiled
    step) and the same rollout with SDPA forced, each judged by one referee: the model's full forward over
    prompt + completion (SDPA, no cache), where a greedy token should hold the largest logit. A rounding
    difference may flip a near tie and the two rollouts then part ways, so their tokens are not compared one
    by one; the first token is, and the kernel's rollout must be as greedy by the referee as SDPA's.
    float32_autocast: a float32 model decoding under bf16 autocast (the default numerics without a generation
    copy), whose query RoPE leaves float32 beside the cache's bf16 keys: cast to bf16 (as autocast casts SDPA's
    inputs), the kernel takes the step (before 2026-12-07 SDPA took it)."""
    import warnings
    from contextlib import nullcontext

    from utils import decode_attention
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    if policy == "bf16":
        model = model.to(torch.bfloat16)
    numerics = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if policy == "float32_autocast" else nullcontext
    calls = []
    real = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention", lambda *a: calls.append(1) or real(*a))
    with warnings.catch_warnings(record=True) as caught, numerics():
        warnings.simplefilter("always")
        ours = static_cache_generate(model, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                     greedy=True)
    assert calls and not [w for w in caught if "torch.compile failed" in str(w.message)]
    model.__dict__.pop("_lean_rl_decoder", None)
    monkeypatch.setattr(decode_attention, "usable", lambda *a: False)
    with numerics():
        sdpa = static_cache_generate(model, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                     greedy=True)

    _assert_as_greedy(model, ids, mask, ours, sdpa, f"{policy}, {step_mode}", "kernel", "SDPA")


@pytest.mark.parametrize("prefill", ["fused", "own_products"])
@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_fused_projections_of_the_generation_copy_on_gpu(step_mode, prefill, monkeypatch):
    """A float32 policy's bf16 generation copy with q/k/v and gate/up fused (utils/generation.py
    _fuse_projections) against the same copy unfused: the full forward's logits within bf16 rounding, and a
    greedy rollout in the captured step (compiled: without falling back) whose first token is the unfused
    copy's on every row, and no less greedy by a referee (the unfused copy's full forward) than its own.
    prefill="own_products": FUSE_MAX_TOKENS under the prompts' token count, so the full forward and the
    prefill take each projection's own product (the branch a prefill of more than 1024 tokens takes) and the
    decoding steps the fused one."""
    import warnings

    import utils.generation as generation
    from utils.generation import generation_copy, static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    if prefill == "own_products":
        monkeypatch.setattr(generation, "FUSE_MAX_TOKENS", ids.numel() - 1)
    monkeypatch.setattr(generation, "FUSE_PROJECTIONS", True)  # the default since 2026-12-05
    fused = generation_copy(model)
    assert type(fused.model.layers[0].self_attn.q_proj).__name__ == "_GroupFirst"
    model.__dict__.pop("_lean_rl_generation_copy")
    monkeypatch.setattr(generation, "FUSE_PROJECTIONS", False)
    plain = generation_copy(model)
    with torch.no_grad():
        a, b = (m(input_ids=ids, attention_mask=mask).logits.float() for m in (fused, plain))
    print(f"\n{step_mode}: logits max difference {(a - b).abs().max():.2e} (max |logit| {b.abs().max():.1f})")
    assert (a - b).abs().max() <= 2e-2 * b.abs().max()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = static_cache_generate(fused, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode, greedy=True)
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    theirs = static_cache_generate(plain, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode, greedy=True)

    _assert_as_greedy(plain, ids, mask, ours, theirs, step_mode, "fused", "the unfused copy")


def test_max_autotune_decoding_step_keeps_the_greedy_tokens_on_gpu(monkeypatch):
    """DECODE_COMPILE_OPTIONS = {"max_autotune": True} (benchmarks/decode_step.py --max_autotune): the compiled
    step compiles with it (no fallback to the uncompiled step) and its greedy rollout is as greedy, by the model's
    full forward, as the same rollout compiled with inductor's defaults (the first token equal on every row)."""
    import warnings

    import utils.generation as generation
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    rollouts = []
    for options in (None, {"max_autotune": True}):
        monkeypatch.setattr(generation, "DECODE_COMPILE_OPTIONS", options)
        model.__dict__.pop("_lean_rl_decoder", None)  # compiled and captured again with these options
        torch._dynamo.reset()  # the forward's code compiled afresh, not served from the first compile
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rollouts.append(static_cache_generate(model, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad,
                                                  step_mode="compiled", greedy=True))
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    _assert_as_greedy(model, ids, mask, rollouts[1], rollouts[0], "compiled", "max_autotune", "the defaults")


def test_qlora_rollout_runs_o_proj_and_the_prefill_lm_head_as_one_matrix_product_on_gpu(local_model, monkeypatch):
    """A QLoRA model's rollout through the compiled decoding step, run without its CUDA graph so that the profiler
    sees each op with its shapes: bitsandbytes' 4-bit product of o_proj after the packed attention, and the
    prefill's LM head, are one matrix product each, not a batched product of one row each over the weight
    broadcast (before 43ac109, o_proj's: 7b, 64 rows, 218 us a layer against ~9, H100). tests/test_generation.py
    checks the same on a CPU."""
    from helpers import one_row_batched_products
    from utils import generation

    monkeypatch.setattr(generation, "CAPTURED_BACKENDS", ())  # the step uncaptured: each op seen with its shapes
    one_row, quantised = one_row_batched_products(local_model, "cuda")
    assert quantised and not one_row, one_row[:3]


@pytest.mark.parametrize("shape", ["qwen2.5-7b", "qwen2.5-1.5b"])
def test_shared_prompt_attention_matches_sdpa_over_the_gathered_prompts_and_prints_its_time(shape):
    """--share_prompt_cache's kernel (utils/decode_attention.py launch_shared): 128 rows in groups of 8 over 16
    prompts of 256 positions (some left-padded) and their own 512 completion positions, against SDPA over each row's
    prompt gathered and laid before its completion: equal up to bf16 rounding, with every unkept completion position
    poisoned with NaN (never read). Timed in a CUDA graph against the unshared kernel over the same rows' 768-position
    cache at the rollout's mean position (printed, not asserted)."""
    from utils import decode_attention
    from utils.int8 import _graph_milliseconds
    from utils.plan import SHAPES

    config = SHAPES[shape]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"] // heads
    rows, prompts, prompt_len, completion_len = 128, 16, 256, 512
    assert decode_attention.ready()
    torch.manual_seed(0)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    query = torch.randn(rows, kv_heads, heads // kv_heads, dim, **bf16)
    prompt_key = torch.randn(prompts, kv_heads, prompt_len, dim, **bf16)
    prompt_value = torch.randn(prompts, kv_heads, prompt_len, dim, **bf16)
    prompt_keep = torch.ones(prompts, prompt_len, dtype=torch.bool, device="cuda")
    prompt_keep[::3, :40] = False  # left padding on every third prompt
    prompt_row = torch.arange(rows, device="cuda") // (rows // prompts)
    key = torch.randn(rows, kv_heads, completion_len, dim, **bf16)
    value = torch.randn(rows, kv_heads, completion_len, dim, **bf16)
    scale = dim ** -0.5
    for position in (0, 255, completion_len - 1):
        keep = torch.zeros(rows, completion_len, dtype=torch.bool, device="cuda")
        keep[:, :position + 1] = True
        poisoned_key, poisoned_value = key.clone(), value.clone()
        poisoned_key[:, :, position + 1:] = float("nan")
        poisoned_value[:, :, position + 1:] = float("nan")
        ours = decode_attention.decode_attention_shared(query, prompt_key, prompt_value, prompt_keep, prompt_row,
                                                        poisoned_key, poisoned_value, keep, scale).float()
        want = torch.nn.functional.scaled_dot_product_attention(
            query, torch.cat([prompt_key[prompt_row], key], dim=2), torch.cat([prompt_value[prompt_row], value], dim=2),
            attn_mask=torch.cat([prompt_keep[prompt_row], keep], dim=1)[:, None, None, :], scale=scale).float()
        assert not ours.isnan().any()
        torch.testing.assert_close(ours, want, rtol=2e-2, atol=2e-2)
        assert (ours - want).abs().mean() < 2e-3

    position = 255  # the rollout's mean
    keep = torch.zeros(rows, completion_len, dtype=torch.bool, device="cuda")
    keep[:, :position + 1] = True
    whole_key = torch.cat([prompt_key[prompt_row], key], dim=2)  # the unshared cache: [rows, Hkv, 768, D]
    whole_value = torch.cat([prompt_value[prompt_row], value], dim=2)
    whole_keep = torch.cat([prompt_keep[prompt_row], keep], dim=1)
    shared_us = 1e3 * _graph_milliseconds(lambda: decode_attention.decode_attention_shared(
        query, prompt_key, prompt_value, prompt_keep, prompt_row, key, value, keep, scale))
    whole_us = 1e3 * _graph_milliseconds(lambda: decode_attention.decode_attention(
        query, whole_key, whole_value, whole_keep, scale))
    cache = lambda *tensors: sum(t.numel() * t.element_size() for t in tensors) / 2**20
    print(f"\n{shape} ({rows} rows over {prompts} prompts, {torch.cuda.get_device_name()}): shared {shared_us:.1f} us "
          f"a layer against {whole_us:.1f} unshared at completion position {position}; one layer's cache "
          f"{cache(prompt_key, prompt_value, key, value):.1f} MiB against {cache(whole_key, whole_value):.1f}")


@pytest.mark.parametrize("step_mode", MODES)
def test_share_prompt_cache_keeps_the_greedy_tokens_with_a_smaller_cache_on_gpu(step_mode, monkeypatch):
    """A bf16 model's greedy rollout of 4 prompts x 4 rows each with --share_prompt_cache (the shared kernel called;
    compiled: no fallback) and without it, each judged by one referee (the model's full forward, no cache), as
    test_decode_attention_in_the_decoding_step_keeps_the_greedy_tokens_on_gpu judges the kernel; the two caches'
    bytes: the shared one holds 4 prompt rows instead of 16. Twice (the kept graph replays a second rollout of the
    rows in another order)."""
    import warnings

    from utils import decode_attention
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    model = model.to(torch.bfloat16)
    # left-padded to 128 positions: the caches' 128-position rounding then favours neither (shared: 4 x 128 prompt +
    # 16 x 128 completion positions; unshared: 16 x 256)
    ids = torch.cat([torch.full((len(ids), 128 - ids.shape[1]), pad, device="cuda"), ids], dim=1)
    mask = torch.cat([torch.zeros(len(mask), 128 - mask.shape[1], dtype=mask.dtype, device="cuda"), mask], dim=1)
    ids, mask = ids.repeat_interleave(4, dim=0), mask.repeat_interleave(4, dim=0)
    calls = []
    real = decode_attention.decode_attention_shared
    monkeypatch.setattr(decode_attention, "decode_attention_shared", lambda *a: calls.append(1) or real(*a))
    for rollout in range(2):
        these_ids = ids if rollout == 0 else ids.flip(0)
        these_mask = mask if rollout == 0 else mask.flip(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = static_cache_generate(model, these_ids, these_mask, 48, 1.0, 1.0, 0, [10**9], pad,
                                         step_mode=step_mode, greedy=True, share_prompt_cache=True)
        assert calls and not [w for w in caught if "torch.compile failed" in str(w.message)]
        held = model.__dict__.get("_lean_rl_decoder")
        shared_bytes = None
        if held is not None:  # cudagraph, compiled: the kept caches
            _, cache, _, shared = held
            tensors = [t for c in (cache, shared.cache) for layer in c.layers for t in (layer.keys, layer.values)]
            shared_bytes = sum(t.numel() * t.element_size() for t in tensors)
            assert shared.cache.layers[0].keys.shape[0] == 4 and cache.layers[0].keys.shape[0] == 16
        model.__dict__.pop("_lean_rl_decoder", None)
        plain = static_cache_generate(model, these_ids, these_mask, 48, 1.0, 1.0, 0, [10**9], pad,
                                      step_mode=step_mode, greedy=True)
        if shared_bytes is not None:
            _, cache, _, _ = model.__dict__["_lean_rl_decoder"]
            plain_bytes = sum(t.numel() * t.element_size()
                              for layer in cache.layers for t in (layer.keys, layer.values))
            print(f"\n{step_mode}: the KV cache {shared_bytes / 2**20:.2f} MiB shared, {plain_bytes / 2**20:.2f} not")
            assert shared_bytes * 16 == plain_bytes * 10
        model.__dict__.pop("_lean_rl_decoder", None)
        _assert_as_greedy(model, these_ids, these_mask, ours, plain, f"{step_mode}, rollout {rollout}", "shared",
                          "unshared")


@pytest.mark.parametrize("flag", [["--share_prompt_cache"], []], ids=["set", "default"])
def test_grpo_trains_with_share_prompt_cache_on_gpu(run, tmp_path, local_model, flag):
    """Set, or unset (the default: on for GRPO groups in a captured step, here auto's cudagraph or compiled step),
    the rollouts decode from the shared prompt cache, as the start says."""
    result = run(["--model_name_or_path", local_model, "--max_steps", "3", "--prompts_per_step", "8",
                  "--num_generations", "4", "--max_completion_length", "32", "--output_dir", str(tmp_path),
                  "--save_strategy", "no"] + flag)
    assert result.returncode == 0, result.stderr[-3000:]
    said = "--share_prompt_cache on" + ("\n" if flag else " (auto: each of the 4 completions of a prompt")
    assert said in result.stdout, [line for line in result.stdout.splitlines() if line.startswith("generation:")]
    rows = metrics_of(tmp_path)
    assert len(rows) == 3, result.stderr[-3000:]
    print(f"\n--share_prompt_cache ({flag or 'unset'}): generate {rows[-1]['time/generate']:.2f} s, "
          f"step {rows[-1]['time/step']:.2f} s")



QWEN_1_5B_DECODE_MATRICES = {"q/o": (1536, 1536, 2), "k/v": (256, 1536, 2), "gate/up": (8960, 1536, 2),
                             "down": (1536, 8960, 1)}


@pytest.mark.parametrize("rows", [1, 64, 128])
def test_float32_mm_matches_autocast_at_every_split_and_prints_its_time(rows):
    """lean_rl::float32_mm (a float32 policy's decoding products, utils/int8.py): the kernel reading float32 weights
    at every split of K it may choose, against autocast's way (the weight cast to bf16, then F.linear) at 1.5b's and
    7b's decoding shapes: equal up to the bf16 products' summation order. Each shape's choice and its time beside
    autocast's are printed, and a decoding step's matrix products summed (printed, not asserted)."""
    from gpu_fixtures import graph_microseconds as timed
    from utils import int8

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape, matrices, head in [("1.5b", QWEN_1_5B_DECODE_MATRICES, (151936, 1536)),
                                  ("7b", QWEN_7B_DECODE_MATRICES, (152064, 3584))]:
        torch.manual_seed(rows)
        layers = 28
        step_ours = step_autocast = 0.0
        for name, (n, k, count) in {**matrices, "lm_head": (*head, 1 / layers)}.items():
            weight = torch.randn(n, k, device="cuda") * 0.02
            bias = torch.randn(n, device="cuda") * 0.02 if name == "k/v" else None  # Qwen2's q/k/v have biases
            x = torch.randn(rows, k, device="cuda")
            reference = int8._cast_then_mm(x.to(torch.bfloat16), weight, bias).float()
            ones = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            assert int8._triton_ready()
            for split in int8.split_candidates(n, k, sms):
                forced = int8._float32_product(x.to(torch.bfloat16), weight, bias, split, ones).float()
                error = ((forced - reference).norm() / reference.norm()).item()
                assert error < 1e-2, (shape, name, split, error)
            ours = int8.float32_weight_linear(x, weight, bias)  # chooses, timed
            assert ours.dtype == torch.bfloat16 and ((ours.float() - reference).norm() / reference.norm()) < 1e-2
            chosen = int8._FLOAT32_CHOICE[(x.device, int8.block_rows(rows), n, k)][0]
            t_ours = timed(lambda: int8.float32_weight_linear(x, weight, bias))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                t_autocast = timed(lambda: torch.nn.functional.linear(x, weight, bias))
            step_ours, step_autocast = step_ours + layers * count * t_ours, step_autocast + layers * count * t_autocast
            print(f"\n{shape} rows {rows} {name} [{n} x {k}]: float32_mm {t_ours:.1f} us ("
                  f"{'autocast' if chosen == 0 else f'kernel, split {chosen}'}), autocast {t_autocast:.1f} us")
        print(f"{shape} rows {rows}: a decoding step's matrix products: float32_mm {step_ours / 1e3:.2f} ms, "
              f"autocast {step_autocast / 1e3:.2f} ms")
    # the tiles autotuning chose for each (BLOCK_M, N, K, SPLIT_K) (which of the 10 configurations ever win: fewer
    # configurations would shorten the first rollout's autotuning)
    for key, config in int8.LAUNCH[0].autotuner.cache.items():
        print(f"autotuned {key[:4]}: {config}")


@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_float32_policy_decodes_through_the_float32_kernel_and_keeps_the_greedy_tokens_on_gpu(step_mode,
                                                                                            monkeypatch):
    """A float32 model's greedy rollout under bf16 autocast with every decoding product through the kernel (the
    choice forced: the test model's matrices are small) against the same rollout with autocast's products, each
    judged by one referee (_assert_as_greedy); the kernel is launched, from the captured and compiled steps too."""
    import warnings

    from utils import generation, int8
    from utils.generation import static_cache_generate

    model, pad, ids, mask = _small_model_and_prompts()
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    monkeypatch.setattr(generation, "FLOAT32_KERNEL_DEVICES", ())
    with autocast():
        theirs = static_cache_generate(model, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                       greedy=True)
    model.__dict__.pop("_lean_rl_decoder", None)
    monkeypatch.setattr(generation, "FLOAT32_KERNEL_DEVICES", ("cuda",))
    monkeypatch.setattr(int8, "FLOAT32_KERNEL_MIN_WEIGHTS", 0)
    monkeypatch.setattr(int8, "_FLOAT32_CHOICE", {})
    monkeypatch.setattr(int8, "_fastest_float32_split", lambda *a: 1)
    assert int8._triton_ready()
    launches = []
    real = int8.LAUNCH[0]
    monkeypatch.setattr(int8, "LAUNCH", [lambda *a: launches.append(a[1].dtype) or real(*a)])
    with warnings.catch_warnings(record=True) as caught, autocast():
        warnings.simplefilter("always")
        ours = static_cache_generate(model, ids, mask, 48, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                     greedy=True)
    assert launches and set(launches) == {torch.float32}
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert {key[2:] for key in int8._FLOAT32_CHOICE} >= {(256, 256), (128, 256), (512, 256), (256, 512)}
    _assert_as_greedy(model, ids, mask, ours, theirs, f"float32 kernel, {step_mode}", "kernel", "autocast")
