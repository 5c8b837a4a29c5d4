"""Checkpoints on a GPU (skipped without CUDA): the CUDA RNG states. Run on the device machine:
    python -m pytest -q -s tests/gpu/test_gpu_checkpoints.py
"""
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FLAKY = '''
import os

from utils.rewards import accuracy

calls = 0


def flaky(completions, **columns):
    global calls
    calls += 1
    if calls == int(os.environ.get("FLAKY_FAILS_AT_CALL", "0")):
        raise ValueError("flaky")  # the scripts report it as this function failing at this step
    return accuracy(completions, **columns)
'''


def test_save_on_error_keeps_the_cuda_rng_of_the_last_finished_step(run, tmp_path):
    """A reward failing in step 3 saves checkpoint-2 with the RNG states (CPU and CUDA) as step 2
    left them: the same as a periodic save after step 2 of the same run; the resume accepts them."""
    (tmp_path / "flaky.py").write_text(FLAKY)
    args = ["--max_steps", "4", "--debug", "--reward_funcs", f"{tmp_path / 'flaky.py'}:flaky"]
    periodic = run([*args, "--save_steps", "2", "--output_dir", str(tmp_path / "periodic")])
    assert periodic.returncode == 0, periodic.stderr[-3000:]
    failed = run([*args, "--save_steps", "0", "--output_dir", str(tmp_path / "failed")],
                 env={"FLAKY_FAILS_AT_CALL": "3"})
    assert failed.returncode == 1 and "saved " in failed.stderr, failed.stderr[-3000:]

    def rng(folder):
        return torch.load(os.path.join(folder, "checkpoint-2", "random_states_0.pkl"), weights_only=False)

    a, b = rng(tmp_path / "periodic"), rng(tmp_path / "failed")
    assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"])
    assert len(a["torch_cuda_manual_seed"]) == len(b["torch_cuda_manual_seed"]) > 0
    for x, y in zip(a["torch_cuda_manual_seed"], b["torch_cuda_manual_seed"]):
        assert torch.equal(x, y)
    resumed = run([*args, "--output_dir", str(tmp_path / "failed"), "--resume_from_checkpoint", "latest"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "steps 2->4" in resumed.stdout
