"""--generation_backend static: the static-KV-cache decoding loop against transformers' generate
(greedy: the same tokens; sampling: the same distribution), EOS and max length, and a script run."""
import warnings

import pytest
import torch

from helpers import metrics_of
from utils import toy
from utils.generation import completion_ids_and_mask, sample_from, sampling_logits, static_cache_generate


def _model_and_prompts(eos_id=None):
    """A random Llama whose greedy continuations vary (large init), and left-padded prompts of
    different lengths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=eos_id if eos_id is not None else tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    enc = tokenizer(["1+2=", "12+34=", "7+7=", "100+1="], return_tensors="pt", padding=True, padding_side="left")
    return model, tokenizer, enc["input_ids"], enc["attention_mask"]


def _hf_greedy(model, ids, mask, max_new_tokens, eos, pad):
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=eos)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]


def test_greedy_tokens_equal_generate_with_left_padding_and_eos():
    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    free = static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, [10**9], pad, greedy=True)  # no EOS: 20 tokens
    reference = _hf_greedy(model, ids, mask, 20, [10**9], pad)
    assert free.shape == (4, 20) and torch.equal(free, reference)
    assert len(set(free.flatten().tolist())) > 3  # the continuations vary: the check means something
    eos = [int(free[0, 5]), int(free[2, 9])]  # tokens the rows will produce: each row stops at its first
    ours = completion_ids_and_mask(static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, eos, pad, greedy=True,
                                                         check_every=4), eos, pad)
    theirs = completion_ids_and_mask(_hf_greedy(model, ids, mask, 20, eos, pad), eos, pad)
    width = theirs[0].shape[1]
    assert torch.equal(ours[0][:, :width], theirs[0]) and (ours[0][:, width:] == pad).all()
    assert torch.equal(ours[1][:, :width], theirs[1]) and torch.equal(ours[2], theirs[2])
    assert ours[2].tolist() != [True] * 4  # some rows ended with EOS


def test_compiled_step_gives_the_greedy_tokens_of_generate():
    """The compiled decoding step (torch.compile; CUDA graphs only on GPUs, so here the compiled
    kernels and the loop's output handling) gives generate's greedy tokens."""
    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    ours = static_cache_generate(model, ids, mask, 10, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled")
    assert torch.equal(ours, _hf_greedy(model, ids, mask, 10, [10**9], pad))


def test_compiled_step_falls_back_to_eager_when_compiling_fails(monkeypatch):
    """An architecture inductor cannot compile: a warning naming the backend, and the rollout goes
    on uncompiled with the same greedy tokens (emulated: the compiled function raises at its first
    call, as a BackendCompilerFailed would)."""
    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id

    def failing_compile(fn, **kwargs):
        def compiled(*args):
            raise RuntimeError("backend='inductor' raised:\nLoweringException: emulated")
        return compiled

    monkeypatch.setattr(torch, "compile", failing_compile)
    with pytest.warns(UserWarning, match="--generation_backend compiled: torch.compile failed .*RuntimeError"):
        ours = static_cache_generate(model, ids, mask, 10, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                     step_mode="compiled")
    assert torch.equal(ours, _hf_greedy(model, ids, mask, 10, [10**9], pad))


def test_compiled_step_is_reused_by_the_next_rollout_without_recompiling():
    """The compiled pair (static cache, step) stays with the model: a second rollout of other
    prompts of the same shape compiles nothing new, empties the cache first (its tokens are
    still generate's) and reuses the same cache tensors. The uncompiled loop keeps nothing."""
    from torch._dynamo.utils import counters

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    static_cache_generate(model, ids, mask, 10, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    assert "_lean_rl_decoder" not in model.__dict__
    static_cache_generate(model, ids, mask, 10, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled")
    cache = model.__dict__["_lean_rl_decoder"][1]
    keys = cache.layers[0].keys.data_ptr()
    compiled_frames = counters["frames"]["ok"]
    other = torch.flip(ids, dims=[0]), torch.flip(mask, dims=[0])  # other rows, same shape
    ours = static_cache_generate(model, *other, 10, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled")
    assert counters["frames"]["ok"] == compiled_frames  # nothing compiled again
    assert model.__dict__["_lean_rl_decoder"][1] is cache and cache.layers[0].keys.data_ptr() == keys
    assert torch.equal(ours, _hf_greedy(model, *other, 10, [10**9], pad))


def test_a_dropped_decoder_rebuilt_compiles_nothing_again():
    """--empty_cache_between_phases drops the compiled decoder after each rollout, and with
    --generation_copy the model is a new object each time: neither may compile again (each rollout
    would pay a compile, and after torch._dynamo's recompile limit, 8, decode uncompiled)."""
    from copy import deepcopy

    from torch._dynamo.utils import counters

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    first = static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled")
    compiled_frames = counters["frames"]["ok"]
    for rebuilt in (model, deepcopy(model), deepcopy(model)):
        rebuilt.__dict__.pop("_lean_rl_decoder", None)  # as keep_decoder=False leaves it
        again = static_cache_generate(rebuilt, ids, mask, 6, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                      step_mode="compiled")
        assert torch.equal(again, first)
    assert counters["frames"]["ok"] == compiled_frames


def test_empty_cache_between_phases_drops_the_kept_decoder():
    """generate_completions(keep_decoder=False), as --empty_cache_between_phases asks, leaves no
    KV cache or graph on the model after the rollout; by default they stay for the next one."""
    from utils.generation import build_generation_config, generate_completions

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    static_cache_generate(model, ids, mask, 4, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled")
    config = build_generation_config(4, 1.0, 1.0, 0, pad, [10**9])
    generate_completions(model, ids, mask, config, [10**9])
    assert "_lean_rl_decoder" in model.__dict__
    generate_completions(model, ids, mask, config, [10**9], keep_decoder=False)
    assert "_lean_rl_decoder" not in model.__dict__


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_slices_grouped_by_prompt_length_give_each_row_its_own_completion(backend):
    """--generation_slice_size: the rows are generated in slices of similar prompt length, each
    without the left padding all its rows share, and come back in their order: near-greedy
    sampling (temperature 1e-4) gives every row the completion it gets in one batch."""
    from utils.generation import build_generation_config, generate_completions

    model, tokenizer, _, _ = _model_and_prompts()
    enc = tokenizer(["1+2=", "123+456=", "7=", "10+1=", "99+99+99=", "5+5="], return_tensors="pt", padding=True,
                    padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    config = build_generation_config(10, 1e-4, 1.0, 0, tokenizer.pad_token_id, [10**9])
    whole = generate_completions(model, ids, mask, config, [10**9], backend=backend)[0]
    prefills = []
    model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: prefills.append(inputs[0].shape) if inputs[0].shape[1] > 1 else None)
    sliced = generate_completions(model, ids, mask, config, [10**9], batch_size=2, backend=backend)[0]
    assert len({tuple(row) for row in whole.tolist()}) > 3  # rows differ: a wrong order would show
    assert torch.equal(sliced, whole)
    lengths = sorted(mask.sum(dim=1).tolist(), reverse=True)
    assert [tuple(shape) for shape in prefills] == [(2, lengths[0]), (2, lengths[2]), (2, lengths[4])]


@pytest.mark.parametrize("backend", ["hf", "static"])
def test_prefill_in_chunks_gives_the_same_tokens_and_logprobs(backend):
    """--prefill_chunk_size 3: the left-padded prompts (9 positions; the shortest rows' first chunk is
    all padding) go into the cache 3 positions per forward, and sampling at temperature 1 from the
    same seed gives every row the tokens and sampling logprobs of the one-forward prefill."""
    from utils.generation import build_generation_config, generate_completions

    model, tokenizer, _, _ = _model_and_prompts()
    enc = tokenizer(["1+2=", "123+456=", "7=", "10+1=", "99+99+99=", "5+5="], return_tensors="pt", padding=True,
                    padding_side="left")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    assert ids.shape[1] == 9 and (mask[:, :3].sum(dim=1) == 0).any()
    config = build_generation_config(10, 1.0, 1.0, 0, tokenizer.pad_token_id, [10**9])
    torch.manual_seed(0)
    whole = generate_completions(model, ids, mask, config, [10**9], backend=backend, return_logprobs=True)
    torch.manual_seed(0)
    widths = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: widths.append(inputs[0].shape[1]))
    chunked = generate_completions(model, ids, mask, config, [10**9], backend=backend, return_logprobs=True,
                                   prefill_chunk_size=3)
    hook.remove()
    assert widths[:4] == [3, 3, 3, 1]  # three prefill chunks, then one token per decoding step
    assert len({tuple(row) for row in whole[0].tolist()}) > 3
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    torch.testing.assert_close(chunked[3], whole[3], rtol=0, atol=1e-5)


def test_fp8_codes_round_trip_within_e4m3_rounding():
    """--kv_cache_dtype fp8's storage: each vector scaled to e4m3's range, so the error is e4m3's
    rounding (3 mantissa bits: at most 2^-4 of the value, or half the smallest subnormal step of the
    vector's scale) at any magnitude; an all-zero (empty) position reads as 0."""
    from utils.generation import FP8_MAX, fp8_codes, from_fp8_codes

    torch.manual_seed(0)
    x = torch.randn(4, 3, 50, 16) * torch.tensor([1e-3, 1.0, 300.0]).view(1, 3, 1, 1)
    codes = fp8_codes(x)
    assert codes.dtype == torch.uint8 and codes.shape == (4, 3, 50, 20)
    y = from_fp8_codes(codes, torch.float32)
    bound = 2**-4 * x.abs() + x.abs().amax(dim=-1, keepdim=True) * 2**-10 / FP8_MAX
    assert torch.all((y - x).abs() <= bound) and (y - x).abs().max() > 0
    assert torch.equal(from_fp8_codes(torch.zeros(2, 20, dtype=torch.uint8), torch.bfloat16), torch.zeros(2, 16))


def test_fp8_kv_cache_stores_codes_and_decodes_near_the_bf16_cache():
    """The static loop with kv_cache_dtype fp8: the cache's buffers hold uint8 codes (head_dim + 4 bytes
    a position and head, not 2 x head_dim), the first greedy tokens are those of the unquantised cache
    and their logprobs differ by the quantisation only (nonzero, small); hf refuses it."""
    from utils import generation
    from utils.generation import build_generation_config, generate_completions

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    cache, _, _ = generation._decoder(model, ids.shape[0], 32, (1.0, 0, 1.0, True), "eager", torch.device("cpu"), "fp8")
    model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert cache.layers[0].keys.dtype == torch.uint8 and cache.layers[0].keys.shape[-1] == head_dim + 4
    plain = static_cache_generate(model, ids, mask, 3, 1.0, 1.0, 0, [10**9], pad, greedy=True, return_logprobs=True)
    fp8 = static_cache_generate(model, ids, mask, 3, 1.0, 1.0, 0, [10**9], pad, greedy=True, return_logprobs=True,
                                kv_cache_dtype="fp8")
    assert torch.equal(fp8[0][:, :2], plain[0][:, :2])
    gap = (fp8[1][:, 0] - plain[1][:, 0]).abs()
    assert 0 < gap.max() < 0.1, gap
    config = build_generation_config(3, 1.0, 1.0, 0, pad, [10**9])
    with pytest.raises(ValueError, match="static-cache backend"):
        generate_completions(model, ids, mask, config, [10**9], backend="hf", kv_cache_dtype="fp8")


def test_packed_gqa_attention_equals_sdpa_with_repeated_heads():
    """One query token, 12 query heads over 2 key/value heads, a padding mask: the packed
    attention equals SDPA on keys and values repeated per query head (what transformers runs)."""
    from types import SimpleNamespace

    from utils.generation import packed_gqa_attention

    torch.manual_seed(0)
    query, key, value = torch.randn(3, 12, 1, 16), torch.randn(3, 2, 40, 16), torch.randn(3, 2, 40, 16)
    mask = torch.rand(3, 1, 1, 40) > 0.3
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True, training=False)
    ours, _ = packed_gqa_attention(module, query, key, value, mask, scaling=0.25)
    repeated = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(6, dim=1), value.repeat_interleave(6, dim=1), attn_mask=mask, scale=0.25)
    assert ours.shape == (3, 1, 12, 16)
    torch.testing.assert_close(ours, repeated.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_packed_attention_output_reaches_an_opaque_o_proj_as_one_matrix_under_compile():
    """In a compiled step the packed attention's output reaches an op inductor cannot see into
    (bitsandbytes' 4-bit/8-bit product of o_proj) with strides that fold [B, 1, Hq * D] into one
    [B, Hq * D] matrix (stride(0) == stride(1)), so its F.linear is one matrix product. A transposed
    [B, Hq, 1, D] view left the length-1 dimension's stride at D under inductor (eager reshapes fix
    it): F.linear then ran a batched product of one row each over the weight broadcast B times
    (7b QLoRA o_proj at 64 rows: 218 us against ~9, H100). The same numbers as eager."""
    from types import SimpleNamespace

    from utils.generation import packed_gqa_attention

    if not hasattr(torch.ops.lean_rl_test, "linear_seeing_strides"):
        @torch.library.custom_op("lean_rl_test::linear_seeing_strides", mutates_args=())
        def linear_seeing_strides(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            _SEEN_STRIDES.append(x.stride())
            return torch.nn.functional.linear(x, weight)

        @linear_seeing_strides.register_fake
        def _(x, weight):
            return x.new_empty(*x.shape[:-1], weight.shape[0])
    _SEEN_STRIDES.clear()
    module = SimpleNamespace(num_key_value_groups=6, is_causal=True, training=False)

    def layer(query, key, value, mask, weight):
        out, _ = packed_gqa_attention(module, query, key, value, mask)
        return torch.ops.lean_rl_test.linear_seeing_strides(out.reshape(4, 1, -1).contiguous(), weight)

    torch.manual_seed(0)
    inputs = (torch.randn(4, 12, 1, 16), torch.randn(4, 2, 40, 16), torch.randn(4, 2, 40, 16),
              torch.ones(4, 1, 1, 40, dtype=torch.bool), torch.randn(24, 12 * 16))
    eager = layer(*inputs)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(*inputs)
    torch._dynamo.reset()
    assert len(_SEEN_STRIDES) == 2 and all(stride[0] == stride[1] for stride in _SEEN_STRIDES), _SEEN_STRIDES
    torch.testing.assert_close(compiled, eager)


_SEEN_STRIDES = []  # the strides linear_seeing_strides was called with


def test_qlora_rollout_runs_o_proj_and_the_prefill_lm_head_as_one_matrix_product(tmp_path):
    """The same through bitsandbytes itself (its CPU 4-bit product), over a whole rollout of a QLoRA model
    through the compiled decoding step (inductor, no CUDA graph on a CPU): no one-row batched product anywhere.
    Before the fixes the profile held aten::bmm [8, 1, 512] x [8, 512, 512] once a layer at every decoding step
    (o_proj after the packed attention) and [8, 1, 512] x [8, 512, V] at the prefill (the LM head on
    transformers' slice of the last position)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import one_row_batched_products
    from utils import toy

    pytest.importorskip("bitsandbytes")
    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    one_row, quantised = one_row_batched_products(str(tmp_path), "cpu")
    assert quantised and not one_row, one_row[:3]


def test_static_loop_decodes_through_the_packed_attention_and_restores_sdpa(monkeypatch):
    from utils import generation

    model, tokenizer, ids, mask = _model_and_prompts()
    calls = []
    real = generation.packed_gqa_attention
    monkeypatch.setattr(generation, "packed_gqa_attention", lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    assert model.config._attn_implementation == "sdpa" and model.config.num_key_value_heads < 4  # grouped heads
    static_cache_generate(model, ids, mask, 5, 1.0, 1.0, 0, [10**9], tokenizer.pad_token_id, greedy=True)
    layers = model.config.num_hidden_layers
    assert calls == [ids.shape[1]] * layers + [1] * 4 * layers  # prefill (delegated), then 4 decoding steps
    assert model.config._attn_implementation == "sdpa"


def test_static_loop_sends_one_position_per_row_through_the_lm_head():
    """The prefill asks for the last position's logits only: [B, 1, V], never [B, P, V] (at the
    qwen2.5-1.5b shape, 128 x 256 prompts, that was 20 GB of float32 logits on the H200)."""
    model, tokenizer, ids, mask = _model_and_prompts()
    shapes = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: shapes.append(tuple(output.shape)))
    static_cache_generate(model, ids, mask, 5, 1.0, 1.0, 0, [10**9], tokenizer.pad_token_id, greedy=True)
    assert shapes == [(4, 1, model.config.vocab_size)] * 5, shapes


def test_keys_in_bf16_change_no_token_under_autocast(monkeypatch):
    """--mixed_precision bf16 over float32 weights: RoPE leaves keys in float32, values in bf16, and
    the static cache stores the keys in bf16 (below). Attention rounds them so anyway: the same
    tokens as keeping them in float32 (which transformers 5.24 does by itself). (Against `generate`
    itself bf16 greedy paths split at near-ties, as any two kernel shapes do.)"""
    from utils import generation

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True)
        monkeypatch.setattr(generation, "_store_keys_as_values", lambda cache: None)
        float_keys = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    assert torch.equal(ours, float_keys)


def test_static_cache_under_accelerate_bf16_with_transformers_5_17_buffers(monkeypatch):
    """accelerate's --mixed_precision bf16 starts autocast inside the model's forward; RoPE leaves
    the keys in float32, the values in bf16. transformers 5.17 (the GPU image's version, where this
    failed) sizes a static layer's value buffer by the keys' dtype: emulated here on 5.24's layer.
    The static loop stores keys in the values' dtype, so both fit."""
    from transformers.cache_utils import StaticLayer

    init = StaticLayer.lazy_initialization

    def like_5_17(self, key_states, value_states=None):
        init(self, key_states, key_states)  # both buffers in the keys' dtype

    monkeypatch.setattr(StaticLayer, "lazy_initialization", like_5_17)
    model, tokenizer, ids, mask = _model_and_prompts()
    model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)  # as accelerate's prepare wraps it
    out = static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [10**9], tokenizer.pad_token_id, greedy=True)
    assert out.shape == (4, 6)


def test_a_dropped_decoder_frees_its_kv_cache():
    """compiled/cudagraph keep their decoder (KV cache, step) on the model between rollouts;
    --empty_cache_between_phases drops it after each rollout, and its cache tensors must then be
    freed although torch.compile keeps the functions it traced. (On the H200 a per-layer closure
    kept them: the update's peak was 18.34 GiB allocated with the flag, 18.21 without.) On the CPU
    the compiled step runs without a graph but is kept the same way."""
    import gc
    import weakref

    model, tokenizer, ids, mask = _model_and_prompts()
    static_cache_generate(model, ids, mask, 4, 1.0, 1.0, 0, [10**9], tokenizer.pad_token_id, step_mode="compiled")
    cache = model.__dict__["_lean_rl_decoder"][1]
    tensors = [weakref.ref(t) for layer in cache.layers for t in (layer.keys, layer.values)]
    del cache
    model.__dict__.pop("_lean_rl_decoder")  # as generate_completions(keep_decoder=False) does
    gc.collect()
    assert tensors and all(ref() is None for ref in tensors)


def test_sampling_logits_equal_generate_logits_processors():
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(1)
    logits = torch.randn(6, 50) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 10, 0.5)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        ours = sampling_logits(logits, temperature, top_k, top_p)
        assert torch.equal(torch.isinf(ours), torch.isinf(expected)), (temperature, top_k, top_p)
        torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_gumbel_sampling_has_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).expand(200_000, 5)
    generator = torch.Generator().manual_seed(0)
    draws = sample_from(logits, generator)
    frequencies = torch.bincount(draws, minlength=5).double() / draws.numel()
    expected = logits[0].double().softmax(-1)
    assert frequencies[4] == 0  # a removed token is never drawn
    assert (frequencies - expected).abs().max() < 4 * (expected * (1 - expected) / draws.numel()).sqrt().max()


