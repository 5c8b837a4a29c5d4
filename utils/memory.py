"""Per-phase wall time and peak device memory (`time/<phase>`,
`memory/<phase>/peak_allocated_gib`, `memory/<phase>/peak_reserved_gib`), and host RSS.

Phases are the shared vocabulary: generate, ref, reward, values, old_logprobs, actor_update,
critic_update. On CUDA each phase starts and ends with a synchronize (a handful per step) so
that its time is the device's, and the peak counters are reset at its start."""

import os
import resource
import sys
import time
from contextlib import contextmanager

import torch

from utils.base import PREFILL_CHUNK

GIB = 1024**3


def host_peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


class PhaseTimer:
    def __init__(self, device, empty_cache=False):
        self.device = torch.device(device)
        self.empty_cache = empty_cache  # --empty_cache_between_phases
        self.cuda = self.device.type == "cuda"
        self.metrics = {}
        self.current = None  # the phase running now
        self.steps = 0  # steps started in this run
        self.run_peak_bytes = 0  # peak allocated on self.device over the whole run (phases reset the counter)

    def reset(self):
        """At the start of each step."""
        self.metrics = {}
        self.steps += 1

    @contextmanager
    def phase(self, name):
        self.current = name  # for the out-of-memory report
        inject = os.environ.get("LEAN_RL_FAKE_OOM_PHASE", "")  # testing aid: `phase` or `phase@step` (1-based)
        if inject and inject.split("@")[0] == name and ("@" not in inject or int(inject.split("@")[1]) == self.steps):
            raise torch.OutOfMemoryError(f"(injected by LEAN_RL_FAKE_OOM_PHASE={inject})")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # marks the phase in a --profile_step trace
                yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                if self.empty_cache:  # counted in the phase's time: it is what the flag costs
                    torch.cuda.empty_cache()
            key = f"time/{name}"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.perf_counter() - start
            if self.cuda:
                self.run_peak_bytes = max(self.run_peak_bytes, torch.cuda.max_memory_allocated(self.device))
                for kind, value in (("allocated", torch.cuda.max_memory_allocated(self.device)),
                                    ("reserved", torch.cuda.max_memory_reserved(self.device))):
                    key = f"memory/{name}/peak_{kind}_gib"
                    self.metrics[key] = max(self.metrics.get(key, 0.0), value / GIB)

    def summary(self) -> str:
        """`generate 0.21s 3.1GiB | ref 0.05s ...` for the verbose per-step log."""
        parts = []
        for key, seconds in self.metrics.items():
            if key.startswith("time/"):
                name = key[5:]
                mem = self.metrics.get(f"memory/{name}/peak_allocated_gib")
                parts.append(f"{name} {seconds:.2f}s" + (f" {mem:.2f}GiB" if mem is not None else ""))
        return " | ".join(parts)


def gpu_peaks_line(timer=None) -> str:
    """`cuda:0 12.3GiB, cuda:1 4.5GiB`: peak allocated memory of every GPU this process used
    (for the timer's device, whose counter each phase resets, the timer's run-wide peak)."""
    if not torch.cuda.is_available():
        return ""
    peaks = [(i, torch.cuda.max_memory_allocated(i)) for i in range(torch.cuda.device_count())]
    if timer is not None and timer.cuda:
        peaks = [(i, max(b, timer.run_peak_bytes) if i == timer.device.index else b) for i, b in peaks]
    return ", ".join(f"cuda:{i} {b / GIB:.2f}GiB" for i, b in peaks if b > 0)


# ----------------------------------------------------------------------------------------------
# --gpu_memory: the allocator held to a card's budget


