"""Per-phase wall time and peak device memory (`time/<phase>`,
`memory/<phase>/peak_allocated_gib`, `memory/<phase>/peak_reserved_gib`), and host RSS.

Phases are the shared vocabulary: generate, ref, reward, values, old_logprobs, actor_update,
critic_update. On CUDA each phase starts and ends with a synchronize (a handful per step) so
that its time is the device's, and the peak counters are reset at its start."""

import resource
import time
from contextlib import contextmanager

import torch

GIB = 1024**3


def host_peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is in KiB on Linux


class PhaseTimer:
    def __init__(self, device, empty_cache=False):
        self.device = torch.device(device)
        self.empty_cache = empty_cache  # --empty_cache_between_phases
        self.cuda = self.device.type == "cuda"
        self.metrics = {}
        self.run_peak_bytes = 0  # peak allocated on self.device over the whole run (phases reset the counter)

    def reset(self):
        self.metrics = {}

    @contextmanager
    def phase(self, name):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
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
