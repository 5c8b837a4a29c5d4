"""Moving training memory to the CPU without changing the math.

- Activation offload (--activation_offload): with gradient checkpointing each decoder layer
  keeps only its input for the backward recompute. Here that input is copied into pinned CPU
  memory on a side stream during forward, and in backward it is copied back, the previous
  layer's input prefetched while this layer recomputes. Installed as the checkpoint function of
  transformers' checkpointed layers, so it works for any model that supports checkpointing.
- Parameter offload (--param_offload, --offload_policy): the named Linear/Embedding modules'
  weights live in pinned CPU memory; each use copies them to the GPU (a differentiable copy, so
  their gradients, and the optimizer state built on them, stay on the CPU too). An input embedding
  copies only the rows its ids use, and only their gradient comes back (`_EmbeddingRows`; seed 003's
  layered embedding without its GPU cache of hot rows). No-grad phases (generation) can keep one GPU
  copy for the phase (`ParamOffload.resident`).
- Phase swap (--ref_device swap, --reward_device swap): a frozen model's weights live in pinned
  CPU memory and are copied to the GPU whole for its own phase, then dropped (`PhaseSwap`).
  --critic_device swap does the same for PPO's critic, a trained role: after its update the weights
  are copied back into their pinned buffers.
- Optimizer offload (--optimizer_offload; the swapped critic's optimizer too): the optimizer state in
  host memory, on the parameters' devices for each optimizer step only (`OptimizerSwap`).
"""

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Activation offload

_side_streams = {}
_last_saved = None  # weakref to the layer input saved last (the next one links to it for prefetch)


