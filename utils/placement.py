"""Per-role device placement: --actor_device, --critic_device, --reward_device, --ref_device.

Each flag takes one of
  cpu | cuda | cuda:N           the whole role on one device
  balanced (or auto)            the role's layers split over this process's GPUs (a device_map)
  offload                       weights in CPU memory, run on --offload_execution_device through
                                accelerate's cpu_offload: streamed layer by layer (frozen roles only)
  swap                          weights in pinned CPU memory, copied whole to --offload_execution_device
                                for the role's phase and dropped after (frozen roles, and PPO's critic:
                                its optimizer state too, both copied back after its update; one process)
and defaults to the process's own device (the one accelerate gives it).

Several processes on one machine: with L processes and G visible GPUs, process r owns GPUs
r, r + L, r + 2L, ... (its accelerate device is the first of them). `cuda:N` means the N-th GPU
that the process owns, so one command line is valid on every rank and no two processes ever
place a role on the same GPU. One process owns all GPUs, so there cuda:N is the physical GPU N.
Trained roles (actor, critic) stay on the process's device under DDP; frozen roles go anywhere.

Tensors follow the models: `model_input_device(model)` says where a role's inputs must go, and
the helpers in utils/ops.py move inputs there and results back."""

import os
from dataclasses import dataclass, field

import torch

from utils.base import own_gpus
from utils.cli import UsageError

ROLES = ("actor", "critic", "reward", "ref")
TRAINED_ROLES = ("actor", "critic")
_VALID = "cpu, cuda, cuda:N, balanced (or auto), offload or swap"


@dataclass
class Placement:
    role: str
    kind: str  # "device" | "balanced" | "offload" | "swap" | "adapter" (LoRA reference: the policy, adapter disabled)
    device: torch.device  # where inputs go: the device, the first balanced GPU, or the offload execution device
    gpus: list = field(default_factory=list)  # physical GPU ids a balanced role may use
    num_params: int = 0  # recorded by place_model, for the placement table
    num_bytes: int = 0
    layer_devices: list = field(default_factory=list)  # balanced: the devices the layers landed on

    def describe(self) -> str:
        if self.kind == "balanced":
            return "balanced: layers on " + ", ".join(str(d) for d in self.layer_devices)
        if self.kind == "offload":
            return f"cpu memory, runs on {self.device} (offload)"
        if self.kind == "swap":
            return f"cpu memory, on {self.device} for its phase (swap)"
        if self.kind == "adapter":
            return f"the actor with its LoRA adapter disabled ({self.device})"
        return str(self.device)


def normalize_device(device) -> torch.device:
    """`cuda` -> `cuda:<current>` and `cpu:0` -> `cpu` (accelerate says either, depending on the
    launch; offload hooks and comparisons want one spelling)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        return torch.device("cpu")
    return device


def _local_topology():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    return local_rank, local_processes, torch.cuda.device_count()


def _parse_device(flag, value, gpus, num_gpus, local_processes):
    """'cpu' | 'cuda' | 'cuda:N' (N-th own GPU) -> torch.device, or raise UsageError."""
    if value == "cpu":
        return torch.device("cpu")
    if value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit()):
        index = 0 if value == "cuda" else int(value[5:])
        if not gpus:
            raise UsageError(f"{flag} {value}: no CUDA GPU is visible to this process; use cpu")
        if index >= len(gpus):
            owned = ", ".join(f"cuda:{i}" for i in range(len(gpus)))
            where = (f"this process owns {len(gpus)} of the {num_gpus} visible GPUs ({local_processes} processes)"
                     if local_processes > 1 else f"{num_gpus} GPUs are visible")
            raise UsageError(f"{flag} {value}: no such GPU; {where}: valid are {owned} or cpu")
        return torch.device("cuda", gpus[index])
    return None


def devices_used(home, placements) -> list:
    """Every device this process uses: its own, each role's, and every GPU a balanced role may split over."""
    return [home] + [p.device for p in placements.values()] + [f"cuda:{g}" for p in placements.values() for g in p.gpus]