def test_compiled_pick_draws_the_eager_picks_tokens_from_the_same_draws():
    """--generation_backend compiled fuses the pick (scale, top-k/top-p, Gumbel noise, argmax, logsumexp) with
    torch.compile, its uniform draws made eagerly outside it: from the same draws it takes the same token as the
    eager pick, with the same logprob to float32 rounding, for each sampling setting; greedy takes the argmax."""
    from utils.generation import _pick

    torch.manual_seed(3)
    logits = torch.randn(16, 300) * 4  # [B, V]
    for temperature, top_k, top_p, greedy in [(1.0, 0, 1.0, False), (0.7, 20, 1.0, False), (1.2, 0, 0.9, False),
                                              (1.0, 0, 1.0, True)]:
        uniform = None if greedy else torch.rand(logits.shape)
        compiled = torch.compile(_pick, dynamic=False)
        token, logprob = compiled(logits, temperature, top_k, top_p, greedy, uniform)
        eager_token, eager_logprob = _pick(logits, temperature, top_k, top_p, greedy, uniform)
        assert torch.equal(token, eager_token), (temperature, top_k, top_p, greedy)
        torch.testing.assert_close(logprob, eager_logprob)
        expected = (logits / temperature).log_softmax(-1).gather(-1, token[:, None]).squeeze(-1)
        torch.testing.assert_close(logprob, expected, rtol=1e-5, atol=1e-5)  # before top-k / top-p
        if greedy:
            assert torch.equal(token, logits.argmax(-1))
        else:  # a sampled run of draws is not the argmax everywhere
            assert not torch.equal(token, logits.argmax(-1))


