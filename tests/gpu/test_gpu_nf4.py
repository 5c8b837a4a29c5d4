"""utils/nf4.py's Triton kernel on a GPU (skipped without CUDA): QLoRA's NF4 weights multiplied where they lie, at
7b's decoding shapes and row counts, against bitsandbytes' own dequantised weight multiplied by torch, and timed
in a CUDA graph beside bitsandbytes' 4-bit product and a bf16 F.linear (printed, not asserted)."""
import pytest
import torch
from gpu_fixtures import QWEN_7B_DECODE_MATRICES, graph_microseconds, local_model  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("rows", [1, 16, 64, 128])
def test_nf4_kernel_matches_the_dequantised_product_and_prints_its_time(rows):
    import bitsandbytes as bnb
    import torch.nn.functional as F
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Params4bit

    from utils import int8, nf4

    torch.manual_seed(rows)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step = dict(nf4=0.0, nf4_other=0.0, bnb=0.0, bf16=0.0)
    for name, (n, k, count) in QWEN_7B_DECODE_MATRICES.items():
        weight = Params4bit(torch.randn(n, k, dtype=torch.bfloat16) * 0.02, requires_grad=False, quant_type="nf4",
                            compress_statistics=True, blocksize=64).cuda()
        parts = nf4.nf4_parts(weight)
        dense = dequantize_4bit(weight.data, weight.quant_state)
        assert torch.equal(nf4.dequantize(parts), dense)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        reference = F.linear(x, dense).float()
        ours = nf4.nf4_linear(x, parts).float()  # defines the kernel, chooses the split
        def forced(split, tree):
            return nf4.LAUNCH[0](x, parts["packed"], parts["absmax"], parts["absmax2"], parts["code"],
                                 parts["code2"], parts["offset"], split, tree)

        for split in int8.split_candidates(n, k, sms):
            by_tree = forced(split, True)
            assert torch.equal(by_tree, forced(split, False)), (name, split)  # the same values, looked up two ways
            error = ((by_tree.float() - reference).norm() / reference.norm()).item()
            assert error < 1e-2, (name, split, error)
        error = ((ours - reference).norm() / reference.norm()).item()
        assert error < 1e-2, (name, error)
        chosen = nf4._SPLITS[(int8.block_rows(rows), n, k)]  # chosen with CODE_BY_TREE's lookup
        times = dict(nf4=graph_microseconds(lambda: nf4.nf4_linear(x, parts)),
                     nf4_other=graph_microseconds(lambda: forced(chosen, not nf4.CODE_BY_TREE)),
                     bnb=graph_microseconds(lambda: bnb.matmul_4bit(x, weight, quant_state=weight.quant_state)),
                     bf16=graph_microseconds(lambda: F.linear(x, dense)))
        for key in step:
            step[key] += 28 * count * times[key]
        print(f"\nrows {rows} {name} [{n} x {k}]: nf4 kernel {times['nf4']:.1f} us (split {chosen}, code by "
              f"{'tree' if nf4.CODE_BY_TREE else 'gather'}; {times['nf4_other']:.1f} us the other way), "
              f"bitsandbytes {times['bnb']:.1f} us, bf16 {times['bf16']:.1f} us; relative difference {error:.2e}")
    print(f"rows {rows}: a 7b decoding step's layer products: nf4 {step['nf4'] / 1e3:.2f} ms (the other lookup "
          f"{step['nf4_other'] / 1e3:.2f}), bitsandbytes {step['bnb'] / 1e3:.2f} ms, bf16 {step['bf16'] / 1e3:.2f} ms")


@pytest.mark.parametrize("step_mode", ["cudagraph", "compiled"])
def test_qlora_rollout_through_the_kernel_is_as_greedy_as_bitsandbytes_own(step_mode, local_model, monkeypatch):
    """A 4-bit model (as --load_in_4bit loads it) decoding with DECODE_WITH_KERNEL: prepare_decoding turns every
    Linear4bit to the kernel, the captured step calls it for each of the model's matrix shapes (compiled: without
    falling back), and the greedy rollout is as greedy, by the model's full forward, as the same rollout through
    bitsandbytes' own product."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    from test_gpu_generation import _assert_as_greedy
    from utils import nf4
    from utils.generation import static_cache_generate

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(local_model, quantization_config=config, dtype=torch.bfloat16,
                                                 device_map="cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(local_model)
    enc = tokenizer(["1+2=", "12+34=", "7+7=", "100+1="], return_tensors="pt", padding=True, padding_side="left")
    ids, mask = enc["input_ids"].cuda(), enc["attention_mask"].cuda()
    monkeypatch.setattr(nf4, "DECODE_WITH_KERNEL", True)
    assert nf4.prepare_decoding(model) == 6 * 7  # 6 layers x q, k, v, o, gate, up, down
    nf4._SPLITS.clear()  # the op records each shape's split at its first call: how the kernel is seen to run
    rollouts = []
    for through_kernel in (True, False):
        if not through_kernel:  # the same layers without their parts: bitsandbytes' own product
            for module in model.modules():
                module.__dict__.pop("_lean_rl_nf4", None)
        model.__dict__.pop("_lean_rl_decoder", None)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rollouts.append(static_cache_generate(model, ids, mask, 32, 1.0, 1.0, 0, [10**9],
                                                  tokenizer.pad_token_id, step_mode=step_mode, greedy=True))
        assert not [w for w in caught if "torch.compile failed" in str(w.message)]
        if through_kernel:
            assert {key[1:] for key in nf4._SPLITS} == {(512, 512), (128, 512), (1536, 512), (512, 1536)}
    _assert_as_greedy(model, ids, mask, rollouts[0], rollouts[1], step_mode, "nf4 kernel", "bitsandbytes")
