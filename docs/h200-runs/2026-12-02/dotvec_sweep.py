# W4A16 dot tiles with and without scales_vec, M 32-128 x four 31B shapes; writes choice.json (best geomean per range)
import json
import math
import os

import perfkit.kernels.w4a16_gemm as W

C = W.W4A16Config
cfgs = [W.DOT_SMALL_CONFIG, W.DOT_LARGE_CONFIG] + [c for c in W.SWEEP_CONFIGS["dot"] if c is not None and c.scales_vec]
cfgs.append(C(128, 128, 128, num_warps=8, num_stages=3, swap_ab=True, scales_vec=True))
shapes = [(m, n, k) for m in (32, 48, 64, 96, 128) for n, k in ((5376, 21504), (43008, 5376), (16384, 5376), (5376, 16384))]
res = W.sweep_w4a16(shapes=shapes, paths=("dot",), configs={"dot": tuple(cfgs)}, log=None)
out = os.environ["OUT"]
with open(out + "/5-w4a16_vec.jsonl", "w") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
rows = [r for r in res if "graph_ms" in r and "path" in r]
best = {}
for r in rows:
    best[(r["M"], r["N"], r["K"])] = min(best.get((r["M"], r["N"], r["K"]), 1e9), r["graph_ms"])
choice = {}
for name, ms in (("small", (32, 48, 64)), ("large", (96, 128))):
    score = {}
    for r in rows:
        if r["M"] in ms:
            score.setdefault(json.dumps(r["config"], sort_keys=True), []).append(math.log(r["graph_ms"] / best[(r["M"], r["N"], r["K"])]))
    ranked = sorted((math.exp(sum(v) / len(v)), k) for k, v in score.items() if len(v) == 4 * len(ms))
    for g, k in ranked[:4]:
        print(name, round(g, 3), k)
    choice[name] = json.loads(ranked[0][1])
json.dump(choice, open(out + "/5-choice.json", "w"))
for M in (32, 64, 128):
    for r in rows:
        if r["M"] == M and r["N"] == 5376 and r["K"] == 21504:
            c = r["config"]
            print(M, round(r["graph_ms"] * 1e3, 1), c["block_m"], c["block_n"], c["block_k"], c["num_warps"], c["scales_ahead"], c["scales_vec"])
