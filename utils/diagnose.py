"""A live view of every NVIDIA GPU's memory and load, logged to CSV, and a plot of such a log.

    python -m utils.diagnose --mode memory --interval 5 --log gpus.csv   # Ctrl-C to stop
    python -m utils.diagnose --mode report --log gpus.csv                # -> gpus.png

Each sample shows, per GPU: memory used/total, utilisation, temperature and the memory of each
process on it (through nvidia-ml-py, the NVML bindings, so it sees every process, not only this
one). When one GPU is nearly full while others idle, it says so: that is a placement problem
(--actor_device / --ref_device / --reward_device, or more processes), not a model-size one.
"""

import argparse
import csv
import os
import signal
import sys
import time

FIELDS = ["time", "gpu", "name", "memory_used_mib", "memory_total_mib", "utilization_pct", "temperature_c",
          "processes"]
NEAR_FULL, IDLE = 0.90, 0.30  # fractions of a GPU's memory for the imbalance hint


def sample(nvml):
    """One row per GPU (dicts with FIELDS)."""
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    rows = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            processes = " ".join(f"{p.pid}:{(p.usedGpuMemory or 0) // 2**20}MiB" for p in procs)
        except nvml.NVMLError:
            processes = "?"
        name = nvml.nvmlDeviceGetName(handle)
        rows.append(dict(time=now, gpu=index, name=name.decode() if isinstance(name, bytes) else name,
                         memory_used_mib=memory.used // 2**20, memory_total_mib=memory.total // 2**20,
                         utilization_pct=nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
                         temperature_c=nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                         processes=processes))
    return rows


def imbalance_hint(rows):
    """A line when one GPU is nearly full while another has most of its memory free; else None."""
    fractions = {r["gpu"]: r["memory_used_mib"] / max(r["memory_total_mib"], 1) for r in rows}
    full = [g for g, f in fractions.items() if f >= NEAR_FULL]
    idle = [g for g, f in fractions.items() if f <= IDLE]
    if full and idle:
        return (f"hint: GPU {', '.join(map(str, full))} {'is' if len(full) == 1 else 'are'} over {NEAR_FULL:.0%} full "
                f"while GPU {', '.join(map(str, idle))} {'is' if len(idle) == 1 else 'are'} under {IDLE:.0%}: move a "
                "role there (--ref_device / --reward_device / --critic_device cuda:N, --actor_device balanced) "
                "or launch one process per GPU")
    return None


def format_rows(rows):
    lines = [f"{'gpu':<4}{'name':<24}{'memory used / total':>24}{'util':>7}{'temp':>7}  processes"]
    for r in rows:
        lines.append(f"{r['gpu']:<4}{r['name'][:23]:<24}{r['memory_used_mib']:>11} / {r['memory_total_mib']:>6} MiB"
                     f"{r['utilization_pct']:>6}%{r['temperature_c']:>5}C  {r['processes']}")
    return "\n".join(lines)


def monitor(interval, log_path, nvml, count=None, out=sys.stdout):
    """Sample every `interval` seconds (count samples, or until Ctrl-C); append rows to log_path."""
    stop = {"now": False}
    previous = signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    try:
        new_file = log_path and not os.path.exists(log_path)
        writer_file = open(log_path, "a", newline="") if log_path else None
        writer = csv.DictWriter(writer_file, FIELDS) if writer_file else None
        if new_file:
            writer.writeheader()
        taken = 0
        while not stop["now"] and (count is None or taken < count):
            rows = sample(nvml)
            print(format_rows(rows), file=out)
            hint = imbalance_hint(rows)
            if hint:
                print(hint, file=out)
            print(file=out, flush=True)
            if writer:
                writer.writerows(rows)
                writer_file.flush()
            taken += 1
            deadline = time.time() + interval
            while not stop["now"] and time.time() < deadline and (count is None or taken < count):
                time.sleep(min(0.2, interval))
        if writer_file:
            writer_file.close()
    finally:
        signal.signal(signal.SIGINT, previous)
    return taken


def report(log_path, png_path=None):
    """The CSV as a PNG: memory used per GPU over time (and utilisation, dashed, on a second axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(log_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{log_path} holds no samples")
    png_path = png_path or os.path.splitext(log_path)[0] + ".png"
    start = time.mktime(time.strptime(rows[0]["time"], "%Y-%m-%d %H:%M:%S"))
    fig, ax = plt.subplots(figsize=(9, 4))
    util_ax = ax.twinx()
    for gpu in sorted({r["gpu"] for r in rows}, key=int):
        mine = [r for r in rows if r["gpu"] == gpu]
        t = [time.mktime(time.strptime(r["time"], "%Y-%m-%d %H:%M:%S")) - start for r in mine]
        ax.plot(t, [int(r["memory_used_mib"]) / 1024 for r in mine], "-", color=f"C{int(gpu)}", label=f"GPU {gpu}")
        util_ax.plot(t, [int(r["utilization_pct"]) for r in mine], ":", color=f"C{int(gpu)}")
    total = max(int(r["memory_total_mib"]) for r in rows) / 1024
    ax.axhline(total, color="gray", linewidth=0.8)
    ax.set_xlabel("seconds")
    ax.set_ylabel(f"memory used, GiB (line: {total:.0f} GiB total)")
    util_ax.set_ylabel("utilisation % (dotted)")
    util_ax.set_ylim(0, 100)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"GPU memory and utilisation ({os.path.basename(log_path)})")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def load_nvml():
    """nvidia-ml-py initialised, or None when there is no NVIDIA driver (or no bindings)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["memory", "report"], default="memory")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--log", help="CSV to append samples to (memory), or to plot (report)")
    parser.add_argument("--count", type=int, help="stop after this many samples (default: until Ctrl-C)")
    args = parser.parse_args(argv)
    if args.mode == "report":
        if not args.log:
            parser.error("--mode report needs --log FILE (a CSV written by --mode memory)")
        print(f"wrote {report(args.log)}")
        return 0
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    nvml = load_nvml()
    if nvml is None:
        print("no NVIDIA GPU found (NVML, the driver's library, is not available here); nothing to monitor",
              file=sys.stderr)
        return 1
    try:
        taken = monitor(args.interval, args.log, nvml, args.count)
    finally:
        nvml.nvmlShutdown()
    print(f"{taken} samples" + (f" appended to {args.log}; plot them with --mode report --log {args.log}"
                                if args.log else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
