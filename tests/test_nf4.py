"""utils/nf4.py on the CPU: QLoRA's NF4 weights (bitsandbytes' packed codes and double-quantised statistics) read
by our own code, against bitsandbytes' dequantize_4bit as the reference; the Triton kernel in Triton's CPU
interpreter where Triton is installed (skipped otherwise; its GPU test is tests/gpu/test_gpu_nf4.py)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from utils.nf4 import dequantize, nf4_linear, nf4_parts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quantized(n, k, seed=0, **kwargs):
    from bitsandbytes.nn import Params4bit

    torch.manual_seed(seed)
    weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    options = dict(quant_type="nf4", compress_statistics=True, blocksize=64) | kwargs
    return Params4bit(weight, requires_grad=False, **options)._quantize("cpu")


@pytest.mark.parametrize("n,k", [(96, 1024), (257, 192), (8, 64)])
def test_dequantize_is_bitsandbytes_own_dequantisation_bit_for_bit(n, k):
    """Our reading of the packed codes (high nibble first) and the nested statistics (code2[absmax code] *
    absmax2[block // 256] + offset) gives bitsandbytes' dequantize_4bit exactly, also where the last block of 256
    statistics is partial (257 x 192: 771 blocks of 64)."""
    from bitsandbytes.functional import dequantize_4bit

    weight = quantized(n, k)
    expected = dequantize_4bit(weight.data, weight.quant_state)
    got = dequantize(nf4_parts(weight))
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    assert torch.equal(got, expected)


def test_nf4_linear_off_the_kernel_is_linear_on_the_dequantised_weight():
    """On a CPU (no kernel) nf4_linear is F.linear on the dequantised weight, any leading shape, with a bias."""
    from bitsandbytes.functional import dequantize_4bit

    weight = quantized(96, 256)
    parts = nf4_parts(weight)
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    bias = torch.randn(96, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, dequantize_4bit(weight.data, weight.quant_state), bias)
    assert torch.equal(nf4_linear(x, parts, bias), expected)


def test_nf4_parts_refuses_what_the_kernel_does_not_read():
    """fp4 codes, statistics not nested, other block sizes: one ValueError naming what --load_in_4bit stores."""
    for kwargs in (dict(quant_type="fp4"), dict(compress_statistics=False), dict(blocksize=128)):
        with pytest.raises(ValueError, match="what --load_in_4bit stores"):
            nf4_parts(quantized(32, 256, **kwargs))


def test_nf4_parts_refuses_a_code_table_other_than_the_kernels_constants(monkeypatch):
    """The kernel's select tree holds NF4_CODE's values: a weight whose code table differs (a bitsandbytes that
    changed its NF4 levels) is refused, so prepare_decoding leaves it to bitsandbytes; the check runs once."""
    import utils.nf4 as nf4

    monkeypatch.setattr(nf4, "_CODE_CHECKED", [])
    weight = quantized(32, 256)
    weight.quant_state.code = weight.quant_state.code.clone()
    weight.quant_state.code[3] += 1e-3
    with pytest.raises(ValueError, match="differs from NF4_CODE"):
        nf4_parts(weight)
    assert nf4._CODE_CHECKED == []
    weight.quant_state.code[3] -= 1e-3
    assert tuple(weight.quant_state.code.tolist()) == nf4.NF4_CODE
    nf4_parts(weight)
    assert nf4._CODE_CHECKED == [True]


INTERPRETED = r"""
import torch
from bitsandbytes.nn import Params4bit
from bitsandbytes.functional import dequantize_4bit
import utils.nf4 as nf4

torch.manual_seed(0)
nf4._define_kernel()
worst = 0.0
for n, k in [(96, 1024), (40, 192)]:
    weight = Params4bit(torch.randn(n, k, dtype=torch.bfloat16) * 0.02, requires_grad=False, quant_type="nf4",
                        compress_statistics=True, blocksize=64)._quantize("cpu")
    parts = nf4.nf4_parts(weight)
    w = dequantize_4bit(weight.data, weight.quant_state).to(torch.float16).float()
    for rows in (1, 5, 16, 33):
        x = torch.randn(rows, k, dtype=torch.float16)
        for split in (1, 2):
            y, y_gathered = (nf4.LAUNCH[0](x, parts["packed"], parts["absmax"], parts["absmax2"], parts["code"],
                                           parts["code2"], parts["offset"], split, tree) for tree in (True, False))
            assert y.shape == (rows, n) and y.dtype == torch.float16, (y.shape, y.dtype)
            assert torch.equal(y, y_gathered), "the select tree's values differ from the code table's"
            ref = x.float() @ w.T
            worst = max(worst, ((y.float() - ref).abs().max() / ref.abs().max()).item())
print("worst relative error", worst)
assert worst < 1e-2, worst
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_in_the_triton_interpreter_matches_the_dequantised_product():
    """The kernel's indexing (byte, nibble, block of 64, block of 256), masks (rows and a K that is not a multiple
    of the K tile) and split-K partial sums, run by Triton's CPU interpreter: within fp16 rounding of x @ W^T
    on bitsandbytes' dequantised weight; the code looked up by the select tree (NF4_CODE's constants) gives the
    same output bit for bit as the code gathered from the weight's own table. float16 x: with bf16 x the interpreter (Triton 3.9) gave products of
    ~1e12 where float16 and float32 x gave the right ones; the GPU test covers bf16."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worst relative error" in done.stdout


def test_a_layer_turned_to_the_kernel_stays_bitsandbytes_off_the_gpu(monkeypatch):
    """prepare_decoding leaves a CPU model alone (nothing on a GPU; and nothing at all while DECODE_WITH_KERNEL is
    off); a layer of the decoding class is still a Linear4bit and, off the GPU or with gradient, answers with
    bitsandbytes' own forward."""
    from bitsandbytes.nn import Linear4bit

    from utils import nf4

    torch.manual_seed(0)
    layer = Linear4bit(128, 64, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True)
    layer.load_state_dict(torch.nn.Linear(128, 64).state_dict())
    layer.weight = layer.weight._quantize("cpu")
    model = torch.nn.Sequential(layer)
    assert nf4.prepare_decoding(model) == 0
    monkeypatch.setattr(nf4, "DECODE_WITH_KERNEL", True)
    if nf4._triton_ready():
        assert nf4.prepare_decoding(model) == 0 and type(layer) is Linear4bit
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    expected = layer(x)
    layer.__class__ = nf4._decoding_class(Linear4bit)
    layer.__dict__["_lean_rl_nf4"] = nf4.nf4_parts(layer.weight)
    assert isinstance(layer, Linear4bit)
    with torch.no_grad():
        assert torch.equal(layer(x), expected)