def side_stream(device):
    """One extra CUDA stream per device, made once: activation offload's copies run on it, and
    utils/generation.py warms up a decoding step on it before capturing a graph. Once, because
    cuBLAS keeps a workspace (32 MiB on an H200) for every stream it has run on, for the life of
    the process: a new stream per capture (--empty_cache_between_phases captures at every
    rollout) grew memory by 32 MiB per rollout."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


class _SavedInput:
    """One layer input, offloaded to pinned host memory; `prefetch` starts the copy back. The host copy is kept
    until the layer's graph is freed, so a second backward through it (retain_graph) recomputes again."""

    def __init__(self, tensor):
        self.device = tensor.device
        self.prev = None
        self.gpu = None
        self.ready = None
        if tensor.device.type != "cuda":  # nothing to offload to
            self.host, self.offloaded = tensor, None
            return
        stream = side_stream(tensor.device)
        self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)  # the input's strides kept
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the allocator keeps it until the copy is done
        self.offloaded = torch.cuda.Event()
        self.offloaded.record(stream)

    def prefetch(self):
        if self.offloaded is None or self.gpu is not None:
            return
        stream = side_stream(self.device)
        stream.wait_event(self.offloaded)
        with torch.cuda.stream(stream):
            self.gpu = self.host.to(self.device, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(stream)

    def get(self):
        if self.offloaded is None:
            return self.host
        self.prefetch()
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        tensor, self.gpu = self.gpu, None
        tensor.record_stream(current)
        return tensor


def offloaded_checkpoint(function, hidden, *args):
    """Drop-in for transformers' `_gradient_checkpointing_func(forward, hidden_states, ...)`. Under --torch_compile
    (transformers 5.24 checkpoints a layer's forward inside its compiled call) the offload itself stays out of
    torch.compile, which cannot trace it (host copies, streams, RNG state, a module-level link): traced, it
    broke the layer's graph, recompiled on that link and left the backward's recompute uncompiled. The layer's
    own forward is compiled on its own instead (_compiled_layer), in the forward and in the recompute."""
    return _offload_outside_compile(function, hidden, args, torch.compiler.is_compiling())


def _offload_checkpoint(function, hidden, args, compiled):
    """torch's non-reentrant checkpoint of one layer whose input is kept in pinned host memory instead of on the
    GPU: the forward runs on `hidden` itself (autograd's graph is the plain layer's), checkpoint's hooks drop what
    the layer saves, and the backward's recompute runs on the input copied back (the layer below prefetched
    meanwhile). Non-reentrant, the gradient reaching the layer goes through autograd's own engine and is freed
    when used: the reentrant Function this replaced held it beside the one it computed (one layer input more at
    the backward's peak under torch.compile, H100, 2026-12-07)."""
    global _last_saved
    layer = (lambda h, *a: _compiled_layer(function, h, *a)) if compiled else function
    saved = _SavedInput(hidden.detach())
    previous = _last_saved() if _last_saved is not None else None
    if previous is not None and previous.device == hidden.device:
        saved.prev = weakref.ref(previous)
    _last_saved = weakref.ref(saved)
    requires_grad = hidden.requires_grad
    live = [hidden]  # the forward's input; the recompute's comes back from the host

    def run(device, *rest):
        if live:
            return layer(live.pop(), *rest)
        restored = saved.get().detach().requires_grad_(requires_grad)
        below = saved.prev() if saved.prev is not None else None
        if below is not None:
            below.prefetch()  # the layer below is recomputed next: overlap its copy with this one
        return layer(restored, *rest)

    # `device`, an empty tensor on the input's device: checkpoint keeps the RNG state of the devices its
    # arguments are on, and transformers passes the layer's other inputs bound in `function`, so without it the
    # recompute would draw other dropout masks on a GPU than the forward did (only the CPU's state restored)
    return torch.utils.checkpoint.checkpoint(run, hidden.new_empty(0), *args, use_reentrant=False)


def _call_layer(function, hidden, *args):
    return function(hidden, *args)


# made by enable_activation_offload (torch.compiler.disable and torch.compile import torch._dynamo: 3 s on a CPU)
_offload_outside_compile = _compiled_layer = None


def enable_activation_offload(model) -> int:
    """Make every checkpointed layer of `model` offload its saved input. Call after
    gradient_checkpointing_enable. Returns the number of layers."""
    global _offload_outside_compile, _compiled_layer
    if _compiled_layer is None:
        _offload_outside_compile = torch.compiler.disable(_offload_checkpoint)
        _compiled_layer = torch.compile(_call_layer, dynamic=True)  # as compile_repeated_blocks compiles the layers
    count = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = offloaded_checkpoint
            count += 1
    if count == 0:
        raise RuntimeError("--activation_offload found no checkpointed layers (gradient checkpointing off, or a "
                           "model without transformers' checkpointing support)")
    return count


# ----------------------------------------------------------------------------------------------
# Parameter offload


class ParamOffload:
    """Trained weights of some modules kept in CPU memory and copied to `device` at each use."""

    def __init__(self, model, policy: str, device, strict=True):
        self.device = torch.device(device)
        self.cache = None  # id(param) -> GPU copy, inside `resident()`
        self.modules = resolve_offload_modules(model, policy, strict)
        pin = self.device.type == "cuda"
        for name, module in self.modules:
            for param in module.parameters(recurse=False):
                if param.device.type != "cpu":
                    param.data = param.data.to("cpu")
                if pin and not param.data.is_pinned():
                    param.data = param.data.pin_memory()
            module.forward = self._forward_of(module)
            module.lean_rl_fetch = self.fetch  # lets the chunked LM head fetch the weight once
        model.lean_rl_param_offload = self
        _report_device(model, self.device)

    def fetch(self, param):
        if param is None or param.device == self.device:
            return param
        if self.cache is not None and not torch.is_grad_enabled():
            if id(param) not in self.cache:
                self.cache[id(param)] = param.detach().to(self.device, non_blocking=True)
            return self.cache[id(param)]
        return param.to(self.device, non_blocking=True)  # differentiable: the gradient goes back to the CPU

    def _forward_of(self, module):
        if isinstance(module, torch.nn.Embedding):
            # a plain lookup can take the row path (_EmbeddingRows): decided once, when the forward is installed
            plain = module.max_norm is None and not module.scale_grad_by_freq and not module.sparse

            def embedding(ids):
                ids = ids.to(self.device)
                if plain and (self.cache is None or torch.is_grad_enabled()):  # only the rows this batch uses travel
                    return _EmbeddingRows.apply(module.weight, ids, module.padding_idx)
                return F.embedding(ids, self.fetch(module.weight), module.padding_idx, module.max_norm,
                                   module.norm_type, module.scale_grad_by_freq, module.sparse)
            return embedding
        return lambda x: F.linear(x, self.fetch(module.weight), self.fetch(module.bias))

    @contextmanager
    def resident(self):
        """For a no-grad phase: one GPU copy of each offloaded weight, freed at the end."""
        self.cache = {}
        try:
            yield
        finally:
            self.cache = None

    def describe(self) -> str:
        count = sum({id(p): p.numel() for _, m in self.modules for p in m.parameters(recurse=False)}.values())
        return f"{', '.join(n for n, _ in self.modules)} ({count / 1e6:.1f}M parameters) in CPU memory"


class _EmbeddingRows(torch.autograd.Function):
    """An embedding lookup in a weight kept in CPU memory: only the distinct rows `ids` use cross the host
    link (gathered into a pinned buffer when `ids` is on a GPU), and in backward only their gradient comes
    back, added into the weight's CPU `.grad` here (index_add_, as F.embedding's backward sums repeated ids;
    the padding row gets none), so no vocabulary-sized tensor is made on the GPU or per micro-batch on the
    CPU. The gradient reaches `.grad` directly rather than through autograd (this returns None for the
    weight), which is why --param_offload is one process only: no hook sees it (DDP would not reduce it).
    A tied LM head's gradient still arrives through autograd and is summed with it."""

    @staticmethod
    def forward(ctx, weight, ids, padding_idx):
        rows, inverse = torch.unique(ids, return_inverse=True)  # [U], [*ids.shape]: a host sync for U
        rows_host = rows.to(weight.device)
        pin = ids.device.type == "cuda" and weight.device.type == "cpu"
        gathered = torch.empty((rows_host.numel(), weight.shape[1]), dtype=weight.dtype, pin_memory=pin)
        torch.index_select(weight.detach(), 0, rows_host, out=gathered)  # [U, H]
        ctx.weight, ctx.padding_idx = weight, padding_idx
        ctx.save_for_backward(rows_host, inverse)
        return F.embedding(inverse, gathered.to(ids.device, non_blocking=True))  # [*ids.shape, H]

    @staticmethod
    def backward(ctx, grad_output):
        rows_host, inverse = ctx.saved_tensors
        weight = ctx.weight
        if weight.requires_grad:
            hidden = grad_output.shape[-1]
            grad_rows = torch.zeros((rows_host.numel(), hidden), dtype=grad_output.dtype, device=grad_output.device)
            grad_rows.index_add_(0, inverse.reshape(-1), grad_output.reshape(-1, hidden))  # [U, H]
            grad_rows = grad_rows.to(weight.device, weight.dtype)
            if ctx.padding_idx is not None:  # zeroed on the host, where the row ids are: no copy of them to the GPU
                grad_rows[rows_host == ctx.padding_idx] = 0
            with torch.no_grad():
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight, memory_format=torch.contiguous_format)
                weight.grad.index_add_(0, rows_host, grad_rows)
        ctx.weight = None
        return None, None, None