def test_compiled_sampled_step_draws_the_static_steps_tokens_with_the_training_forwards_logprobs():
    """The whole compiled decoding step with sampling (the forward and the fused pick compiled, the draws eager; on a
    CPU without a CUDA graph), against the eager static step from the same seed: the same draws in the same order,
    so the same tokens; each token's logprob is the training forward's (completion_logprobs) to float32 numerics."""
    from utils.ops import completion_logprobs

    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    runs = {}
    for mode in ("static", "compiled"):
        torch.manual_seed(5)
        runs[mode] = static_cache_generate(model, ids, mask, 10, 0.8, 0.95, 0, [10**9], pad, step_mode=mode,
                                           return_logprobs=True)
    (tokens, logprobs), (eager_tokens, eager_logprobs) = runs["compiled"], runs["static"]
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logprobs, eager_logprobs, rtol=0, atol=1e-4)
    completion_mask = torch.ones_like(tokens)
    with torch.no_grad():
        train_logprobs, _ = completion_logprobs(model, torch.cat([ids, tokens], 1), torch.cat([mask, completion_mask], 1),
                                                tokens.shape[1], 0.8)
    torch.testing.assert_close(logprobs, train_logprobs, rtol=0, atol=1e-4)
    assert logprobs.min() < -0.5  # real draws, not the argmax


def test_sampled_first_tokens_follow_generate_distribution():
    """Many sampled first tokens from one prompt, both ways: the same distribution (two-sample
    chi-square-like bound on the frequency gap of each token)."""
    from transformers import GenerationConfig

    model, tokenizer, ids, mask = _model_and_prompts()
    n = 4000
    batch_ids, batch_mask = ids[:1].expand(n, -1), mask[:1].expand(n, -1)
    torch.manual_seed(2)
    ours = static_cache_generate(model, batch_ids, batch_mask, 1, 1.2, 0.95, 20, [10**9], tokenizer.pad_token_id)[:, 0]
    config = GenerationConfig(max_new_tokens=1, do_sample=True, temperature=1.2, top_p=0.95, top_k=20,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=[10**9])
    theirs = model.generate(input_ids=batch_ids, attention_mask=batch_mask, generation_config=config)[:, -1]
    V = len(tokenizer)
    a, b = torch.bincount(ours, minlength=V).double() / n, torch.bincount(theirs, minlength=V).double() / n
    assert set(ours.tolist()) <= set(range(V)) and (a > 0).sum() > 3
    assert (a - b).abs().max() < 5 * ((a + b) / n).sqrt().max()


@pytest.mark.parametrize("script", ["train_grpo.py", "train_ppo.py"])
def test_scripts_train_with_the_static_backend(run, tmp_path, script):
    result = run(["--max_steps", "3", "--generation_backend", "compiled", "--output_dir", str(tmp_path),
                  "--save_strategy", "no"], script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "needs a GPU" in result.stderr  # compiled falls back to static on the CPU, and says so
    assert len(metrics_of(tmp_path)) == 3


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_trains_with_share_prompt_cache_on_the_static_backend(run, tmp_path, lora):
    """--share_prompt_cache with --generation_backend auto on a CPU: static (said at start), and the rollouts decode
    through the shared prompt cache, also through peft's LoRA model (its forward hands the keyword on)."""
    result = run(["--max_steps", "2", "--share_prompt_cache", "--output_dir", str(tmp_path), "--save_strategy", "no"]
                 + (["--use_lora"] if lora else []))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--share_prompt_cache needs this project's static cache" in result.stdout + result.stderr
    assert len(metrics_of(tmp_path)) == 2


def _lora_policy(model):
    """LoRA on q/v with B away from zero (a trained adapter's delta is not zero)."""
    from utils.modeling import apply_lora

    policy = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules="q_proj,v_proj")
    torch.manual_seed(1)
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    return policy


