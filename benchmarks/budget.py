"""The budget table: for each card a user may own, the run --auto_memory chooses for it, measured under
the enforced cap (--gpu_memory caps the allocator, so one large GPU stands in for each card).

    python benchmarks/budget.py                       # every row, one GPU, results in benchmarks/results/budget/
    python benchmarks/budget.py --rows 1.5b_full_24gb,7b_qlora_24gb --steps 4
    python benchmarks/budget.py --table                           # the table and plot from the rows' JSON files only
    python benchmarks/budget.py --rows 1.5b_full_24gb --shape tiny --steps 2   # CPU smoke test (no cap on a CPU)
    python benchmarks/budget.py --rows 1.5b_full_24gb --steps 3 --baseline f266fff   # before/after a change
    git archive -o base.tar f266fff; python benchmarks/budget.py --rows 1.5b_full_24gb --steps 3 --baseline base.tar
    python benchmarks/budget.py --rows 7b_lora_24gb --steps 3 --lever "--kv_cache_dtype fp8"   # one lever alone
    python benchmarks/budget.py --rows 7b_lora_24gb --lever "--kv_cache_dtype fp8" --lever "--prefill_chunk_size 64"

Each row runs train_grpo.py / train_ppo.py on the W-GRPO / W-PPO workload (benchmarks/README.md;
random-weight models from benchmarks/memory.py) with the row's training mode and `--auto_memory
--gpu_memory CARD` alone: the planner's flags, none chosen by hand. Each row's JSON
(<out>/budget/<row>.json) holds the card, model and mode, the flags the planner chose, its estimated peak
reserved and step time, the measured peak reserved (max over phases and steps), the median step time
(steps 2..) and each of those steps (`unsteady` where they differ by more than 30%; the printed line then gives
each phase's time per step), completion tokens/s, the per-phase times (median and per step) and peak memory, TRL 1.16's figure on the same workload and the row's target (with
`--baseline REV`, also the same row run just before from git revision REV on the same machine: a side-by-side
before/after, printed and kept in the JSON's `baseline`); budget.md and budget.png (step time against the card's budget, one line per model and
mode, TRL's points beside) are made from every row's JSON in the folder, so rows run in different
sessions add up. `--lever FLAGS` measures one lever alone on a row instead (the lever table's "alone": the
row's planned flags as explicit flags under its cap, without the lever and with it, nothing else different);
repeated, the levers share the run of the plan without them.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.memory import command, device_info, fmt, prepare_inputs, run_config  # noqa: E402
from utils.base import GIB, parse_memory  # noqa: E402

# TRL 1.16 GRPOTrainer on W-GRPO, one H200, 2026-11-30 (its own numerics: bf16 autocast, AdamW unless named)
TRL_WHERE = "one H200, 2026-11-30"
TRL_15B = "15.1 s at 18.5 GiB"
TRL_7B = "28.6 s at 68.1 GiB (8-bit AdamW + Liger)"
TRL_7B_LORA = "does not fit (25.7 GiB)"
TRL_7B_QLORA = "57.5 s at 13.5 GiB"
# name -> (shape, script, mode, card, the mode's flags, TRL's figure, TRL step s or None, target step s)
ROWS = {
    "1.5b_no_flags": ("qwen2.5-1.5b", "grpo", "full, default numerics, no flags", None, [], TRL_15B, 15.1, 7.55),
    "1.5b_full_24gb": ("qwen2.5-1.5b", "grpo", "full", "24GB", [], TRL_15B, 15.1, 5.0),
    "1.5b_full_12gb": ("qwen2.5-1.5b", "grpo", "full", "12GB", [], "does not fit", None, 8.0),
    "7b_full_80gb": ("qwen2.5-7b", "grpo", "full", "80GB", [], TRL_7B, 28.6, 16.0),
    "7b_full_48gb": ("qwen2.5-7b", "grpo", "full", "48GB", [], "does not fit", None, 22.0),
    "7b_lora_24gb": ("qwen2.5-7b", "grpo", "LoRA r16, bf16 base", "24GB", ["--use_lora", "--torch_dtype", "bfloat16"],
                     TRL_7B_LORA, None, 22.0),
    "7b_qlora_24gb": ("qwen2.5-7b", "grpo", "QLoRA r16", "24GB", ["--use_lora", "--load_in_4bit"], TRL_7B_QLORA, 57.5,
                      20.0),
    "7b_qlora_12gb": ("qwen2.5-7b", "grpo", "QLoRA r16", "12GB", ["--use_lora", "--load_in_4bit"], "does not fit",
                      None, 40.0),
    "ppo_1.5b_24gb": ("qwen2.5-1.5b", "ppo", "PPO, four roles, full", "24GB",
                      ["--reward_model_name_or_path", "{model}"], "-", None, 12.0),
    "ppo_7b_80gb": ("qwen2.5-7b", "ppo", "PPO, four roles, LoRA r16", "80GB",
                    ["--use_lora", "--torch_dtype", "bfloat16", "--reward_model_name_or_path", "{model}"], "-", None,
                    60.0),
}


def planned(log_text):
    """(flags the planner added, its estimated peak reserved GiB, its estimated step s) from a run's log."""
    line = next((line for line in log_text.splitlines() if line.startswith("plan: ")), "plan: ")
    flags = line[len("plan: "):].strip()
    est = re.search(r"estimated with the plan: peak reserved ([\d.]+) GiB, step ([\d.]+) s", log_text)
    return (flags if flags not in ("fits as it is", "nothing fits") else "", float(est.group(1)) if est else None,
            float(est.group(2)) if est else None)


