"""The few places where a script run under an engine (`accelerate launch --config_file
accelerate_configs/deepspeed_zero{2,3}.yaml | fsdp2.yaml`) must differ from DDP:

- which flags combine with the engine (checked before any model loads);
- what DeepSpeed needs that accelerate fills from dataloaders we do not use (micro-batch size,
  gradient clipping);
- the end of an update's micro-batches: DDP/FSDP2 skip the gradient all-reduce with `no_sync`;
  a DeepSpeed engine is told where the accumulation boundary is and steps itself there;
- generation: ZeRO-3 and FSDP2 hold a shard of each weight; the policy is gathered once for the
  whole rollout (--gather_for_generation) instead of layer by layer at every decoding step;
- frozen models: under ZeRO-3 they are sharded too (ZeRO-3 inference); otherwise replicated.
"""
from contextlib import contextmanager, nullcontext

from accelerate.utils import DistributedType

from utils.base import CAPTURED_BACKENDS
from utils.cli import UsageError


def engine_of(accelerator) -> str:
    """single | ddp | zero1 | zero2 | zero3 | fsdp2 | fsdp1"""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return f"zero{accelerator.state.deepspeed_plugin.zero_stage}"
    if accelerator.distributed_type == DistributedType.FSDP:
        return "fsdp2" if accelerator.is_fsdp2 else "fsdp1"
    return "ddp" if accelerator.num_processes > 1 else "single"


def check_engine_args(args, engine, trained_roles=("actor",)):
    """Flags that an engine cannot honour fail here, before any model loads, saying what to use."""
    if engine in ("single", "ddp"):
        return
    if engine == "fsdp1":
        raise UsageError("FSDP version 1: use FSDP2 (fsdp_version: 2 in the accelerate config, as in "
                         "accelerate_configs/fsdp2.yaml)")
    sharded = engine in ("zero3", "fsdp2")
    where = f"under {engine} (accelerate config)"
    if getattr(args, "optimizer_offload", False):
        raise UsageError(f"--optimizer_offload {where}: the engine holds the optimizer state; for it in CPU memory use "
                         "accelerate_configs/deepspeed_zero3_offload.yaml")
    if args.param_offload:
        raise UsageError(f"--param_offload {where}: the engine places the weights; for weights in CPU memory use "
                         "accelerate_configs/deepspeed_zero3_offload.yaml")
    if args.load_in_4bit or args.load_in_8bit:
        raise UsageError(f"--load_in_{4 if args.load_in_4bit else 8}bit {where}: quantised weights cannot be "
                         "sharded or stepped by the engine; use DDP (accelerate_configs/multi_gpu.yaml) for QLoRA")
    if args.use_lora and sharded:
        raise UsageError(f"--use_lora {where}: not supported (the adapter would be merged into sharded weights at "
                         "the end); use deepspeed_zero2.yaml or DDP for LoRA")
    if args.optim != "adamw_torch":
        raise UsageError(f"--optim {args.optim} {where}: the engine shards the optimizer state already; use "
                         "--optim adamw_torch")
    if sharded and getattr(args, "generation_backend", "hf") in CAPTURED_BACKENDS:
        raise UsageError(f"--generation_backend {args.generation_backend} {where}: the gathered weights get new "
                         "addresses at each rollout, which a replayed CUDA graph cannot follow; use --generation_backend "
                         "static (or hf)")
    if sharded and getattr(args, "torch_compile", False):
        raise UsageError(f"--torch_compile {where}: the engine wraps each layer with its own gathering hooks, which "
                         "the compiled layers are not tested with; leave --torch_compile off (or use DDP/ZeRO-2)")
    if sharded and getattr(args, "generation_copy", False):
        raise UsageError(f"--generation_copy {where}: each rank holds a shard of the weights, not the whole copy "
                         "to refresh; generate from the gathered weights (leave --generation_copy off)")
    if engine == "fsdp2" and args.torch_dtype == "bfloat16":
        raise UsageError("--torch_dtype bfloat16 under fsdp2: the sharded weights would be stepped in bf16, where "
                         "RL-sized updates round away; keep float32 weights (FSDP2 computes in bf16 under "
                         "--mixed_precision bf16)")
    for role in trained_roles:
        if getattr(args, f"{role}_device", None) is not None:
            raise UsageError(f"--{role}_device {getattr(args, f'{role}_device')} {where}: the engine places the "
                             f"trained models on each process's GPU; leave --{role}_device unset")
    if engine == "zero3":
        for role in ("ref", "reward"):
            if getattr(args, f"{role}_device", None) is not None:
                raise UsageError(f"--{role}_device {getattr(args, f'{role}_device')} under zero3: the frozen models "
                                 f"are sharded by ZeRO-3 like the trained ones; leave --{role}_device unset")