def test_generation_copy_is_the_bf16_policy_and_follows_its_updates():
    """Full-parameter: the copy holds the policy's weights in bf16; after an optimizer-like change
    the next refresh writes them into the same tensors (a captured graph stays valid)."""
    from utils.generation import generation_copy

    model, *_ = _model_and_prompts()
    copy = generation_copy(model)
    assert copy is not model and not any(p.requires_grad for p in copy.parameters())
    expected = {name: p.to(torch.bfloat16) for name, p in model.state_dict().items()}
    assert all(torch.equal(p, expected[name]) for name, p in copy.state_dict().items())
    # built without weight initialisation: the buffers outside the state_dict (RoPE's) still computed
    buffers = dict(model.named_buffers())
    assert all(torch.equal(b, buffers[name].to(b.dtype)) for name, b in copy.named_buffers())
    pointers = [p.data_ptr() for p in copy.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    assert generation_copy(model) is copy and [p.data_ptr() for p in copy.parameters()] == pointers
    assert torch.equal(copy.model.layers[0].mlp.up_proj.weight,
                       model.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16))
    assert "_lean_rl_generation_copy" not in dict(model.named_modules()) and not any(
        "generation_copy" in name for name in model.state_dict())


def test_the_compiled_decoding_steps_forward_alone_takes_decode_compile_options(monkeypatch):
    """DECODE_COMPILE_OPTIONS (benchmarks/decode_step.py --max_autotune) reach torch.compile for the compiled
    step's forward and nothing else (the token pick keeps inductor's defaults); unset, the forward has the defaults
    too. torch.compile is recorded and the functions run uncompiled: the same tokens either way."""
    import utils.generation as generation

    model, tokenizer, ids, mask = _model_and_prompts()
    seen = []

    def recorded(fn, **kwargs):
        seen.append(kwargs.get("options"))
        return fn

    monkeypatch.setattr(torch, "compile", recorded)
    outputs = []
    for options in (None, {"max_autotune": True}):
        monkeypatch.setattr(generation, "DECODE_COMPILE_OPTIONS", options)
        seen.clear()
        model.__dict__.pop("_lean_rl_decoder", None)  # a kept decoder would not be compiled again
        outputs.append(generation.static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [tokenizer.eos_token_id],
                                                        tokenizer.pad_token_id, step_mode="compiled", greedy=True))
        assert seen == [options, None], seen  # the forward's, then the pick's
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize("tied", [False, True])
def test_building_the_generation_copy_allocates_only_the_tensors_it_holds_of_its_own(tied, monkeypatch):
    """The copy is built on the meta device: a bf16 policy's copy (every weight the policy's own storage) makes no
    storage for any weight while it is built and refreshed, only its buffers (built on the device, it held a whole
    bf16 model until the policy's tensors replaced it: 15.2 GB at 7b); a float32 policy's copy makes a bf16
    tensor per weight, an LM head tied to the embedding one tensor with it, as in the policy, all of them views of
    one allocation per rank (matrices, vectors): two storages, and the fused q/k/v and gate/up weights are views of
    it too, no storage of their own."""
    from copy import deepcopy

    from torch.utils._python_dispatch import TorchDispatchMode

    import utils.generation as generation
    from utils.generation import generation_copy

    assert generation.FUSE_PROJECTIONS  # fused groups are views of the copy's storage: counted here too

    class NewStorage(TorchDispatchMode):  # bytes of every storage an op's output makes anew
        def __init__(self, known):
            super().__init__()
            self.known, self.bytes, self.large = set(known), 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in self.known:
                        self.known.add(ptr)
                        self.bytes += t.untyped_storage().nbytes()
                        self.large += t.untyped_storage().nbytes() > 1024  # not a scalar constant
            return out

    model, *_ = _model_and_prompts()
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    weights = {id(p): p for p in model.parameters()}.values()  # a tied weight once
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    policy = deepcopy(model).to(torch.bfloat16)
    with NewStorage(t.untyped_storage().data_ptr() for t in [*policy.parameters(), *policy.buffers()]) as seen:
        copy = generation_copy(policy)
    weight_bytes = sum(2 * p.numel() for p in weights)  # in bf16
    # no weight made (each is the policy's): its buffers and a few scalar constants, against the weights' 159 KB
    assert seen.bytes <= buffer_bytes + 1024 < weight_bytes / 100, (seen.bytes, weight_bytes)
    own = {p.data_ptr() for p in policy.parameters()}
    assert all(p.data_ptr() in own for p in copy.parameters())
    with NewStorage(t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]) as seen:
        copy = generation_copy(model)  # float32: bf16 tensors of its own
    assert (copy.lm_head.weight.data_ptr() == copy.model.embed_tokens.weight.data_ptr()) == tied
    tensors = len(list(copy.parameters()))  # each starts at a multiple of FLAT_ALIGN elements (bf16: 2 bytes each)
    padding = tensors * 2 * (generation.FLAT_ALIGN - 1)
    assert weight_bytes <= seen.bytes <= weight_bytes + buffer_bytes + padding + 1024, (seen.bytes, weight_bytes)
    buffer_storages = len({b.untyped_storage().data_ptr() for b in copy.buffers()})
    assert seen.large <= 2 + buffer_storages, (seen.large, buffer_storages)  # matrices' and vectors' allocations
    attention = copy.model.layers[0].self_attn
    assert type(attention.q_proj).__name__ == "_GroupFirst"  # fused, over the flat allocation
    group = attention.q_proj._lean_rl_group_weight
    assert group.untyped_storage().data_ptr() == attention.k_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(group, torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
    expected = {name: p.to(torch.bfloat16) for name, p in model.state_dict().items()}
    assert all(torch.equal(p, expected[name]) for name, p in copy.state_dict().items())


def test_generation_copy_fuses_the_projections_of_one_input_into_one_product(monkeypatch):
    """q/k/v and gate/up of a copy that holds its own bf16 storage: each group's weights are row blocks of one
    tensor (the copy's refresh writes them as before, and the product sees it), one matrix product per group
    (9 instead of 15 in a 2-layer forward), the same logits as the unfused copy bit for bit here, the same
    sampled tokens in the eager and compiled decoding steps (compiled without falling back); a copy that
    holds the policy's own bf16 tensors is not fused (that would cost memory); a group's later projection
    called on another input than its first's is refused, not answered from a stale product."""
    import warnings

    from torch.utils._python_dispatch import TorchDispatchMode

    import utils.generation as generation
    from utils.generation import generation_copy

    assert generation.FUSE_PROJECTIONS  # on by default since measured on a GPU
    model, tokenizer, ids, mask = _model_and_prompts()
    pad = tokenizer.pad_token_id
    copy = generation_copy(model)
    with monkeypatch.context() as patch:
        patch.setattr(generation, "FUSE_PROJECTIONS", False)
        model.__dict__.pop("_lean_rl_generation_copy")
        plain = generation_copy(model)
    model.__dict__["_lean_rl_generation_copy"] = copy
    attention, mlp = copy.model.layers[1].self_attn, copy.model.layers[1].mlp
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    assert [type(m).__name__ for m in (q, k, v, mlp.gate_proj, mlp.up_proj, mlp.down_proj, attention.o_proj)] == [
        "_GroupFirst", "_GroupNext", "_GroupNext", "_GroupFirst", "_GroupNext", "Linear", "Linear"]
    assert k.weight.data_ptr() == q.weight.data_ptr() + q.weight.numel() * 2  # row blocks of one bf16 tensor
    assert v.weight.data_ptr() == k.weight.data_ptr() + k.weight.numel() * 2
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr() + mlp.gate_proj.weight.numel() * 2
    assert set(copy.state_dict()) == set(plain.state_dict()) and {n for n, _ in copy.named_buffers()} == {
        n for n, _ in plain.named_buffers()}

    class Products(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                Products.count += 1
            return func(*args, **(kwargs or {}))

    counts = []
    for m in (copy, plain):
        Products.count = 0
        with torch.no_grad(), Products():
            m(ids, attention_mask=mask)
        counts.append(Products.count)
    assert counts == [2 * 4 + 1, 2 * 7 + 1]
    # an input of more than FUSE_MAX_TOKENS tokens (a prefill) takes each projection's own product: the fused one
    # would hold gate's and up's outputs as one tensor until both are used
    with torch.no_grad():
        q(torch.randn(1, 1, q.in_features, dtype=torch.bfloat16))  # a group left half done: its product stashed
    with monkeypatch.context() as patch:
        patch.setattr(generation, "FUSE_MAX_TOKENS", ids.numel() - 1)
        Products.count = 0
        with torch.no_grad(), Products():
            long_logits = copy(ids, attention_mask=mask).logits
        assert Products.count == 2 * 7 + 1
        assert q._lean_rl_stash.input is None and mlp.gate_proj._lean_rl_stash.input is None
        with torch.no_grad():
            assert torch.equal(long_logits, plain(ids, attention_mask=mask).logits)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    assert generation_copy(model) is copy
    with monkeypatch.context() as patch:
        patch.setattr(generation, "FUSE_PROJECTIONS", False)
        model.__dict__.pop("_lean_rl_generation_copy")
        plain = generation_copy(model)  # a new unfused copy of the updated weights
    for (name, a), (_, b) in zip(copy.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(copy(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    for mode in ("eager", "compiled"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(1)
            ours = static_cache_generate(copy, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=mode)
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]
        torch.manual_seed(1)
        theirs = static_cache_generate(plain, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=mode)
        assert torch.equal(ours, theirs) and len(set(ours.flatten().tolist())) > 3
    with pytest.raises(RuntimeError, match="called before its group's first"):
        k(torch.randn(2, 3, k.in_features, dtype=torch.bfloat16))
    bf16, *_ = _model_and_prompts()
    shared = generation_copy(bf16.to(torch.bfloat16))  # every tensor the policy's own
    assert not any(type(m).__name__.startswith("_Group") for m in shared.modules())
    # LoRA on every Linear of a bf16 base with q/k/v biases (Qwen2's): the merged weights are the copy's own, so
    # the groups fuse; the frozen biases, the base's own tensors before, become rows of the fused bias
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils.modeling import apply_lora

    config = LlamaConfig(**{**bf16.config.to_dict(), "attention_bias": True})
    torch.manual_seed(2)
    base = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    policy = apply_lora(base, r=4, alpha=8, dropout=0.0, target_modules="all-linear")
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.5)
    copy = generation_copy(policy)
    with monkeypatch.context() as patch:
        patch.setattr(generation, "FUSE_PROJECTIONS", False)
        policy.__dict__.pop("_lean_rl_generation_copy")
        plain = generation_copy(policy)
    q = copy.model.layers[0].self_attn.q_proj
    assert type(q).__name__ == "_GroupFirst" and q.bias.data_ptr() != base.model.layers[0].self_attn.q_proj.bias.data_ptr()
    for (name, a), (_, b) in zip(copy.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name
    torch.manual_seed(1)
    ours = static_cache_generate(copy, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad)
    torch.manual_seed(1)
    assert torch.equal(ours, static_cache_generate(plain, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad))


def test_generation_copy_merges_lora_as_merge_and_unload_does():
    """LoRA: each adapted weight is W + (alpha / r) B A, as peft's merge_and_unload computes it on a
    deep copy; and generating from the copy gives that merged model's greedy tokens (bf16)."""
    from copy import deepcopy

    from utils.generation import generation_copy

    model, tokenizer, ids, mask = _model_and_prompts()
    policy = _lora_policy(model)
    merged = deepcopy(policy).merge_and_unload()
    copy = generation_copy(policy)
    reference = {name: p.to(torch.bfloat16) for name, p in merged.state_dict().items()}
    assert set(copy.state_dict()) == set(reference)
    assert all(torch.equal(p, reference[name]) for name, p in copy.state_dict().items())
    q = "model.layers.1.self_attn.q_proj.weight"
    assert not torch.equal(reference[q], policy.get_base_model().state_dict()[q.replace("q_proj.", "q_proj.base_layer.")]
                           .to(torch.bfloat16))  # the adapter changed it: the check means something
    pad = tokenizer.pad_token_id
    ours = static_cache_generate(copy, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    theirs = static_cache_generate(merged.to(torch.bfloat16), ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    assert torch.equal(ours, theirs)


def test_generation_copy_dequantises_4bit_weights_and_merges_the_adapter(tmp_path):
    """QLoRA (bitsandbytes 4-bit on the CPU): adapted weights are dequantize_4bit(W) + (alpha / r)
    B A, unadapted 4-bit weights dequantize_4bit(W), the rest cast."""
    import bitsandbytes.functional as bnbf
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    from utils.generation import generation_copy

    model, *_ = _model_and_prompts()
    model.save_pretrained(tmp_path / "m")
    quantised = LlamaForCausalLM.from_pretrained(tmp_path / "m", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16))
    policy = _lora_policy(quantised)
    copy = generation_copy(policy)
    layer = policy.get_base_model().model.layers[0]
    q = layer.self_attn.q_proj
    base = bnbf.dequantize_4bit(q.base_layer.weight.data, q.base_layer.weight.quant_state).float()
    expected_q = base + 2.0 * (q.lora_B["default"].weight.float() @ q.lora_A["default"].weight.float())
    torch.testing.assert_close(copy.model.layers[0].self_attn.q_proj.weight.float(), expected_q.to(torch.bfloat16).float())
    up = layer.mlp.up_proj  # not adapted: dequantised only
    assert type(up.weight).__name__ == "Params4bit"
    torch.testing.assert_close(copy.model.layers[0].mlp.up_proj.weight.float(),
                               bnbf.dequantize_4bit(up.weight.data, up.weight.quant_state).to(torch.bfloat16).float())
    assert torch.equal(copy.model.norm.weight, policy.get_base_model().model.norm.weight.to(torch.bfloat16))


def test_int8_generation_copy_quantises_each_linear_as_torchao_does():
    """--generation_copy_dtype int8 (LoRA merged first): each Linear's codes and scales equal torchao's
    Int8WeightOnlyConfig quantisation of the merged bf16 weight (an independent implementation: symmetric,
    one scale per output row), where a value lies exactly halfway between two codes up to that tie's rounding;
    the embedding, norms and RoPE buffers are the bf16 copy's; refreshed in place after the policy changes; the copy's
    logits stay within int8's error of the bf16 copy's and its greedy tokens mostly agree."""
    from utils.generation import generation_copy
    from utils.int8 import Int8Linear

    model, tokenizer, ids, mask = _model_and_prompts()
    policy = _lora_policy(model)
    bf16 = generation_copy(policy)
    policy.__dict__.pop("_lean_rl_generation_copy")
    copy = generation_copy(policy, "int8")
    linears = {n: m for n, m in copy.named_modules() if isinstance(m, Int8Linear)}
    assert "lm_head" in linears and len(linears) == 7 * model.config.num_hidden_layers + 1
    assert not any(isinstance(m, torch.nn.Linear) for m in copy.modules())
    bf16_modules = dict(bf16.named_modules())
    for name, layer in linears.items():
        codes, scale = _torchao_codes_and_scale(_quantised(bf16_modules[name]))
        assert torch.equal(layer.scale.float(), scale.float()), name
        _assert_codes_equal_but_ties(layer.codes, codes, bf16_modules[name].weight, scale)
    assert torch.equal(copy.model.embed_tokens.weight, bf16.model.embed_tokens.weight)
    assert torch.equal(copy.model.norm.weight, bf16.model.norm.weight)
    assert all(torch.equal(b, dict(bf16.named_buffers())[n]) for n, b in copy.named_buffers()
               if not n.endswith((".codes", ".scale")))
    with torch.no_grad():
        logits_int8 = copy(input_ids=ids, attention_mask=mask).logits.float()
        logits_bf16 = bf16(input_ids=ids, attention_mask=mask).logits.float()
    error = (logits_int8 - logits_bf16).norm() / logits_bf16.norm()
    assert 0 < error < 0.05, error
    pad = tokenizer.pad_token_id
    ours = static_cache_generate(copy, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    theirs = static_cache_generate(bf16, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    assert (ours[:, 0] == theirs[:, 0]).float().mean() >= 0.75
    up = copy.model.layers[0].mlp.up_proj
    pointers = (up.codes.data_ptr(), up.scale.data_ptr())
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(2.0)
    assert generation_copy(policy, "int8") is copy and (up.codes.data_ptr(), up.scale.data_ptr()) == pointers
    reference = _quantised(policy.get_base_model().model.layers[0].mlp.up_proj)
    expected, scale = _torchao_codes_and_scale(reference)
    _assert_codes_equal_but_ties(up.codes, expected, policy.get_base_model().model.layers[0].mlp.up_proj.weight, scale)


def test_generation_copy_holds_the_policys_own_bf16_tensors(monkeypatch):
    """Where the copy would only copy a tensor (no adapter on its module, already plain bf16 on the copy's
    device), it holds the policy's own storage: the bf16 and int8 copies of a bf16 LoRA policy equal, tensor by
    tensor, copies built without sharing; they see an in-place update of the policy at once; a moved storage
    is refused; a float32 policy shares nothing."""
    import utils.generation as generation
    from utils.generation import generation_copy

    model, _, ids, mask = _model_and_prompts()
    policy = _lora_policy(model.to(torch.bfloat16))
    base = policy.get_base_model()
    for dtype in ("bfloat16", "int8"):
        copy = generation_copy(policy, dtype)
        policy.__dict__.pop("_lean_rl_generation_copy")
        with monkeypatch.context() as patch:
            patch.setattr(generation, "_shareable", lambda *a: None)
            unshared = generation_copy(policy, dtype)
        policy.__dict__["_lean_rl_generation_copy"] = copy
        own = dict(base.named_parameters())
        shared = {n for n, p in copy.named_parameters() if n in own and p.data_ptr() == own[n].data_ptr()}
        assert {"model.embed_tokens.weight", "model.norm.weight"} <= shared
        assert not any(".q_proj." in n or ".v_proj." in n for n in shared)  # adapted: merged, the copy's own
        assert ("lm_head.weight" in shared) == (dtype == "bfloat16")  # int8: codes
        assert ("model.layers.0.mlp.up_proj.weight" in shared) == (dtype == "bfloat16")
        assert not any(p.data_ptr() == own[n].data_ptr() for n, p in unshared.named_parameters() if n in own)
        for (name, a), (_, b) in zip(copy.state_dict().items(), unshared.state_dict().items()):
            assert torch.equal(a, b), name
        with torch.no_grad():
            base.model.norm.weight.mul_(2.0)
        assert torch.equal(copy.model.norm.weight, base.model.norm.weight)
        assert generation_copy(policy, dtype) is copy
        policy.__dict__.pop("_lean_rl_generation_copy")
    copy = generation_copy(policy)
    base.model.embed_tokens.weight.data = base.model.embed_tokens.weight.data.clone()
    with pytest.raises(RuntimeError, match="embed_tokens.weight, whose storage has moved"):
        generation_copy(policy)
    float32, _, _, _ = _model_and_prompts()
    copy = generation_copy(_lora_policy(float32))
    assert not any(hasattr(m, "_lean_rl_shared") for m in copy.modules())


def test_in_place_copy_merges_into_the_base_and_restores_it_bit_for_bit():
    """--generation_copy_in_place: the copy holds no storage of its own; after a refresh it equals the bf16
    copy built the usual way (every tensor); restore_merged_base gives back the exact base; a second merge
    without a restore is refused (the adapters would be added twice)."""
    from utils.generation import generation_copy, restore_merged_base

    model, *_ = _model_and_prompts()
    policy = _lora_policy(model.to(torch.bfloat16))
    base = policy.get_base_model()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    usual = generation_copy(policy)
    policy.__dict__.pop("_lean_rl_generation_copy")
    copy = generation_copy(policy, in_place=True)
    pointers = {p.data_ptr() for p in base.parameters()}
    assert all(p.data_ptr() in pointers for p in copy.parameters())  # nothing of its own
    for (name, a), (_, b) in zip(copy.state_dict().items(), usual.state_dict().items()):
        assert torch.equal(a, b), name
    q = "model.layers.1.self_attn.q_proj.base_layer.weight"
    merged = dict(base.named_parameters())[q].detach().clone()
    assert not torch.equal(merged, before[q])  # the merge wrote into the base: the checks below mean something
    with pytest.raises(RuntimeError, match="merged adapters of the last rollout"):
        generation_copy(policy, in_place=True)
    restore_merged_base(policy)
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    restore_merged_base(policy)  # nothing merged: a no-op
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    with torch.no_grad():  # an optimizer step on the adapter: the next merge follows it
        policy.get_base_model().model.layers[1].self_attn.q_proj.lora_B["default"].weight.mul_(-1.0)
    assert generation_copy(policy, in_place=True) is copy
    assert not torch.equal(dict(base.named_parameters())[q], merged)
    restore_merged_base(policy)
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("fail", [False, True])
def test_in_place_copy_samples_as_the_bf16_copy_and_leaves_the_base_exact(monkeypatch, fail):
    """A rollout from the in-place copy: the same tokens and sampling logprobs as from the usual bf16 copy
    (same seed), and the policy's base exactly as before afterwards, also when the rollout fails midway."""
    import utils.generation as generation
    from transformers import GenerationConfig

    from utils.generation import generate_completions

    model, tokenizer, ids, mask = _model_and_prompts()
    rope = {n: b.clone() for n, b in model.named_buffers()}  # float32, as from_pretrained(dtype=bf16) keeps them
    model.to(torch.bfloat16)
    for name, buffer in model.named_buffers():
        buffer.data = rope[name]
    policy = _lora_policy(model)
    base = policy.get_base_model()
    before = {n: p.detach().clone() for n, p in base.named_parameters()}
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=[10**9])
    outputs = []
    for in_place in (False, True):
        if fail and in_place:
            def broken(*args, **kwargs):
                assert not torch.equal(dict(base.named_parameters())["model.layers.0.self_attn.q_proj.base_layer.weight"],
                                       before["model.layers.0.self_attn.q_proj.base_layer.weight"])  # merged now
                raise RuntimeError("out of memory (made up)")
            monkeypatch.setattr(generation, "static_cache_generate", broken)
            with pytest.raises(RuntimeError, match="made up"):
                generate_completions(policy, ids, mask, config, [10**9], backend="static", from_copy=True,
                                     copy_in_place=True, keep_decoder=False)
            break
        torch.manual_seed(7)
        outputs.append(generate_completions(policy, ids, mask, config, [10**9], backend="static", from_copy=True,
                                            return_logprobs=True, copy_in_place=in_place, keep_decoder=False))
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    assert "_lean_rl_merged" not in policy.__dict__
    if not fail:
        (ids_a, mask_a, _, lp_a), (ids_b, mask_b, _, lp_b) = outputs
        assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b) and torch.equal(lp_a, lp_b)


def _assert_codes_equal_but_ties(codes, expected, weight, scale):
    """Equal codes, except by one where weight / scale is exactly halfway (round-half-even or not)."""
    ratio = weight.detach().to(torch.bfloat16).float() / scale.float().reshape(-1, 1)
    tie = (ratio - ratio.floor()) == 0.5
    difference = (codes.int() - expected.int()).abs()
    assert difference.max() <= 1 and not difference.bool()[~tie].any()


def test_int8_linear_refresh_in_row_chunks_equals_one_pass_and_its_product(monkeypatch):
    """Int8Linear.refresh quantises REFRESH_ROWS rows at a time (bounded temporaries): the codes and scales equal
    quantize_rows over the whole matrix, rows of zeros get scale 1, and the layer computes x @ (codes * scale)^T
    + bias."""
    import utils.int8 as int8

    torch.manual_seed(0)
    weight = torch.randn(10, 16) * 0.05
    weight[4] = 0
    bias = torch.randn(10)
    layer = int8.Int8Linear(16, 10, bias=True, dtype=torch.float32)
    monkeypatch.setattr(int8, "REFRESH_ROWS", 3)
    layer.refresh(weight, bias)
    codes, scale = int8.quantize_rows(weight)
    assert torch.equal(layer.codes, codes) and torch.equal(layer.scale, scale.float()) and scale[4] == 1
    x = torch.randn(5, 16)
    expected = x @ (codes.float() * scale.float()[:, None]).T + bias
    torch.testing.assert_close(layer(x), expected)
    assert (codes.float() * scale.float()[:, None] - weight).abs().max() <= scale.float().max() / 2 + 1e-6


def _quantised(linear):
    """torchao's int8 weight-only quantisation of a (peft-wrapped or plain) Linear's bf16 weight."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    weight = getattr(linear, "base_layer", linear).weight
    reference = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    reference.weight.data.copy_(weight)
    quantize_(reference, Int8WeightOnlyConfig())
    return reference.weight


def _torchao_codes_and_scale(weight):
    """(int8 codes [N, K], scale [N]) of torchao's Int8Tensor (per-row block_size [1, K])."""
    assert list(weight.block_size) == [1, weight.shape[1]]
    return weight.qdata, weight.scale.reshape(-1)


@pytest.mark.parametrize("script,dtype", [("train_grpo.py", "bfloat16"), ("train_ppo.py", "bfloat16"),
                                          ("train_grpo.py", "int8"), ("train_grpo.py", "in_place")])
def test_scripts_train_lora_generating_from_the_merged_copy(run, tmp_path, script, dtype):
    copy = (["--torch_dtype", "bfloat16", "--generation_copy_in_place"] if dtype == "in_place" else
            ["--generation_copy_dtype", dtype])
    result = run(["--max_steps", "2", "--use_lora", "--generation_copy", *copy,
                  "--output_dir", str(tmp_path), "--save_strategy", "no"], script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics_of(tmp_path)
    assert len(rows) == 2 and all(r["optim/grad_norm"] > 0 for r in rows)


@pytest.mark.parametrize("backend", ["hf", "static"])
@pytest.mark.parametrize("temperature, top_k, top_p, slice_size", [(1.0, 0, 1.0, None), (0.7, 20, 0.9, 2)])
def test_sampling_logprobs_equal_the_training_forward(backend, temperature, top_k, top_p, slice_size):
    """The logprob each decoding loop returns for its sampled tokens (the rollout correction's
    pi_rollout) is the training forward's, computed another way: a full forward over prompt +
    completion at the sampling temperature, before top-k / top-p (completion_logprobs), equal up
    to float32 numerics; 0 on padding. Also with slices (their rows put back in order)."""
    from utils.generation import build_generation_config, generate_completions
    from utils.ops import completion_logprobs

    model, tokenizer, ids, mask = _model_and_prompts()
    config = build_generation_config(12, temperature, top_p, top_k, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    torch.manual_seed(0)
    completion_ids, completion_mask, _, sampling_logprobs = generate_completions(
        model, ids, mask, config, [tokenizer.eos_token_id], batch_size=slice_size, backend=backend,
        return_logprobs=True)
    with torch.no_grad():
        train_logprobs, _ = completion_logprobs(model, torch.cat([ids, completion_ids], 1),
                                                torch.cat([mask, completion_mask], 1), completion_ids.shape[1],
                                                temperature)
    assert sampling_logprobs.shape == completion_ids.shape and sampling_logprobs.dtype == torch.float32
    assert completion_mask.sum() > 8 and (sampling_logprobs * completion_mask).min() < -0.5  # real draws
    torch.testing.assert_close(sampling_logprobs * completion_mask, train_logprobs * completion_mask,
                               rtol=0, atol=1e-4)
    assert (sampling_logprobs[completion_mask == 0] == 0).all()
    if top_k:  # unfiltered: the top-k / top-p renormalised distribution gives other (larger) logprobs
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits[:, -1]
        filtered = sampling_logits(logits, temperature, top_k, top_p).log_softmax(-1)
        filtered = filtered.gather(1, completion_ids[:, :1]).squeeze(1)
        assert (filtered - sampling_logprobs[:, 0]).min() > 1e-3


def _grouped_prompts(tokenizer, per_prompt=3):
    """Left-padded prompts of different lengths, each repeated per_prompt times in a row (GRPO's groups)."""
    enc = tokenizer(["1+2=", "12+34=", "7+7=", "100+1="], return_tensors="pt", padding=True, padding_side="left")
    return enc["input_ids"].repeat_interleave(per_prompt, 0), enc["attention_mask"].repeat_interleave(per_prompt, 0)


def test_distinct_prompts_are_the_runs_of_equal_rows():
    from utils.generation import distinct_prompts

    _, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 3)  # 12 rows: 4 prompts x 3
    prompt_ids, prompt_mask, prompt_row = distinct_prompts(ids, mask)
    assert prompt_ids.shape == (4, ids.shape[1]) and prompt_row.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert torch.equal(prompt_ids[prompt_row], ids) and torch.equal(prompt_mask[prompt_row], mask)
    twice = torch.cat([ids[:3], ids[:3], ids[3:]]), torch.cat([mask[:3], mask[:3], mask[3:]])  # a prompt's 2 groups
    assert distinct_prompts(*twice)[0].shape[0] == 4  # adjacent: one run
    apart = torch.cat([ids[:3], ids[3:6], ids[:3]]), torch.cat([mask[:3], mask[3:6], mask[:3]])
    assert distinct_prompts(*apart)[2].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # apart: two (what a slice holds)


@pytest.mark.parametrize("step_mode", ["eager", "compiled"])
def test_share_prompt_cache_gives_the_unshared_tokens_and_logprobs_from_one_prefill_per_prompt(step_mode):
    """--share_prompt_cache: 4 prompts x 3 rows; the prefill runs on the 4 distinct prompts,
    the decoding steps attend to their prompt's shared keys and values and to their own completion: greedy tokens
    equal the unshared cache's, and sampling from the same seed draws the same tokens with the same sampling
    logprobs up to float32 summation order (a row's prompt position order differs: left padding then the prompt's
    rounding up before the completion)."""
    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 3)
    pad = tokenizer.pad_token_id
    kwargs = dict(step_mode=step_mode)
    plain = static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, [10**9], pad, greedy=True, **kwargs)
    prefills = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: prefills.append(tuple(inputs[0].shape)) if inputs[0].shape[1] > 1 else None)
    shared = static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                   share_prompt_cache=True, **kwargs)
    hook.remove()
    assert prefills == [(4, ids.shape[1])]
    assert len({tuple(row) for row in plain.tolist()}) == 4 and torch.equal(shared, plain)
    torch.manual_seed(1)
    plain = static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, [10**9], pad, return_logprobs=True, **kwargs)
    torch.manual_seed(1)
    shared = static_cache_generate(model, ids, mask, 20, 1.0, 1.0, 0, [10**9], pad, return_logprobs=True,
                                   share_prompt_cache=True, **kwargs)
    assert len({tuple(row) for row in plain[0].tolist()}) == 12  # sampled: every row its own completion
    assert torch.equal(shared[0], plain[0])
    torch.testing.assert_close(shared[1], plain[1], rtol=0, atol=1e-4)


def test_share_prompt_cache_attends_to_the_prompt():
    """The shared path is not a no-op: with the prompt cache's keys zeroed after the prefill, the rollout changes
    (a decoding step that ignored the shared prompt would pass the equality test above only if the prompt did not
    matter)."""
    from utils import generation

    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 3)
    pad = tokenizer.pad_token_id
    plain = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    real = generation._prefill

    def prefill_then_forget(model, input_ids, mask, cache, chunk=None):
        logits = real(model, input_ids, mask, cache, chunk)
        if input_ids.shape[0] < ids.shape[0]:  # the shared prompts' prefill
            for layer in cache.layers:
                layer.values.zero_()
        return logits

    generation._prefill = prefill_then_forget
    try:
        forgot = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                       share_prompt_cache=True)
    finally:
        generation._prefill = real
    assert torch.equal(forgot[:, 0], plain[:, 0]) and not torch.equal(forgot, plain)