def reductions(log_text):
    """What --auto_reduce_micro_batch changed during the run (phase: flag value), read off its warnings: the
    flags the measured steps ran with differ from the plan's by these."""
    return [f"{phase}: {flag}" for phase, flag in re.findall(r"out of memory in (\w+): retrying with (--\S+ \S+)",
                                                               log_text)]


def phase_figures(result):
    """A run's time per phase (median s; and each timed step's, which shows the phase an unsteady step was slow in)
    and peaks per phase (GiB allocated and reserved)."""
    return dict(phases={p: v["time_s"] for p, v in result["phases"].items()},
                phase_times_s={p: v.get("times_s") for p, v in result["phases"].items()},
                phase_peaks_gib={p: {"allocated": v["peak_allocated_gib"], "reserved": v["peak_reserved_gib"]}
                                 for p, v in result["phases"].items()})


def run_row(name, steps, cache_dir, out, on_gpu, gpu_name, shape=None, baseline=None):
    row_shape, script, mode, card, mode_flags, trl, trl_s, target = ROWS[name]
    shape = shape or row_shape
    model_dir, tok_dir, dataset = prepare_inputs(shape, script, steps, cache_dir, on_gpu)
    flags = [f.replace("{model}", model_dir) for f in mode_flags]
    if card:
        flags += ["--auto_memory", "--gpu_memory", card]
    run_dir = os.path.join(cache_dir, "runs", f"budget_{name}_{shape}")
    result = run_config(name, flags, command(shape, script, model_dir, tok_dir, dataset, run_dir, steps, flags),
                        run_dir, echo=True)
    log = open(result["log"]).read()
    chosen, est_gib, est_s = planned(log)
    cap = re.search(r"GPU memory cap: ([\d.]+) GiB", log)
    measured, step = result["peak_reserved_gib"], result["step_time_s"]
    verdict = ("n/a" if step is None or result["status"] != "ok" else
               "MET" if step <= target and (cap or not card or not on_gpu) else f"MISSED by {step - target:.1f} s")
    times = result.get("step_times_s") or []
    # the timed steps disagree by more than 30%: a recompile or a retry inside them; the median hides which
    unsteady = len(times) > 1 and max(times) > 1.3 * min(times)
    slowest = max(result["phases"].items(), key=lambda kv: kv[1]["time_s"] or 0)[0] if result["phases"] else None
    row = dict(row=name, shape=shape, script=script, mode=mode, card=card,
               budget_gib=parse_memory(card) / GIB if card else None, cap_gib=float(cap.group(1)) if cap else None,
               mode_flags=mode_flags, planner_flags=chosen, runtime_reductions=reductions(log),
               estimated_peak_reserved_gib=est_gib,
               estimated_step_s=est_s, peak_reserved_gib=measured, peak_allocated_gib=result["peak_allocated_gib"],
               step_time_s=step, step_times_s=result.get("step_times_s"), unsteady=unsteady,
               tokens_per_s=result["tokens_per_s"],
               **phase_figures(result),  # to check the estimate phase by phase
               slowest_phase=slowest, trl=trl,
               trl_step_s=trl_s, target_step_s=target, verdict=verdict, status=result["status"], steps=steps,
               gpu=gpu_name, date=time.strftime("%Y-%m-%d"), command=result["command"])
    if baseline:
        row["baseline"] = baseline
    os.makedirs(os.path.join(out, "budget"), exist_ok=True)
    with open(os.path.join(out, "budget", f"{name}.json"), "w") as f:
        json.dump(row, f, indent=1)
    print(f"[{name}] {row['status']}: {fmt(step, '.2f')} s per step (estimated {fmt(est_s, '.1f')}), peak reserved "
          f"{fmt(measured)} GiB (estimated {fmt(est_gib, '.1f')}) under {card or 'no cap'}; target {target} s: "
          f"{verdict}" + (f" (unsteady: steps 2.. took {', '.join(f'{t:.2f}' for t in times)} s; by phase: "
                          + ", ".join(f"{p} {' / '.join(f'{t:.2f}' for t in ts)}"
                                      for p, ts in row["phase_times_s"].items() if ts) + ")" if unsteady else ""),
          flush=True)
    return row