def configure_engine(accelerator, args, engine):
    """DeepSpeed: the values accelerate would take from a dataloader, and gradient clipping by
    --max_grad_norm (DeepSpeed clips inside its step). Call before `prepare`."""
    if not engine.startswith("zero"):
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    config["gradient_accumulation_steps"] = 1  # the scripts mark the last micro-batch themselves
    config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    config["train_batch_size"] = args.per_device_train_batch_size * accelerator.num_processes
    config["gradient_clipping"] = args.max_grad_norm or 0.0
    # with offload_optimizer, DeepSpeed wants its own CPU Adam (a C++ build); torch's AdamW steps the
    # CPU partitions correctly, only slower
    config["zero_force_ds_cpu_optimizer"] = False


def micro_batch_sync(accelerator, model, last):
    """Context for one micro-batch's forward and backward: DDP and FSDP2 reduce gradients only
    after the last micro-batch of an update (`no_sync` before it). DeepSpeed: see `backward`."""
    if last or accelerator.distributed_type == DistributedType.DEEPSPEED:
        return nullcontext()
    return accelerator.no_sync(model)


def backward(accelerator, model, loss, last):
    """One micro-batch's backward. A DeepSpeed engine is told whether this is the update's last
    micro-batch and then steps (clip, optimizer, zero grad) itself; called on the engine directly,
    as accelerate's `backward` knows only the first engine prepared (PPO trains two)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        model.set_gradient_accumulation_boundary(last)
        model.backward(loss)
        if last:
            model.step()
    else:
        accelerator.backward(loss)


@contextmanager
def gathered_for_generation(engine, model, enabled=True):
    """ZeRO-3 / FSDP2 (`engine` as engine_of says; `model` as prepared): the policy's full weights
    on each GPU for the rollout, sharded again after. Costs one full copy of the weights for the
    phase; saves an all-gather of every layer at every decoding step. Under ZeRO-3 DeepSpeed's
    per-module hooks are also taken off for the phase: with the weights already gathered they only
    cost time, at every module of every decoding step. Nothing to do for the other engines or with
    enabled=False."""
    if not enabled or engine not in ("zero3", "fsdp2"):
        yield
        return
    if engine == "zero3":
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            with _without_zero3_hooks(model):
                yield
        return
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_reshard_after_forward(False, recurse=False)  # stay unsharded across decoding steps
        m.unshard()
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


@contextmanager
def _without_zero3_hooks(ds_engine):
    """A ZeRO-3 engine's module without DeepSpeed's fetch/release hooks inside, put back after
    (the parameters must be gathered meanwhile). Uses DeepSpeed's own removal and registration."""
    from deepspeed.runtime.zero import parameter_offload

    optimizer = ds_engine.optimizer
    offload = getattr(optimizer, "parameter_offload", optimizer)  # trained: inside the ZeRO-3 optimizer
    for p in offload.module.parameters():
        p.ds_active_sub_modules.clear()  # no module holds a gathered parameter through the hooks now
    offload._remove_module_hooks()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        yield
    finally:
        stack = list(parameter_offload.FWD_MODULE_STACK)
        offload.setup_zero_stage3_hooks()
        parameter_offload.FWD_MODULE_STACK[:] = stack  # setup pushes the root once more; keep the stack as it was


def prepare_frozen(accelerator, model, engine, micro_batch_size):
    """A frozen model (reference, reward) under the engine: ZeRO-3 shards it (inference, no
    optimizer); the other engines keep the replica already placed on the process's device."""
    if engine != "zero3" or model is None:
        return model
    import deepspeed

    zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
    offload = dict(zero.get("offload_param") or {"device": "none"})  # a copy: DeepSpeed may fill it in
    config = {"train_micro_batch_size_per_gpu": micro_batch_size,
              "zero_optimization": {"stage": 3, "offload_param": offload},
              "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
              "fp16": {"enabled": accelerator.mixed_precision == "fp16"}}
    ds_engine, *_ = deepspeed.initialize(model=model, config=config)
    ds_engine.eval()
    model = ds_engine.module
    model.lean_rl_ds_engine = ds_engine  # keeps the engine (and its hooks) alive
    return model


def replicas_comparable(engine) -> bool:
    """Whether every rank holds the whole trained model (then their fingerprints must agree)."""
    return engine in ("ddp", "zero1", "zero2")