@pytest.mark.parametrize("batch_size", [None, 6, 5])
def test_share_prompt_cache_in_slices_and_through_generate_completions(batch_size):
    """generate_completions with --share_prompt_cache (static backend), in one slice and in slices that do and do
    not end at a group's end: every row gets the completion the unshared cache gives it (near-greedy sampling);
    the hf backend refuses the flag."""
    from utils.generation import build_generation_config, generate_completions

    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 3)
    config = build_generation_config(10, 1e-4, 1.0, 0, tokenizer.pad_token_id, [10**9])
    plain = generate_completions(model, ids, mask, config, [10**9], batch_size=batch_size, backend="static")[0]
    shared = generate_completions(model, ids, mask, config, [10**9], batch_size=batch_size, backend="static",
                                  share_prompt_cache=True)[0]
    assert len({tuple(row) for row in plain.tolist()}) == 4 and torch.equal(shared, plain)
    with pytest.raises(ValueError, match="share_prompt_cache needs a static-cache backend"):
        generate_completions(model, ids, mask, config, [10**9], backend="hf", share_prompt_cache=True)


def test_share_prompt_cache_runs_sdpa_for_a_model_on_eager_attention_and_restores_it():
    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 2)
    pad = tokenizer.pad_token_id
    plain = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    model.config._attn_implementation = "eager"
    shared = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                   share_prompt_cache=True)
    assert model.config._attn_implementation == "eager" and torch.equal(shared, plain)


