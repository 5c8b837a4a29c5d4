"""Scratch: a --memory_snapshot pickle -> per phase of train_grpo.py (by the allocating stack's script line), the
peak of allocations made during the recorded step above its start, and what was live at that peak, grouped by
where it was allocated."""
import ast, collections, pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
script = sys.argv[2] if len(sys.argv) > 2 else "train_grpo.py"
ranges = []
for node in ast.walk(ast.parse(open(script).read())):
    if isinstance(node, ast.With):
        for item in node.items:
            c = item.context_expr
            if isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "phase" and c.args and isinstance(c.args[0], ast.Constant):
                ranges.append((node.lineno, node.end_lineno, c.args[0].value))
            elif isinstance(c, ast.Call) and getattr(c.func, "attr", "") == "phase":
                ranges.append((node.lineno, node.end_lineno, "phase@%d" % node.lineno))
def phase_of(frames):
    for f in frames:  # innermost first
        if f["filename"].endswith(script):
            for a, b, name in sorted(ranges, key=lambda r: r[1] - r[0]):
                if a <= f["line"] <= b:
                    return name
            return "line%d" % f["line"]
    return None
def where(frames):
    py = [f for f in frames if f["filename"].endswith(".py")]
    own = [f for f in py if "/site-packages/" not in f["filename"] and "/torch/" not in f["filename"]]
    ext = [f for f in py if f not in own]
    ops = [f["name"] for f in frames if "at::_ops::" in f["name"]]
    a = f"{own[0]['filename'].split('/')[-1]}:{own[0]['line']} {own[0]['name']}" if own else "?"
    b = f"{ext[0]['filename'].split('/')[-1]}:{ext[0]['line']} {ext[0]['name']}" if ext else ""
    return a + " | " + b + (" | " + ops[0].split("at::_ops::")[1][:40] if ops else "")
for dev, trace in enumerate(snap["device_traces"]):
    if not trace:
        continue
    print(f"device {dev}: {len(trace)} trace entries")
    cur, phase, live = 0, "start", {}
    peaks = {}  # phase -> (bytes, index)
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            p = phase_of(e.get("frames", []))
            if p:
                phase = p
            live[e["addr"]] = e; cur += e["size"]
        elif a == "free_completed":
            cur -= e["size"]; live.pop(e["addr"], None)
        if cur > peaks.get(phase, (-1 << 62,))[0]:
            peaks[phase] = (cur, i)
    for phase, (peak, idx) in peaks.items():
        live, cur = {}, 0
        for e in trace[:idx + 1]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["action"] == "free_completed":
                live.pop(e["addr"], None)
        groups = collections.Counter(); counts = collections.Counter()
        for e in live.values():
            k = where(e.get("frames", []))
            groups[k] += e["size"]; counts[k] += 1
        print(f"== phase {phase}: peak {peak / 2**30:+.2f} GiB above the step's start (entry {idx}); live blocks made "
              f"in the step: {sum(groups.values()) / 2**30:.2f} GiB in {len(live)}")
        for k, b in groups.most_common(12):
            print(f"   {b / 2**30:7.3f} GiB {counts[k]:5d}x  {k[:170]}")
segs = snap["segments"]
blocks = [b for s in segs for b in s.get("blocks", []) if b.get("state") == "active_allocated"]
print(f"at the dump: {sum(b['size'] for b in blocks) / 2**30:.2f} GiB allocated in {len(blocks)} blocks")
g = collections.Counter()
for b in blocks:
    g[where(b.get("frames", [])) if b.get("frames") else "(made before recording)"] += b["size"]
for k, v in g.most_common(10):
    print(f"   {v / 2**30:7.3f} GiB  {k[:170]}")