def apply_memory_cap(gpu_memory, devices) -> list:
    """--gpu_memory on a GPU: cap this process's caching allocator on each CUDA device it uses at the
    budget (utils.base.parse_memory: `24GB` is a 24 GB card's usable 21 GiB), with
    torch.cuda.set_per_process_memory_fraction, so a run planned for a smaller card runs inside it (an
    H200 stands in for a 24 GB card). Returns the lines to print at start (nothing without a cap or a GPU)."""
    from utils.base import describe_memory, parse_memory

    if not gpu_memory or not torch.cuda.is_available():
        return []
    budget = parse_memory(gpu_memory)
    lines = []
    for device in sorted({torch.device(d) for d in devices if torch.device(d).type == "cuda"}, key=str):
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        total = torch.cuda.get_device_properties(device).total_memory
        if budget >= total:
            lines.append(f"GPU memory: --gpu_memory {gpu_memory} ({describe_memory(gpu_memory)}) is at least "
                         f"{device}'s "
                         f"{total / GIB:.1f} GiB: not capped")
            continue
        torch.cuda.set_per_process_memory_fraction(budget / total, device)
        _CAPS[device.index] = budget
        lines.append(f"GPU memory cap: {budget / GIB:.1f} GiB of {device}'s {total / GIB:.1f} GiB for this process's "
                     f"allocator (--gpu_memory {gpu_memory})")
    return lines


def memory_cap_of(device):
    """The cap apply_memory_cap set on `device` in bytes, or None (no cap, or no GPU)."""
    if not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _CAPS.get(index)


_CAPS = {}  # device index -> capped bytes


# ----------------------------------------------------------------------------------------------
# Per-role memory: where each trained or frozen model's bytes live (--log_memory_every,
# --memory_report, --memory_snapshot)


def human_bytes(n) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def role_memory(model, optimizer=None) -> dict:
    """Bytes of a role's weights, gradients (as allocated in an update: one per trainable weight,
    same dtype and device) and optimizer state, each split into gpu and cpu. Weights on `meta`
    (accelerate's offload keeps them in a CPU map) count as cpu."""
    out = {f"{kind}_{where}": 0 for kind in ("weights", "gradients", "optimizer") for where in ("gpu", "cpu")}
    model = getattr(model, "module", model)
    seen = set()
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        where = "gpu" if param.is_cuda else "cpu"
        size = param.numel() * param.element_size()
        out[f"weights_{where}"] += size
        if param.requires_grad:
            out[f"gradients_{where}"] += size
    if optimizer is not None:
        from utils.optim import state_tensors

        for tensor in state_tensors(optimizer):
            out["optimizer_" + ("gpu" if tensor.is_cuda else "cpu")] += tensor.numel() * tensor.element_size()
    return out


