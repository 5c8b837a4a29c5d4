"""Datasets, prompt rendering and order, and the checkpoint folder rules."""
import json
import os

import pytest

from utils import toy
from utils.checkpoint import list_checkpoints, resolve_resume
from utils.cli import UsageError
from utils.data import PromptEncoder, load_prompt_dataset, prompt_indices, render_prompt


def test_prompt_order_is_a_function_of_the_step():
    n, per_step = 10, 4
    first_epoch = prompt_indices(n, per_step, 0, seed=1) + prompt_indices(n, per_step, 1, seed=1)
    assert prompt_indices(n, per_step, 1, seed=1) == prompt_indices(n, per_step, 1, seed=1)
    third = prompt_indices(n, per_step, 2, seed=1)  # crosses into the second epoch
    assert len(third) == per_step
    assert sorted(first_epoch + third[:2]) == list(range(n))  # each row once per epoch
    assert prompt_indices(n, per_step, 0, seed=2) != prompt_indices(n, per_step, 0, seed=1)


@pytest.mark.parametrize("ext", [".json", ".jsonl", ".csv", ".parquet"])
def test_local_dataset_formats(tmp_path, ext):
    import datasets

    rows = {"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}
    path = str(tmp_path / f"d{ext}")
    ds = datasets.Dataset.from_dict(rows)
    {".json": lambda: ds.to_json(path, lines=False), ".jsonl": lambda: ds.to_json(path),
     ".csv": lambda: ds.to_csv(path, index=False), ".parquet": lambda: ds.to_parquet(path)}[ext]()
    loaded = load_prompt_dataset(path)
    assert loaded["prompt"] == rows["prompt"] and [str(a) for a in loaded["answer"]] == rows["answer"]


def test_prompt_encoder_left_truncates_and_pads(recwarn):
    tokenizer = toy.build_tokenizer()
    encode = PromptEncoder(tokenizer, max_length=5, use_chat_template=False)
    ids, mask = encode(["abcdefgh", "xy"], "cpu")
    assert tokenizer.decode(ids[0]) == "defgh"  # the end of the prompt is kept
    assert mask.tolist() == [[1] * 5, [0, 0, 0, 1, 1]]
    assert ids[1, :3].tolist() == [tokenizer.pad_token_id] * 3
    assert encode.num_truncated == 1
    assert any("longer than --max_prompt_length 5" in str(w.message) for w in recwarn)


def test_chat_template_and_system_prompt():
    tokenizer = toy.build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    text = render_prompt("2+2=", tokenizer, True, system_prompt="Answer with a number.")
    assert text == "<system>Answer with a number.\n<user>2+2=\n<assistant>"
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(messages, tokenizer, True) == "<user>hi\n<assistant>"
    assert render_prompt("2+2=", tokenizer, False) == "2+2="
    assert render_prompt("2+2=", tokenizer, False, system_prompt="S") == "S\n2+2="


def _saved_checkpoints(tmp_path, steps=(1, 2, 3), save_total_limit=None):
    """Real checkpoints of the tiny model (accelerate's files, trainer state, manifest), in-process."""
    import torch
    from accelerate import Accelerator

    from utils.checkpoint import save_checkpoint

    accelerator = Accelerator(cpu=True)
    model = toy.build_model(toy.build_tokenizer())
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    paths = [save_checkpoint(accelerator, str(tmp_path), step, {"total_skipped": step}, save_total_limit)
             for step in steps]
    return accelerator, paths


def test_latest_is_the_newest_complete_checkpoint(tmp_path):
    _saved_checkpoints(tmp_path, steps=(2, 4))
    (tmp_path / "checkpoint-6").mkdir()  # a folder without a manifest or trainer state
    (tmp_path / "checkpoint-8.tmp").mkdir()  # a crash mid-save leaves this behind: never listed
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    assert resolve_resume("latest", str(tmp_path)) == os.path.join(tmp_path, "checkpoint-4")
    with pytest.raises(UsageError, match="not a complete checkpoint: .*checkpoint-6 has no manifest.json"):
        resolve_resume(str(tmp_path / "checkpoint-6"), str(tmp_path))


def test_save_total_limit_and_atomic_rename(tmp_path):
    from utils.checkpoint import load_checkpoint

    accelerator, paths = _saved_checkpoints(tmp_path, steps=(1, 2, 3), save_total_limit=2)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-3"]
    assert load_checkpoint(accelerator, paths[-1]) == {"total_skipped": 3, "step": 3, "saved_with_manifest": True}
    manifest = json.loads((tmp_path / "checkpoint-3" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.bin", "random_states_0.pkl",
                                      "trainer_state.json"}
    assert manifest["num_processes"] == 1 and manifest["layout"]["models"] == 1


def test_an_older_runs_newer_checkpoint_is_not_pruned_and_no_new_one_is_removed(tmp_path):
    _saved_checkpoints(tmp_path, steps=(100,))  # left by an earlier run in this output_dir
    _saved_checkpoints(tmp_path, steps=(10, 20), save_total_limit=1)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-100", "checkpoint-20"]


def test_checkpoint_checksums_cover_blocks_and_name_the_damaged_bytes(tmp_path, monkeypatch):
    from utils import checkpoint
    from utils.checkpoint import CheckpointError, verify_checkpoint

    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 64 << 10)  # several blocks per file, as with multi-GB files
    _, (path,) = _saved_checkpoints(tmp_path, steps=(1,))
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert len(manifest["files"]["model.safetensors"]["crc32"]) > 4
    verify_checkpoint(path, 1)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:  # one bit, in the third block
        f.seek(150_000)
        byte = f.read(1)
        f.seek(150_000)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match=r"model.safetensors: bytes 131072-196607 do not match their checksum"):
        verify_checkpoint(path, 1)
    with pytest.raises(CheckpointError, match="saved by 1 process.*this run has 2"):
        verify_checkpoint(path, 2)