def resolve_placements(specs: dict, default_device, offload_execution_device=None, num_processes=1):
    """specs: role -> flag value or None. Returns role -> Placement, or raises UsageError naming
    the flag, the value and the devices that exist. Needs no model."""
    local_rank, local_processes, num_gpus = _local_topology()
    gpus = own_gpus(local_rank, local_processes, num_gpus)
    default_device = normalize_device(default_device)
    placements = {}
    for role, value in specs.items():
        flag = f"--{role}_device"
        if value is None:
            placements[role] = Placement(role, "device", default_device)
            continue
        value = value.strip().lower()
        device = _parse_device(flag, value, gpus, num_gpus, local_processes)
        if device is not None:
            if role in TRAINED_ROLES and num_processes > 1 and device != default_device:
                raise UsageError(f"{flag} {value}: with {num_processes} processes the trained roles (actor, critic) "
                                 "stay on each process's own device (DDP); place the frozen roles (ref, reward) freely")
            placements[role] = Placement(role, "device", device)
        elif value in ("balanced", "auto"):
            if not gpus:
                raise UsageError(f"{flag} {value}: splitting layers needs GPUs and none is visible; use cpu")
            if role in TRAINED_ROLES and num_processes > 1:
                raise UsageError(f"{flag} {value}: a trained role split over GPUs cannot be used with "
                                 f"{num_processes} DDP processes; run one process, or split only frozen roles")
            placements[role] = Placement(role, "balanced", torch.device("cuda", gpus[0]), list(gpus))
        elif value in ("offload", "swap"):
            if role == "critic" and value == "swap":  # in its values and update phases only (train_ppo.py)
                if num_processes > 1:
                    raise UsageError(f"{flag} swap: a swapped critic needs one process; with {num_processes} DDP "
                                     "processes the trained roles stay on each process's own device")
            elif role in TRAINED_ROLES:
                raise UsageError(f"{flag} {value}: {value} is for frozen roles (ref, reward)"
                                 + (" and the critic (swap)" if value == "swap" else "") + f"; the {role} is trained"
                                 + (" in every phase" if role == "actor" else ""))
            placements[role] = Placement(role, value, torch.device("cpu"))  # execution device set below
        else:
            raise UsageError(f"{flag} {value}: expected {_VALID}")
    if offload_execution_device is not None:
        exec_device = _parse_device("--offload_execution_device", offload_execution_device.strip().lower(), gpus,
                                    num_gpus, local_processes)
        if exec_device is None:
            raise UsageError(f"--offload_execution_device {offload_execution_device}: expected cpu, cuda or cuda:N")
    else:  # default: the actor's GPU
        actor = placements.get("actor")
        exec_device = actor.device if actor is not None else default_device
    for placement in placements.values():
        if placement.kind in ("offload", "swap"):
            placement.device = exec_device
    return placements


def place_model(model, placement: Placement):
    """Put a (CPU-loaded) model where its placement says; remember where its inputs go."""
    from accelerate import cpu_offload, dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    placement.num_params = sum(p.numel() for p in model.parameters())
    placement.num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if placement.kind == "device":
        if not (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)):
            model.to(placement.device)  # a bitsandbytes model was loaded onto its device and cannot move
    elif placement.kind == "balanced":
        no_split = getattr(model, "_no_split_modules", None) or []
        max_memory = {g: torch.cuda.mem_get_info(g)[0] for g in placement.gpus}
        balanced = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split)
        device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
        if any(d in ("cpu", "disk") for d in device_map.values()):
            raise RuntimeError(f"--{placement.role}_device balanced: the {placement.role} does not fit in "
                               f"the GPUs {placement.gpus}")
        model = dispatch_model(model, device_map=device_map)
        used = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in device_map.values()]
        placement.layer_devices = sorted(set(used), key=str)
        placement.device = used[0]  # the embeddings come first
    elif placement.kind == "swap":  # CPU memory, the whole model on the execution device for its phase
        from utils.offload import PhaseSwap

        model.to("cpu")
        model.lean_rl_swap = PhaseSwap(model, placement.device)
    else:  # offload: one CPU copy of the weights, streamed to the execution device module by module
        model = cpu_offload(model.to("cpu"), execution_device=placement.device)
    model.lean_rl_placement = placement
    return model


def prepare_trained(accelerator, model, optimizer, placement: Placement):
    """accelerate's prepare for a trained role: the usual path (DDP, engines) on the process's
    device; a single-process custom placement (or --param_offload) keeps its devices."""
    offloaded = getattr(model, "lean_rl_param_offload", None) is not None
    if placement.kind == "device" and placement.device == normalize_device(accelerator.device) and not offloaded:
        return accelerator.prepare(model, optimizer)
    model = accelerator.prepare_model(model, device_placement=False)
    return model, accelerator.prepare_optimizer(optimizer, device_placement=False)


def model_input_device(model) -> torch.device:
    """Where a role's inputs must be: recorded by place_model, else its first parameter's device."""
    model = getattr(model, "module", model)  # DDP
    placement = getattr(model, "lean_rl_placement", None)
    if placement is not None:
        return placement.device
    offload = getattr(model, "lean_rl_param_offload", None)  # its first parameter is on the CPU
    if offload is not None:
        return offload.device
    return next(model.parameters()).device


def placement_table(rows) -> str:
    """rows: (role, Placement, trainable) -> the start-of-run table (sizes as placed)."""
    lines = [f"{'role':<7} {'device(s)':<44} {'parameters':>18}  state", "-" * 80]
    for role, placement, trainable in rows:
        count = placement.num_params
        size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
        lines.append(f"{role:<7} {placement.describe():<44} {size:>8} {placement.num_bytes / 1e9:>7.3f}GB  "
                     f"{'trainable' if trainable else 'frozen'}")
    return "\n".join(lines)