def baseline_tree(rev, cache_dir):
    """(folder, full hash): git revision `rev` of this repository written out (git archive) under `cache_dir`,
    once; or, where `rev` is a tar file made by `git archive REV` (for a machine that has the working tree but not
    its history), that tar written out, its commit read from the archive's header. None when neither names one."""
    import io
    import subprocess
    import tarfile

    if os.path.isfile(rev):
        try:
            with tarfile.open(rev) as tar:
                sha = tar.pax_headers.get("comment", "")
        except tarfile.TarError:
            return None
        if not re.fullmatch(r"[0-9a-f]{40}", sha):
            return None
        archive = open(rev, "rb").read()
    else:
        found = subprocess.run(["git", "-C", ROOT, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                               capture_output=True, text=True)
        if found.returncode != 0:
            return None
        sha, archive = found.stdout.strip(), None
    folder = os.path.join(cache_dir, f"baseline-{sha[:12]}")
    if not os.path.isfile(os.path.join(folder, "benchmarks", "budget.py")):
        if archive is None:
            archive = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", sha], capture_output=True,
                                     check=True).stdout
        os.makedirs(folder, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
    return folder, sha


def run_baseline(name, steps, cache_dir, out, folder, sha, shape=None):
    """Row `name` run by the baseline's own benchmarks/budget.py (its code throughout, the same cached models and
    prompts); its JSON (<out>/budget_baseline/budget/<row>.json) as a dict, or one saying it failed."""
    import subprocess

    base_out = os.path.join(out, "budget_baseline")
    cmd = [sys.executable, "benchmarks/budget.py", "--rows", name, "--steps", str(steps), "--cache_dir", cache_dir,
           "--out", base_out] + (["--shape", shape] if shape else [])
    print(f"[{name}] baseline {sha[:12]}: {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, cwd=folder)
    path = os.path.join(base_out, "budget", f"{name}.json")
    if done.returncode != 0 or not os.path.isfile(path):
        return dict(rev=sha, status=f"failed (exit {done.returncode})")
    row = json.load(open(path))
    return dict(rev=sha, status=row["status"], step_time_s=row["step_time_s"], step_times_s=row.get("step_times_s"),
                peak_reserved_gib=row["peak_reserved_gib"], phases=row["phases"],
                phase_peaks_gib=row.get("phase_peaks_gib"), phase_times_s=row.get("phase_times_s"),
                planner_flags=row["planner_flags"])


def side_by_side(row):
    """One line: the baseline's step, peak and phases -> this tree's."""
    base = row["baseline"]
    if base["status"] != "ok" or row["status"] != "ok":
        return f"[{row['row']}] baseline {base['rev'][:12]}: {base['status']}; this tree: {row['status']}"
    phases = ", ".join(f"{p} {fmt(base['phases'].get(p), '.2f')} -> {fmt(t, '.2f')}" for p, t in row["phases"].items())
    same = "" if base["planner_flags"] == row["planner_flags"] else " (the planner chose other flags)"
    return (f"[{row['row']}] baseline {base['rev'][:12]} -> this tree: {fmt(base['step_time_s'], '.2f')} -> "
            f"{fmt(row['step_time_s'], '.2f')} s, peak reserved {fmt(base['peak_reserved_gib'])} -> "
            f"{fmt(row['peak_reserved_gib'])} GiB; {phases}{same}")


def toggled(flags, lever, on):
    """`flags` (a token list) with the lever's flags set to the lever's values (on) or removed, values included
    (off). A flag's value is the token after it where that token is not itself a flag. Off, a flag whose unset value
    the script decides (an Optional[bool]: --share_prompt_cache is on for GRPO's captured step unset) is said false."""
    from typing import Optional, get_type_hints

    from utils.args import SharedArgs

    decided = {f"--{name}" for name, hint in get_type_hints(SharedArgs).items() if hint == Optional[bool]}

    def pairs(tokens):
        out, i = [], 0
        while i < len(tokens):
            value = tokens[i + 1] if i + 1 < len(tokens) and not tokens[i + 1].startswith("--") else None
            out.append((tokens[i], value))
            i += 2 if value is not None else 1
        return out

    names = {name for name, _ in pairs(lever)}
    kept = [token for name, value in pairs(flags) if name not in names
            for token in ([name] if value is None else [name, value])]
    return kept + (list(lever) if on else [token for name, _ in pairs(lever) if name in decided
                                              for token in (name, "false")])


def run_levers(name, levers, steps, cache_dir, out, on_gpu, gpu_name, shape=None):
    """Each lever alone on one row: the flags `--auto_memory` plans for the row (on this GPU, read off the script's
    `--plan`, once), run as explicit flags under the row's cap without the lever and with it (removed from, or added
    to, the plan, toggled(); nothing else differs). A flag set already run for this row is not run again (the plan
    without any of the levers is every added lever's "without" side). No `--auto_reduce_micro_batch`: a side that
    does not fit fails as OOM. Returns one record per lever, each written to OUT/levers/ROW__LEVER.json."""
    row_shape, script, mode, card, mode_flags, *_ = ROWS[name]
    shape = shape or row_shape
    model_dir, tok_dir, dataset = prepare_inputs(shape, script, steps, cache_dir, on_gpu)
    flags = [f.replace("{model}", model_dir) for f in mode_flags]
    plan = []
    if card:
        run_dir = os.path.join(cache_dir, "runs", f"lever_{name}_{shape}_plan")
        cmd = command(shape, script, model_dir, tok_dir, dataset, run_dir, steps,
                      flags + ["--auto_memory", "--gpu_memory", card, "--plan"])
        planning = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if planning.returncode != 0:
            raise SystemExit(f"[{name}] the plan failed (exit {planning.returncode}): "
                             f"{planning.stderr.strip()[-2000:]}")
        plan = [f for f in shlex.split(planned(planning.stdout)[0]) if f != "--auto_reduce_micro_batch"]
        flags = flags + plan + ["--gpu_memory", card]
    ran, records = {}, []  # tuple of flags -> that run's figures
    for lever in levers:
        sides = {}
        for side in ("without", "with"):
            side_flags = toggled(flags, lever, side == "with")
            if tuple(side_flags) not in ran:
                run_dir = os.path.join(cache_dir, "runs", f"lever_{name}_{shape}_{len(ran)}")
                print(f"[{name}] {side} {' '.join(lever)}: {shlex.join(side_flags)}", flush=True)
                result = run_config(f"{name} {side}", side_flags, command(shape, script, model_dir, tok_dir, dataset,
                                                                          run_dir, steps, side_flags), run_dir)
                ran[tuple(side_flags)] = dict(
                    flags=side_flags, status=result["status"], step_time_s=result["step_time_s"],
                    step_times_s=result.get("step_times_s"), peak_reserved_gib=result["peak_reserved_gib"],
                    peak_allocated_gib=result["peak_allocated_gib"], **phase_figures(result),
                    command=result["command"])
            sides[side] = ran[tuple(side_flags)]
        record = dict(row=name, shape=shape, script=script, mode=mode, card=card, lever=" ".join(lever),
                      planner_flags=" ".join(plan), steps=steps, gpu=gpu_name, date=time.strftime("%Y-%m-%d"), **sides)
        slug = re.sub(r"[^A-Za-z0-9]+", "_", " ".join(lever)).strip("_")
        os.makedirs(os.path.join(out, "levers"), exist_ok=True)
        with open(os.path.join(out, "levers", f"{name}__{slug}.json"), "w") as f:
            json.dump(record, f, indent=1)
        print(lever_line(record), flush=True)
        records.append(record)
    return records


def lever_line(record):
    """One line: the row without the lever -> with it (step, peak reserved and allocated, each phase's time)."""
    a, b = record["without"], record["with"]
    if a["status"] != "ok" or b["status"] != "ok":
        return f"[{record['row']}] {record['lever']}: without {a['status']}, with {b['status']}"
    phases = ", ".join(f"{p} {fmt(a['phases'].get(p), '.2f')} -> {fmt(t, '.2f')}" for p, t in b["phases"].items())
    return (f"[{record['row']}] {record['lever']} ({record['gpu']}, {record['card'] or 'no cap'}): step "
            f"{fmt(a['step_time_s'], '.2f')} -> {fmt(b['step_time_s'], '.2f')} s, peak reserved "
            f"{fmt(a['peak_reserved_gib'])} -> {fmt(b['peak_reserved_gib'])} GiB, allocated "
            f"{fmt(a['peak_allocated_gib'])} -> {fmt(b['peak_allocated_gib'])} GiB; {phases}")


def lever_table(out):
    """OUT/levers/levers.md: every lever record in OUT/levers/ as one table row (the lever table's cells: the row's
    plan without the lever -> with it, step and peaks, the phases that changed by 5% or more), rebuilt each time."""
    folder = os.path.join(out, "levers")
    records = [json.load(open(os.path.join(folder, f))) for f in sorted(os.listdir(folder)) if f.endswith(".json")]
    head = ["row", "card", "lever", "GPU, date", "step s", "peak reserved GiB", "peak allocated GiB",
            "phases (s) that changed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        a, b = r["without"], r["with"]
        ok = a["status"] == b["status"] == "ok"
        changed = [f"{p} {fmt(a['phases'].get(p))} -> {fmt(t)}" for p, t in b["phases"].items()
                   if ok and t is not None and a["phases"].get(p) is not None
                   and abs(t - a["phases"][p]) >= 0.05 * max(a["phases"][p], 1e-9)]
        pair = [f"{fmt(a[key])} -> {fmt(b[key])}" if ok else f"{a['status']} -> {b['status']}"
                for key in ("step_time_s", "peak_reserved_gib", "peak_allocated_gib")]
        lines.append(f"| {r['row']} | {r['card'] or 'none'} | `{r['lever']}` | {r['gpu']}, {r['date']} | "
                     + " | ".join(pair) + f" | {', '.join(changed)} |")
    with open(os.path.join(folder, "levers.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def load_rows(out):
    folder = os.path.join(out, "budget")
    rows = [json.load(open(os.path.join(folder, f))) for f in sorted(os.listdir(folder)) if f.endswith(".json")] \
        if os.path.isdir(folder) else []
    order = list(ROWS)
    return sorted(rows, key=lambda r: order.index(r["row"]) if r["row"] in order else len(order))


def markdown(rows):
    head = ["model, training", "card (cap)", f"TRL 1.16 ({TRL_WHERE})", "target", "measured step", "peak reserved GiB (est.)",
            "completion tokens/s", "verdict", "slowest phase", "flags the planner chose"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        card = f"{r['card']} ({r['cap_gib']:.1f} GiB)" if r.get("cap_gib") else (r["card"] or "none (no flags)")
        step = (f"{r['step_time_s']:.2f} s (est. {r['estimated_step_s']:.1f})" if r["step_time_s"] and
                r["estimated_step_s"] else fmt(r["step_time_s"], ".2f") + " s" if r["step_time_s"] else r["status"])
        mem = f"{fmt(r['peak_reserved_gib'])} ({fmt(r['estimated_peak_reserved_gib'], '.1f')})"
        flags = f"`{r['planner_flags']}`" if r["planner_flags"] else ""
        if r.get("runtime_reductions"):  # out of memory under the cap, shrunk by --auto_reduce_micro_batch
            flags += "; out of memory, then " + ", ".join(f"`{x}`" for x in r["runtime_reductions"])
        lines.append("| " + " | ".join([f"{r['shape']} {r['mode']}" + (" W-PPO" if r["script"] == "ppo" else ""),
                                        card, r["trl"], f"<= {r['target_step_s']} s", step, mem,
                                        fmt(r["tokens_per_s"], ".0f"), r["verdict"], r["slowest_phase"] or "",
                                        flags]) + " |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines = {}
    for r in rows:
        if r["step_time_s"] and r.get("budget_gib"):
            lines.setdefault(f"{r['shape']} {r['mode']}" + (" (PPO)" if r["script"] == "ppo" else ""), []).append(r)
    for i, (label, group) in enumerate(sorted(lines.items())):
        group.sort(key=lambda r: r["budget_gib"])
        color = f"C{i}"
        ax.plot([r["budget_gib"] for r in group], [r["step_time_s"] for r in group], "o-", color=color, label=label)
        for r in group:
            if r.get("trl_step_s"):
                ax.plot(r["budget_gib"], r["trl_step_s"], "x", color=color, markersize=10)
    ax.plot([], [], "kx", label=f"TRL 1.16 under the same cap ({TRL_WHERE})")
    ax.set_xlabel("GPU memory budget (GiB, the card's usable part, enforced)")
    ax.set_ylabel("median step time (s)")
    ax.set_title(f"The fastest run that fits, chosen by --auto_memory ({rows[0]['gpu'] if rows else ''})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_table(out):
    rows = load_rows(out)
    with open(os.path.join(out, "budget", "budget.md"), "w") as f:
        f.write(markdown(rows) + "\n")
    plot(rows, os.path.join(out, "budget", "budget.png"))
    return rows


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", help=f"comma list of {', '.join(ROWS)}; default: all")
    parser.add_argument("--steps", type=int, default=4, help="training steps per row (the median is over steps 2..)")
    parser.add_argument("--shape", help="run the rows on this shape instead of their own (tiny: a CPU smoke test)")
    parser.add_argument("--table", action="store_true", help="only rebuild budget.md and budget.png from the JSON")
    parser.add_argument("--cache_dir", default="/tmp/lean_rl_bench")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run each row from git revision REV (written out under --cache_dir; its own code, "
                             "the same models, right before this tree's run), print the two side by side and keep the "
                             "baseline's figures in the row's JSON (`baseline`); its JSON in OUT/budget_baseline/. "
                             "REV may also be a tar file made by `git archive REV` (a GPU machine given the working "
                             "tree without its history)")
    parser.add_argument("--lever", metavar="FLAGS", action="append",
                        help="measure a lever alone on each of --rows (required with it) instead of the rows: the "
                             "flags --auto_memory plans for the row on this GPU, run under the row's cap without "
                             "FLAGS and with them (e.g. \"--kv_cache_dtype fp8\"; a flag the plan has is removed, "
                             "or set to FLAGS' value); both in OUT/levers/ROW__LEVER.json, one line printed. "
                             "Repeatable: the row's plan and a flag set two levers share run once. "
                             "OUT/levers/levers.md: every lever record there as a table. A lone flag: "
                             "--lever=--activation_offload")
    args = parser.parse_args(argv)
    levers = [lever.split() for lever in args.lever or []]
    if args.lever and (not args.rows or args.baseline or args.table
                       or not all(lever and lever[0].startswith("--") for lever in levers)):
        parser.error("--lever FLAGS needs --rows and goes without --baseline and --table; FLAGS are script flags, "
                     "e.g. --lever \"--prefill_chunk_size 64\"")
    names = args.rows.split(",") if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown or args.steps < 2:
        parser.error(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(ROWS)}" if unknown else
                     "--steps must be at least 2 (step 1 compiles and captures)")
    out, cache_dir = os.path.abspath(args.out), os.path.abspath(args.cache_dir)
    baseline = None
    if args.baseline and not args.table:
        baseline = baseline_tree(args.baseline, cache_dir)
        if baseline is None:
            parser.error(f"--baseline {args.baseline}: git names no such commit in {ROOT} (a hash, tag or branch of "
                         "this repository's history, or a tar file made by `git archive REV`)")
    if levers:
        on_gpu, gpu_name = device_info()
        records = [record for name in names
                   for record in run_levers(name, levers, args.steps, cache_dir, out, on_gpu, gpu_name, args.shape)]
        print("\n" + "\n".join(lever_line(r) for r in records) + "\n\n" + "\n".join(lever_table(out)), flush=True)
        return records
    if not args.table:
        on_gpu, gpu_name = device_info()
        lines = []
        for name in names:
            before = run_baseline(name, args.steps, cache_dir, out, *baseline, args.shape) if baseline else None
            row = run_row(name, args.steps, cache_dir, out, on_gpu, gpu_name, args.shape, baseline=before)
            if before:
                lines.append(side_by_side(row))
        if lines:
            print("\n" + "\n".join(lines), flush=True)
    rows = write_table(out)
    print("\n" + markdown(rows))
    return rows


if __name__ == "__main__":
    main()
