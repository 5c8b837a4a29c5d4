"""Per-role placement: parsing, validation messages, and the multi-process GPU ownership rule."""
import pytest
import torch

from utils.cli import UsageError
from utils.placement import own_gpus, resolve_placements


@pytest.mark.parametrize("rank, processes, gpus, owned", [
    (0, 1, 4, [0, 1, 2, 3]), (1, 4, 8, [1, 5]), (3, 4, 8, [3, 7]), (0, 2, 1, [0]), (1, 2, 1, [0]), (0, 1, 0, []),
])
def test_own_gpus_rule(rank, processes, gpus, owned):
    assert own_gpus(rank, processes, gpus) == owned


def test_ranks_never_share_a_gpu():
    for gpus in (2, 4, 8):
        for processes in (1, 2, 4):
            if processes > gpus:
                continue
            owned = [g for rank in range(processes) for g in own_gpus(rank, processes, gpus)]
            assert sorted(owned) == list(range(gpus))


def resolve(specs, exec_device=None, num_processes=1, default="cpu"):
    return resolve_placements(specs, default, exec_device, num_processes)


@pytest.mark.parametrize("specs, message", [
    ({"ref": "cuda:0"}, "--ref_device cuda:0: no CUDA GPU is visible to this process; use cpu"),
    ({"reward": "cdua:0"}, "--reward_device cdua:0: expected cpu, cuda, cuda:N, balanced (or auto), offload or swap"),
    ({"critic": "balanced"}, "--critic_device balanced: splitting layers needs GPUs and none is visible"),
    ({"actor": "offload"}, "--actor_device offload: offload is for frozen roles (ref, reward); the actor is trained"),
    ({"actor": "gpu"}, "--actor_device gpu: expected"),
])
def test_errors_without_gpus(monkeypatch, specs, message):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(UsageError) as exc:
        resolve(specs)
    assert message in str(exc.value)


def test_cpu_and_offload_without_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    p = resolve({"actor": None, "critic": "cpu", "ref": "offload", "reward": "OFFLOAD"})
    assert [p[r].kind for r in ("actor", "critic", "ref", "reward")] == ["device", "device", "offload", "offload"]
    assert p["ref"].device == torch.device("cpu") and "offload" in p["ref"].describe()
    with pytest.raises(UsageError, match="--offload_execution_device cuda:0: no CUDA GPU"):
        resolve({"ref": "offload"}, exec_device="cuda:0")


def test_swap_is_for_frozen_roles_and_the_critic_and_runs_on_the_execution_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p = resolve({"actor": None, "critic": "swap", "ref": "swap", "reward": "SWAP"}, default="cuda:0")
    assert (p["critic"].kind, p["ref"].kind, p["reward"].kind) == ("swap", "swap", "swap")
    assert p["ref"].device == torch.device("cuda", 0) and "for its phase (swap)" in p["ref"].describe()
    assert p["critic"].device == torch.device("cuda", 0)
    assert resolve({"ref": "swap"}, exec_device="cuda:1", default="cuda:0")["ref"].device == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="--actor_device swap: swap is for frozen roles .* and the critic .*the actor "
                                         "is trained in every phase"):
        resolve({"actor": "swap"}, default="cuda:0")
    with pytest.raises(UsageError, match="--critic_device swap: a swapped critic needs one process; with 2 DDP"):
        resolve({"critic": "swap"}, default="cuda:0", num_processes=2)
    with pytest.raises(UsageError, match="--critic_device offload: offload is for frozen roles"):
        resolve({"critic": "offload"}, default="cuda:0")


def test_four_gpus_one_process(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    p = resolve({"actor": "cuda:0", "critic": "cuda:1", "reward": "cuda:2", "ref": "cuda:3"}, default="cuda:0")
    assert [p[r].device for r in ("actor", "critic", "reward", "ref")] == [torch.device("cuda", i) for i in range(4)]
    with pytest.raises(UsageError) as exc:
        resolve({"ref": "cuda:4"}, default="cuda:0")
    assert str(exc.value) == ("--ref_device cuda:4: no such GPU; 4 GPUs are visible: valid are "
                              "cuda:0, cuda:1, cuda:2, cuda:3 or cpu")
    p = resolve({"actor": "balanced", "ref": "offload"}, exec_device="cuda:2", default="cuda:0")
    assert p["actor"].gpus == [0, 1, 2, 3] and p["ref"].device == torch.device("cuda", 2)
    p = resolve({"actor": "cuda:1", "ref": "offload"}, default="cuda:0")
    assert p["ref"].device == torch.device("cuda", 1)  # offloaded roles run on the actor's GPU by default


def test_process_relative_gpus(monkeypatch):
    """8 GPUs, 4 processes: rank 1 owns physical GPUs 1 and 5; cuda:1 means physical 5."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    p = resolve({"actor": None, "ref": "cuda:1", "reward": "balanced"}, num_processes=4, default="cuda:1")
    assert p["ref"].device == torch.device("cuda", 5) and p["reward"].gpus == [1, 5]
    with pytest.raises(UsageError, match=r"this process owns 2 of the 8 visible GPUs \(4 processes\): valid are cuda:0, cuda:1"):
        resolve({"ref": "cuda:2"}, num_processes=4, default="cuda:1")
    with pytest.raises(UsageError, match="trained roles .* stay on each process's own device"):
        resolve({"critic": "cuda:1"}, num_processes=4, default="cuda:1")
    with pytest.raises(UsageError, match="cannot be used with 4 DDP processes"):
        resolve({"actor": "balanced"}, num_processes=4, default="cuda:1")
