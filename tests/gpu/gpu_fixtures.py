"""Fixtures and helpers of the GPU tests: small models saved as local folders, a CUDA-graph timer, 7b shapes."""
import pytest


@pytest.fixture
def local_model(tmp_path):
    """A 20M-parameter Llama-shaped causal LM in a local folder, with its tokenizer (the toy one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from utils import toy

    tokenizer = toy.build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


@pytest.fixture
def local_reward_model(tmp_path):
    """A tiny sequence-classification reward model with its own tokenizer (different ids)."""
    from utils import toy

    tokenizer = toy.build_tokenizer()
    tokenizer.add_tokens(["<rm_a>", "<rm_b>"])
    toy.build_sequence_classifier(tokenizer, seed=7, hidden_size=128).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    return str(tmp_path / "rm")


def graph_microseconds(fn):
    """One fn() on the GPU in microseconds: 3 eager calls first (the first autotunes), then 10 calls captured in a
    CUDA graph, replayed 20 times (printed by the kernel tests, not asserted)."""
    import time

    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 200 * 1e6


# a 7b decoding step's matrices, per layer: [N, K] and how many; 28 layers + LM head (the kernel tests)
QWEN_7B_DECODE_MATRICES = {"q/o": (3584, 3584, 2), "k/v": (512, 3584, 2), "gate/up": (18944, 3584, 2),
                           "down": (3584, 18944, 1)}