def _report_device(model, device):
    """transformers takes a model's device from its first parameter (the embeddings, now on the
    CPU) and puts generate()'s tensors there; make every PreTrainedModel inside say `device`."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            cls = type(module)
            module.__class__ = type(cls.__name__, (cls,), {"device": property(lambda self: device),
                                                          "__module__": cls.__module__})


def resolve_offload_modules(model, policy: str, strict=True):
    """--offload_policy -> [(name, module)]: `embedding` / `lm_head` are the model's input and
    output embeddings; other names match module names (exactly, or as a dotted suffix). With
    strict=False (the critic, which has a value head instead of an LM head) names that match
    nothing are skipped."""
    from utils.cli import UsageError

    inner = model
    while True:  # through PEFT and the critic's ValueModel to the transformers model
        if hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        elif not hasattr(inner, "get_input_embeddings") and hasattr(inner, "model"):
            inner = inner.model
        else:
            break
    named = dict(inner.named_modules())
    found, seen = [], set()
    for entry in [p.strip() for p in policy.split(",") if p.strip()]:
        if entry == "embedding":
            matches = [m for m in [inner.get_input_embeddings()] if m is not None]
        elif entry == "lm_head":
            matches = [m for m in [inner.get_output_embeddings()] if m is not None]
        else:
            matches = [m for n, m in named.items() if n == entry or n.endswith("." + entry)]
        if not matches and not strict:
            continue
        if not matches:
            raise UsageError(f"--offload_policy {entry}: no such module in the model; use embedding, lm_head or a "
                             f"module name such as {next(iter(n for n in named if n.endswith('proj')), 'lm_head')}")
        for module in matches:
            if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or type(module).forward not in (
                    torch.nn.Linear.forward, torch.nn.Embedding.forward):
                raise UsageError(f"--offload_policy {entry}: only plain Linear and Embedding modules can be offloaded "
                                 f"(got {type(module).__name__}; an adapted LoRA layer cannot)")
            if id(module) not in seen:
                seen.add(id(module))
                found.append((entry, module))
    # a tied weight (Qwen2.5-1.5B's lm_head shares the embedding's) leaves the GPU with the module named, so every
    # module using it must fetch it too
    moved = {id(p) for _, m in found for p in m.parameters(recurse=False)}
    for name, module in named.items():
        if (id(module) not in seen and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                and any(id(p) in moved for p in module.parameters(recurse=False))):
            seen.add(id(module))
            found.append((f"{name} (tied)", module))
    return found


class PhaseSwap:
    """--ref_device swap / --reward_device swap / --critic_device swap: a model's weights and buffers
    live in CPU memory (pinned when the execution device is a GPU) and are copied to the execution
    device whole for the model's phases (`resident`): one host-to-device copy per phase, and the GPU
    holds them only during that phase. verl's and OpenRLHF's reference offload work this way;
    --ref_device offload instead streams each layer in every micro-batch (one layer on the GPU at a
    time, but the whole model crosses PCIe once per micro-batch).

    A trained model (PPO's critic) is made resident with write_back=True for its update: at the end
    the stepped weights are copied back into their pinned host buffers (the GPU copies are then
    freed); its optimizer state is an OptimizerSwap's, on the GPU for the step only. Between updates
    every parameter is a CPU tensor, so a checkpoint saved then sees the current values. The values
    pass (write_back=False) copies nothing back: it does not change the weights."""

    def __init__(self, model, device):
        self.device = device
        self.pin = device.type == "cuda"
        self.tensors, seen = [], set()
        for module in model.modules():
            for tensor in list(module._parameters.values()) + list(module._buffers.values()):
                if tensor is None or id(tensor) in seen:  # tied weights: one tensor, moved once
                    continue
                seen.add(id(tensor))
                tensor.data = tensor.data.pin_memory() if self.pin else tensor.data
                self.tensors.append((tensor, tensor.data))  # (the model's tensor, its CPU storage)

    @contextmanager
    def resident(self, write_back=False):
        for tensor, host in self.tensors:  # write_back: a real copy also on a CPU (the CPU tests see a swap)
            tensor.data = host.to(self.device, non_blocking=True, copy=write_back)
        try:
            yield
        finally:
            for tensor, host in self.tensors:
                if write_back:  # trained: the stepped weights back into their host buffer
                    host.copy_(tensor.data, non_blocking=True)
                    tensor.grad = None  # none after a step (set_to_none); only a failed pass leaves some
                tensor.data = host  # the GPU copy is freed
            if write_back and self.pin:
                torch.cuda.synchronize(self.device)  # the host buffers are complete before anything reads them


class OptimizerSwap:
    """--optimizer_offload (and a --critic_device swap critic's optimizer): the optimizer's state tensors
    (moments, quantisation scales) live in host buffers (pinned on a GPU machine) and come to their
    parameter's device for the optimizer step only (`resident`), then are copied back into the same
    buffers: the forward and backward passes, generation and the other roles' phases run without them,
    for two copies of the state over the host link per step (verl's optimizer_offload does this around
    each update). 0-dim step counts stay where the optimizer made them. torchao's quantised states
    (tensor subclasses) are moved by their parts (__tensor_flatten__ / __tensor_unflatten__) and rebuilt.
    Between steps every moment is a CPU tensor, so a checkpoint sees the current values; `to_host` after a
    resume puts the loaded state (on the parameters' devices) back in host memory. enabled=False: a no-op."""

    def __init__(self, optimizer, enabled=True):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps optimizers
        self.enabled = enabled
        # pinned wherever a GPU exists (also for a state first put back from a CPU parameter: a swapped critic's
        # moments after a resume), so the copies of a GPU step are asynchronous
        self.pin = torch.cuda.is_available()
        self._buffers = {}  # (id(state dict), key, part) -> the host buffer its value returns to

    def _move(self, to_host):
        def move(value, device, where):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return value
            if not to_host:  # copy=True: a real copy also on a CPU
                return value.to(device, non_blocking=True, copy=True)
            buffer = self._buffers.get(where)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=self.pin)
                self._buffers[where] = buffer
            return buffer.copy_(value, non_blocking=True)

        devices = set()
        for param, state in self.optimizer.state.items():
            devices.add(param.device)
            for key, value in list(state.items()):
                if hasattr(value, "__tensor_flatten__") and value.dim() > 0:
                    names, context = value.__tensor_flatten__()
                    parts = {name: move(getattr(value, name), param.device, (id(state), key, name)) for name in names}
                    state[key] = type(value).__tensor_unflatten__(parts, context, value.shape, value.stride())
                else:
                    state[key] = move(value, param.device, (id(state), key, None))
        if to_host:
            for device in devices:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the host buffers are complete before anything reads them

    def to_host(self):
        if self.enabled:
            self._move(to_host=True)

    @contextmanager
    def resident(self):
        if not self.enabled:
            yield
            return
        self._move(to_host=False)
        try:
            yield
        finally:
            self._move(to_host=True)


@contextmanager
def resident(model):
    """For a phase that runs `model` without training it: `ParamOffload.resident` if it has offloaded
    parameters, its whole weights on the GPU if it is swapped (PhaseSwap), else nothing (also for
    None). A swapped critic's update uses its PhaseSwap's `resident(write_back=True)` (train_ppo.py)."""
    model = getattr(model, "module", model)
    offload = getattr(model, "lean_rl_param_offload", None) or getattr(model, "lean_rl_swap", None)
    if offload is None:
        yield
        return
    with offload.resident():
        yield