def test_a_kept_shared_decoder_serves_a_rollout_with_fewer_prompts_without_compiling_again():
    """compiled (kept between rollouts): a rollout whose groups hold one prompt twice side by side (3 prompt rows
    instead of 4) decodes with the kept decoder (its fourth prompt row filled, never read; no new compile) and gives
    the unshared cache's greedy tokens."""
    from torch._dynamo.utils import counters

    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 3)
    pad = tokenizer.pad_token_id
    static_cache_generate(model, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled",
                          share_prompt_cache=True)
    shared = model.__dict__["_lean_rl_decoder"][3]
    assert shared.keep.shape[0] == 4
    frames = counters["frames"]["ok"]
    ids, mask = torch.cat([ids[:3], ids[:3], ids[6:]]), torch.cat([mask[:3], mask[:3], mask[6:]])
    ours = static_cache_generate(model, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled",
                                 share_prompt_cache=True)
    assert model.__dict__["_lean_rl_decoder"][3] is shared
    assert counters["frames"]["ok"] == frames
    model.__dict__.pop("_lean_rl_decoder")
    assert torch.equal(ours, static_cache_generate(model, ids, mask, 8, 1.0, 1.0, 0, [10**9], pad, greedy=True))


def test_share_prompt_cache_through_a_peft_lora_model_gives_the_unshared_tokens():
    """peft's LoRA model hands the `shared_prompt` keyword on to the attention: its greedy rollout with the shared
    prompt cache is the unshared one (were the keyword dropped, the steps would not see the prompt)."""
    model, tokenizer, _, _ = _model_and_prompts()
    policy = _lora_policy(model)
    ids, mask = _grouped_prompts(tokenizer, 3)
    pad = tokenizer.pad_token_id
    plain = static_cache_generate(policy, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True)
    shared = static_cache_generate(policy, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, greedy=True,
                                   share_prompt_cache=True)
    assert len({tuple(row) for row in plain.tolist()}) == 4 and torch.equal(shared, plain)