class MemoryTracker:
    """Phase peaks per step (from PhaseTimer's metrics) and per-role bytes; a table every
    `every` steps, and memory.json + two plots in `report_dir` at the end. Off (every=0, no
    report_dir): nothing is computed."""

    def __init__(self, roles, every=0, report_dir=None, is_main=True):
        self.roles = {name: role for name, role in roles.items() if role[0] is not None}  # -> (model, optimizer)
        self.every, self.report_dir, self.is_main = every, report_dir, is_main
        self.timeline = []  # {"step", phase -> {"allocated", "reserved"} GiB, "host_rss"}
        self.enabled = bool(every or report_dir)

    def after_step(self, step, phase_metrics):
        """Record the step; every `every` steps return the table (printed on the main process)."""
        if not self.enabled:
            return None
        row = {"step": step, "host_peak_rss_gib": host_peak_rss_gib()}
        for key, value in phase_metrics.items():
            if key.startswith("memory/") and key.endswith("_gib"):
                _, phase, kind = key.split("/")
                row.setdefault(phase, {})[kind.replace("peak_", "").replace("_gib", "")] = value
        self.timeline.append(row)
        if self.every and step % self.every == 0:
            table = self.table()
            if self.is_main:
                from tqdm.auto import tqdm

                tqdm.write(table)
            return table
        return None

    def finish(self):
        """At the end of the run, on the main process: the last table, and the report files."""
        if self.enabled and self.is_main:
            print(self.table() + "".join(f"\nwrote {path}" for path in self.write()), flush=True)

    def roles_now(self):
        return {name: role_memory(model, optimizer) for name, (model, optimizer) in self.roles.items()}

    def table(self) -> str:
        lines = [f"{'role':<8}" + "".join(f"{h:>12}" for h in ("weights GPU", "grads GPU", "optim GPU", "weights CPU",
                                                                 "grads CPU", "optim CPU"))]
        for name, m in self.roles_now().items():
            lines.append(f"{name:<8}" + "".join(f"{human_bytes(m[k]):>12}" for k in (
                "weights_gpu", "gradients_gpu", "optimizer_gpu", "weights_cpu", "gradients_cpu", "optimizer_cpu")))
        last = self.timeline[-1] if self.timeline else {}
        peaks = [f"{p} {v.get('allocated', 0):.2f}/{v.get('reserved', 0):.2f}" for p, v in last.items()
                 if isinstance(v, dict)]
        lines.append(f"step {last.get('step', '-')}: phase peak allocated/reserved GiB: " + (", ".join(peaks) or "n/a (no GPU)")
                     + f" | host peak RSS {last.get('host_peak_rss_gib', host_peak_rss_gib()):.2f} GiB")
        return "\n".join(lines)

    def write(self):
        """memory.json, memory_timeline.png, memory_breakdown.png in report_dir; returns the paths."""
        if not self.report_dir:
            return []
        import json
        import os

        os.makedirs(self.report_dir, exist_ok=True)
        roles = self.roles_now()
        data = {"roles_bytes": roles, "timeline": self.timeline}
        paths = [os.path.join(self.report_dir, name) for name in ("memory.json", "memory_timeline.png",
                                                                    "memory_breakdown.png")]
        with open(paths[0], "w") as f:
            json.dump(data, f, indent=1)
        plot_timeline(self.timeline, paths[1])
        plot_breakdown(roles, self.timeline, paths[2])
        return paths


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(timeline, path):
    """The run as it happened: each step's phases in order along x, their peak allocated and
    reserved GiB as bars, with the phase's name under each bar and a line between steps."""
    plt = _plt()
    points = [(row["step"], phase, v) for row in timeline for phase, v in row.items() if isinstance(v, dict)]
    fig, ax = plt.subplots(figsize=(max(6, min(18, 0.45 * len(points) + 2)), 4.2))
    if points:
        x = range(len(points))
        ax.bar(x, [v.get("reserved", 0) for _, _, v in points], color="C0", alpha=0.35, label="peak reserved")
        ax.bar(x, [v.get("allocated", 0) for _, _, v in points], color="C0", width=0.5, label="peak allocated")
        ax.set_xticks(list(x), [phase for _, phase, _ in points], rotation=60, ha="right", fontsize=7)
        for i in range(1, len(points)):
            if points[i][0] != points[i - 1][0]:
                ax.axvline(i - 0.5, color="grey", lw=0.8, ls=":")
        for i, (step, _, _) in enumerate(points):
            if i == 0 or points[i - 1][0] != step:
                ax.text(i - 0.4, ax.get_ylim()[1] * 0.97, f"step {step}", fontsize=8, va="top")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.text(0.5, 0.5, "no GPU: no device memory recorded", ha="center", transform=ax.transAxes)
    ax.set_ylabel("GiB")
    ax.set_title("GPU memory over the run, phase by phase")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_breakdown(roles, timeline, path):
    """Stacked bars: each role's weights / gradients / optimizer state on the GPU and the CPU, and
    each phase's transient memory (its last peak minus the roles' resident GPU bytes: KV cache,
    activations, logits)."""
    plt = _plt()
    resident = sum(m["weights_gpu"] + m["optimizer_gpu"] for m in roles.values()) / GIB
    grads = sum(m["gradients_gpu"] for m in roles.values()) / GIB
    last = timeline[-1] if timeline else {}
    bars = [(f"{name} ({where.upper()})", [m[f"weights_{where}"] / GIB, m[f"gradients_{where}"] / GIB,
                                            m[f"optimizer_{where}"] / GIB, 0.0])
            for name, m in roles.items() for where in ("gpu", "cpu")]
    for phase, v in last.items():
        if isinstance(v, dict):
            in_update = phase.endswith("_update")
            bars.append((f"phase {phase}", [0.0, 0.0, 0.0, max(v.get("allocated", 0) - resident
                                                              - (grads if in_update else 0), 0.0)]))
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.45 * len(bars)))
    left = [0.0] * len(bars)
    for j, (label, color) in enumerate((("weights", "C0"), ("gradients", "C1"), ("optimizer", "C2"),
                                        ("activations / KV / logits", "C3"))):
        values = [b[1][j] for b in bars]
        ax.barh(range(len(bars)), values, left=left, color=color, label=label)
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("GiB (roles: bytes held; phases: last peak above the roles' GPU weights, optimizer state and, "
                  "in updates, gradients)", fontsize=8)
    ax.set_title("Where the memory goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class StepSnapshot:
    """--memory_snapshot FILE: record the CUDA allocator's history over step --memory_snapshot_step (1-based, the
    first by default) and dump the pickle that https://pytorch.org/memory_viz opens. Off (path None): nothing."""

    def __init__(self, path, step=1):
        self.path, self.step, self.recording = path, step, False

    def begin(self, step):
        """At the start of 1-based step `step`."""
        if self.path and step == self.step and not self.recording and self.recording is not None:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self.recording = True

    def end(self):
        if self.recording:
            torch.cuda.memory._dump_snapshot(self.path)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = None  # once
            print(f"memory snapshot of step {self.step}: {self.path} (open it at https://pytorch.org/memory_viz)",
                  flush=True)


class StepProfile:
    """--profile_step N: torch.profiler over step N (1-based; from 2, past step 1's compiles and captures). Writes
    OUTPUT_DIR/profile_step{N}[_rank{r}].json (a trace that chrome://tracing and ui.perfetto.dev open, each phase a
    `phase/<name>` range) and prints, per phase, the kernels with the most GPU time (ops by self CPU time without a GPU).
    Off (step None): nothing."""

    def __init__(self, step, output_dir, rank=0, num_processes=1, is_main=True, top=10):
        self.step, self.output_dir, self.top, self.is_main = step, output_dir, top, is_main
        self.name = f"profile_step{step}" + (f"_rank{rank}" if num_processes > 1 else "") + ".json"
        self.profiler = None

    def begin(self, step):
        """At the start of 1-based step `step`."""
        if self.step is None or step != self.step:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def end(self):
        if self.profiler is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, self.name)
        self.profiler.export_chrome_trace(path)
        if self.is_main:
            print(phase_profile_table(self.profiler.events(), self.top) + f"\ntrace of step {self.step}: {path} "
                  "(open it at ui.perfetto.dev or chrome://tracing)", flush=True)
        self.profiler = None


