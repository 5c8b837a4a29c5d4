"""Fixtures of the GPU tests: small models saved as local folders."""
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