def test_a_kept_shared_decoder_is_not_reused_for_longer_prompts():
    """compiled: after a rollout of short prompts (a 128-position prompt cache), prompts of 140 positions need a
    256-position one: a new decoder, and the unshared cache's greedy tokens."""
    model, tokenizer, _, _ = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 2)
    pad = tokenizer.pad_token_id
    static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled",
                          share_prompt_cache=True)
    short = model.__dict__["_lean_rl_decoder"][3]
    assert short.keep.shape[1] == 128
    longer = 140 - ids.shape[1]
    ids = torch.cat([torch.full((len(ids), longer), pad), ids], dim=1)
    mask = torch.cat([torch.zeros(len(mask), longer, dtype=mask.dtype), mask], dim=1)
    ours = static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [10**9], pad, greedy=True, step_mode="compiled",
                                 share_prompt_cache=True)
    assert model.__dict__["_lean_rl_decoder"][3].keep.shape[1] == 256
    model.__dict__.pop("_lean_rl_decoder")
    assert torch.equal(ours, static_cache_generate(model, ids, mask, 6, 1.0, 1.0, 0, [10**9], pad, greedy=True))


def test_share_prompt_cache_refuses_sliding_window_layers_and_balanced_placement():
    """A layer with a sliding window (its window would count from the completion's first position) is refused at the
    step; --actor_device balanced (the shared prompt's tensors live on one GPU) before any model loads."""
    from types import SimpleNamespace

    from utils.cli import UsageError
    from utils.generation import SharedPrompt, packed_gqa_attention
    from utils.plan import script_args

    query, key = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 16, 8)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=2, is_causal=True, training=False)
    shared = SharedPrompt(None, torch.ones(1, 16, dtype=torch.bool), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="sliding-window attention"):
        packed_gqa_attention(module, query, key, key, torch.ones(2, 1, 1, 16, dtype=torch.bool), shared_prompt=shared,
                             sliding_window=4)
    with pytest.raises(UsageError, match="not yet with --actor_device balanced"):
        script_args("grpo", ["--share_prompt_cache", "--actor_device", "balanced"])


