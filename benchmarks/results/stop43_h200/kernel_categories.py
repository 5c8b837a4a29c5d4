"""Scratch: categorise a --profile_step trace's kernels per phase (GPU busy vs wall, gemm vs elementwise...)."""
import json, re, sys, collections
trace = json.load(open(sys.argv[1]))
ev = trace["traceEvents"]
phases = [e for e in ev if str(e.get("name", "")).startswith("phase/") and e.get("cat") == "gpu_user_annotation"]
if not phases:
    phases = [e for e in ev if str(e.get("name", "")).startswith("phase/")]
kern = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
cats = [("gemm", r"gemm|nvjet|sm90_xmma|cutlass|xmma|cublas|splitK"), ("flash", r"flash|fmha|attention"),
        ("triton", r"^triton_"), ("memcpy", r"Memcpy|memcpy"), ("memset", r"Memset|memset"),
        ("optim", r"adam|Adam|optim|multi_tensor|_foreach"), ("reduce", r"reduce|Reduce|softmax|norm"),
        ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"), ("cat/copy", r"cat|copy|Copy|index|gather|scatter")]
for ph in phases:
    s, e = ph["ts"], ph["ts"] + ph["dur"]
    ks = [k for k in kern if s <= k["ts"] < e]
    tot = collections.Counter(); cnt = collections.Counter(); names = collections.defaultdict(collections.Counter)
    for k in ks:
        c = next((c for c, rx in cats if re.search(rx, k["name"])), "other")
        tot[c] += k["dur"]; cnt[c] += 1; names[c][k["name"][:90]] += k["dur"]
    busy = sum(tot.values())
    # merged busy intervals (kernels on several streams can overlap)
    iv = sorted((k["ts"], k["ts"] + k["dur"]) for k in ks); merged = 0; cur = None
    for a, b in iv:
        if cur is None or a > cur[1]:
            if cur: merged += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur: merged += cur[1] - cur[0]
    print(f"{ph['name']} ({ph.get('cat')}): wall {ph['dur']/1e3:.1f} ms, kernels {len(ks)}, sum {busy/1e3:.1f} ms, busy (merged) {merged/1e3:.1f} ms")
    for c, t in tot.most_common():
        print(f"   {c:12s} {t/1e3:9.1f} ms  {cnt[c]:6d} kernels  mean {t/cnt[c]:.1f} us")
        for n, t2 in names[c].most_common(4):
            print(f"        {t2/1e3:8.1f} ms  {n}")