def phase_profile_table(events, top=10) -> str:
    """Per `phase/<name>` range of a profile (as the CPU ran it): the `top` kernels by GPU time (each counted in the
    phase it started in; the phases synchronise at their ends; the ranges' own GPU-side annotations are no kernels),
    or on a CPU the `top` ops by self CPU time. Returns the table as text."""
    cpu = torch.autograd.DeviceType.CPU
    phases = [e for e in events if e.name.startswith("phase/") and e.device_type == cpu]
    # a range (record_function) shows on the GPU's timeline too, as a user annotation: not a kernel
    kernels = [e for e in events if e.device_type != cpu and not getattr(e, "is_user_annotation", False)
               and not e.name.startswith("phase/")]
    unit = "GPU" if kernels else "CPU"
    timed = kernels or [e for e in events if not e.name.startswith("phase/")]
    lines = [f"profile: {unit} time per phase (the top {top} {'kernels' if kernels else 'ops, self time'} each)"]
    for phase in phases:
        start, end = phase.time_range.start, phase.time_range.end
        totals = {}
        for e in timed:
            if start <= e.time_range.start < end:
                spent = e.time_range.elapsed_us() if kernels else e.self_cpu_time_total  # microseconds
                totals[e.name] = totals.get(e.name, 0.0) + spent
        total = sum(totals.values()) or 1.0
        lines.append(f"  {phase.name[len('phase/'):]}: {sum(totals.values()) / 1e3:.1f} ms of {unit} time in "
                     f"{len(totals)} {'kernels' if kernels else 'ops'}, {(end - start) / 1e3:.1f} ms of wall time")
        for name, spent in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {spent / 1e3:9.2f} ms {spent / total:6.1%}  {name[:100]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Out-of-memory diagnosis


class OOMReport:
    """Installed as the process's excepthook: an out-of-memory error that ends the run is
    explained in plain words first: the phase and step, each role's bytes, the GPU's state, the
    biggest live allocations (CUDA), and the three flags the planner says would save the most.
    Then the traceback; the process exits non-zero and the last checkpoint is left as it was."""

    def __init__(self, args, algo, timer, tracker, num_processes=1, engine="single"):
        self.args, self.algo, self.timer, self.tracker = args, algo, timer, tracker
        self.num_processes, self.engine, self.step = num_processes, engine, None
        self.previous = sys.excepthook
        sys.excepthook = self

    def __call__(self, exc_type, exc, tb):
        if issubclass(exc_type, torch.OutOfMemoryError):
            try:
                print(self.describe(exc), file=sys.stderr, flush=True)
            except Exception as e:  # the report must never hide the error itself
                print(f"(out-of-memory report failed: {e})", file=sys.stderr)
        self.previous(exc_type, exc, tb)

    def describe(self, exc) -> str:
        lines = ["", "=" * 80, f"OUT OF MEMORY in phase '{self.timer.current}'"
                 + (f" of step {self.step}" if self.step is not None else "") + f": {str(exc).splitlines()[0][:200]}"]
        if torch.cuda.is_available():
            device = self.timer.device if self.timer.cuda else torch.device("cuda", torch.cuda.current_device())
            free, total = torch.cuda.mem_get_info(device)
            lines.append(f"{device}: {torch.cuda.memory_allocated(device) / GIB:.2f} GiB allocated, "
                         f"{torch.cuda.memory_reserved(device) / GIB:.2f} GiB reserved, {free / GIB:.2f} of "
                         f"{total / GIB:.2f} GiB free")
            cap = memory_cap_of(device)
            if cap is not None:
                lines.append(f"The limit was the cap, not the GPU: --gpu_memory {self.args.gpu_memory} holds this "
                             f"process's allocator to {cap / GIB:.1f} GiB of the {total / GIB:.1f} GiB the GPU has "
                             f"({torch.cuda.memory_reserved(device) / GIB:.2f} GiB reserved when it ran out).")
            lines += biggest_allocations(device)
        lines.append("where the memory is, per role:\n" + self.tracker.table())
        lines.append("what would save the most (the planner's estimate, each alone; python -m utils.plan "
                     "or --plan for a full plan):")
        lines += [f"  {line}" for line in best_levers(self.args, self.algo, self.num_processes, self.engine)]
        lines.append("The last checkpoint is untouched: resume with --resume_from_checkpoint latest.")
        lines.append("=" * 80)
        return "\n".join(lines)


def biggest_allocations(device, count=5):
    """The largest live blocks of the CUDA allocator, with where they were allocated when the
    allocator's history is being recorded (--memory_snapshot)."""
    try:
        segments = torch.cuda.memory._snapshot(device)["segments"]
    except Exception:
        return []
    blocks = [b for seg in segments for b in seg.get("blocks", []) if b.get("state") == "active_allocated"]
    blocks.sort(key=lambda b: -b["size"])
    lines = []
    for block in blocks[:count]:
        frames = [f for f in block.get("frames", []) if "/torch/" not in f.get("filename", "")]
        where = f" at {frames[0]['filename']}:{frames[0]['line']}" if frames else ""
        lines.append(f"  live block {block['size'] / GIB:.2f} GiB{where}")
    return (["biggest live allocations" + ("" if any(" at " in l for l in lines) else
                                           " (run with --memory_snapshot FILE to see where they come from)") + ":"]
            + lines) if lines else []


def best_levers(args, algo, num_processes=1, engine="single", count=3):
    """The `count` flags from the planner's list that lower its estimated peak the most, of those this run's
    processes and engine accept (a swapped critic or --param_offload only in one process, --optimizer_offload not
    under DeepSpeed/FSDP)."""
    from utils.plan import LEVERS, _valid, apply_flags, estimate, load_shape

    try:
        shape = load_shape(args.model_name_or_path)
    except Exception as e:  # no config reachable: say so rather than guess
        return [f"(no estimate: the model's config could not be read: {e})"]
    base = estimate(shape, args, algo, num_processes)["peak_reserved"]
    gains = []
    for flags, why, applies in LEVERS:
        if not applies(args, shape):
            continue
        trial = apply_flags(args, flags)
        if trial.param_offload:  # the scripts resolved --generation_backend auto already; moved weights get hf/static
            trial.generation_backend = "auto"  # and --share_prompt_cache as unset resolves it there (off on static;
            trial.share_prompt_cache = None  # a user's explicit true would keep it: the estimate then a little high)
        if not _valid(trial, num_processes, engine):
            continue
        after = estimate(shape, trial, algo, num_processes)["peak_reserved"]
        if after < base:
            gains.append((base - after, f"{' '.join(flags)}: {why} (saves ~{human_bytes(base - after)})"))
    if not args.use_lora:
        gains.append((0, "--use_lora (with --load_in_4bit for QLoRA): train adapters instead of all weights"))
    return [line for _, line in sorted(gains, key=lambda g: -g[0])[:count]]


# ----------------------------------------------------------------------------------------------
# --auto_reduce_micro_batch


def fake_oom_check(rows):
    """Testing aid: LEAN_RL_FAKE_OOM_ROWS=N makes every forward over more than N rows run out of
    memory, as a too-large micro-batch would."""
    limit = os.environ.get("LEAN_RL_FAKE_OOM_ROWS")
    if limit and rows > int(limit):
        raise torch.OutOfMemoryError(f"(injected by LEAN_RL_FAKE_OOM_ROWS={limit}: {rows} rows)")


class MicroBatchShrinker:
    """--auto_reduce_micro_batch: a pass that runs out of memory is redone with half the
    micro-batch (--per_device_train_batch_size, or --max_token_len_per_gpu with --use_dynamic_bsz;
    for generation, first --prefill_chunk_size 64 where the prompts are longer, which costs little
    time, then --generation_slice_size), down to one sequence; the smaller size stays for
    later steps. The caller's pass starts from scratch (gradients zeroed first), so no sample is
    lost or counted twice and the accumulated gradient is exact."""

    def __init__(self, args, enabled, rows):
        self.args, self.enabled, self.rows = args, enabled, rows
        self.reductions = 0

    def _can_chunk_prefill(self):
        return self.args.prefill_chunk_size is None and self.args.max_prompt_length > PREFILL_CHUNK

    def _can_shrink(self, kind):
        a = self.args
        if kind == "generation":
            return self._can_chunk_prefill() or (a.generation_slice_size or self.rows) > 1
        if a.use_dynamic_bsz:
            return a.max_token_len_per_gpu > a.max_prompt_length + a.max_completion_length
        return a.per_device_train_batch_size > 1

    def _shrink(self, kind, phase):
        import warnings

        a = self.args
        if kind == "generation" and self._can_chunk_prefill():
            flag, value = "prefill_chunk_size", PREFILL_CHUNK
        elif kind == "generation":
            flag, value = "generation_slice_size", max((a.generation_slice_size or self.rows) // 2, 1)
        elif a.use_dynamic_bsz:
            flag = "max_token_len_per_gpu"
            value = max(a.max_token_len_per_gpu // 2, a.max_prompt_length + a.max_completion_length)
        else:
            flag, value = "per_device_train_batch_size", a.per_device_train_batch_size // 2
        setattr(a, flag, value)
        self.reductions += 1
        warnings.warn(f"out of memory in {phase}: retrying with --{flag} {value} (kept for the rest of the run)")

    def retry(self, fn, phase, kind="micro_batch", optimizers=()):
        """fn() until it runs without an out-of-memory error, shrinking between tries."""
        while True:
            try:
                return fn()
            except torch.OutOfMemoryError:
                if not (self.enabled and self._can_shrink(kind)):
                    raise
            # out of the except block: the failed try's tensors are released with its frames
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._shrink(kind, phase)