def test_float32_policy_decoding_products_go_through_float32_mm_and_keep_the_rollout(monkeypatch):
    """A float32 policy decoding under bf16 autocast: inside the rollout each float32 Linear's decoding products
    (<= 128 rows, no grad) go to lean_rl::float32_mm from inside the compiled step (here on the CPU, where it takes
    autocast's way: the GPU's kernel is tested under tests/gpu/); the eager step, the prefill's larger products, a
    pass with gradients and a pass without autocast keep Linear's own forward, and the forwards are put back after
    the rollout. Reference: the same rollout without the routing, whose greedy tokens and sampling logprobs it keeps
    (both take bf16 products of the same bf16-rounded operands)."""
    from utils import generation, int8

    model, tokenizer, ids, mask = _model_and_prompts()
    ids, mask = _grouped_prompts(tokenizer, 8)  # 32 rows, 4 distinct prompts (the prefill's > 128 rows)
    pad = tokenizer.pad_token_id
    step_mode = "compiled"  # on a CPU: compiled without a CUDA graph
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    with autocast():
        plain = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                      greedy=True)
        torch.manual_seed(3)
        plain_sampled = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                              return_logprobs=True)
    model.__dict__.pop("_lean_rl_decoder", None)
    monkeypatch.setattr(generation, "FLOAT32_KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(int8, "FLOAT32_KERNEL_MIN_WEIGHTS", 0)  # the toy's matrices are small
    rows = []
    real = int8._cast_then_mm
    monkeypatch.setattr(int8, "_cast_then_mm", lambda x, w, b: rows.append(x.shape[0]) or real(x, w, b))
    with warnings.catch_warnings(record=True) as caught, autocast():
        warnings.simplefilter("always")
        routed = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                       greedy=True)
        torch.manual_seed(3)
        routed_sampled = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode=step_mode,
                                               return_logprobs=True)
    linears = 7 * model.config.num_hidden_layers + 1  # q, k, v, o, gate, up, down a layer, and the LM head
    assert len(rows) >= 2 * 11 * linears and set(rows) == {ids.shape[0]}  # 11 steps a rollout, 32 rows each
    assert len({tuple(row) for row in plain.tolist()}) == 4 and torch.equal(routed, plain)
    assert torch.equal(routed_sampled[0], plain_sampled[0])
    torch.testing.assert_close(routed_sampled[1], plain_sampled[1], rtol=0, atol=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())  # put back
    assert not [w for w in caught if "torch.compile failed" in str(w.message)]  # compiled: traced, not eager
    rows.clear()
    with autocast():
        eager = static_cache_generate(model, ids, mask, 12, 1.0, 1.0, 0, [10**9], pad, step_mode="eager", greedy=True)
    assert rows == [] and eager.shape == plain.shape  # (the compiled step rounds otherwise: its own tokens)

    rows.clear()
    up = model.model.layers[0].mlp.up_proj
    x = torch.randn(4, up.in_features)
    with generation.float32_weights_through_kernel(model), autocast():
        with torch.no_grad():
            routed_product = up(x)
            up(torch.randn(129, up.in_features))  # more rows than a decoding step's
        up(x)  # gradients on: a training pass
    with generation.float32_weights_through_kernel(model), torch.no_grad():
        up(x)  # no autocast
    assert rows == [4]
    with autocast(), torch.no_grad():
        assert torch.equal(routed_product, up(x))  # autocast's own product, bit for bit


def test_float32_weights_through_kernel_picks_only_plain_float32_linears_and_keeps_autocasts_bias(monkeypatch):
    """Which layers float32_weights_through_kernel routes, and what a routed one computes: plain float32 Linears on a
    listed device only (not a bf16 one, not a Linear subclass, not one whose forward someone else replaced, nothing
    where the device is not listed), a biased one's product equal to autocast's bit for bit (CPU: autocast's way),
    fp16 autocast not routed, and every forward put back when the rollout raises."""
    from utils import generation, int8

    monkeypatch.setattr(int8, "FLOAT32_KERNEL_MIN_WEIGHTS", 0)
    rows = []
    real = int8._cast_then_mm
    monkeypatch.setattr(int8, "_cast_then_mm", lambda x, w, b: rows.append(x.shape[0]) or real(x, w, b))

    class Subclass(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 6).to(torch.bfloat16), Subclass(6, 6),
                                torch.nn.Linear(6, 6))
    hook = model[3].forward = lambda x: x  # someone else's forward, e.g. an offload hook's
    x = torch.randn(3, 8)
    with generation.float32_weights_through_kernel(model):
        assert not any("forward" in m.__dict__ for m in model[:3])  # CPU not listed (the default): nothing routed
    monkeypatch.setattr(generation, "FLOAT32_KERNEL_DEVICES", ("cuda", "cpu"))
    with generation.float32_weights_through_kernel(model):
        assert "forward" in model[0].__dict__ and not any("forward" in m.__dict__ for m in model[1:3])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            routed = model[0](x)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            model[0](x)  # fp16 autocast: Linear's own forward
    assert rows == [3] and model[3].__dict__["forward"] is hook and "forward" not in model[0].__dict__
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model[0].bias is not None and torch.equal(routed, model[0](x))
    with pytest.raises(RuntimeError, match="rollout failed"), generation.float32_weights_through_kernel(model):
        raise RuntimeError("rollout failed")
    assert "forward" not in model[0].__dict__ and model[3].__dict__["forward"] is hook
