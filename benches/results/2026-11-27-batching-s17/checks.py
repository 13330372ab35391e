#!/usr/bin/env python3
"""The coordinator's spot checks from its debug log (`spot check recomputed`): per check the
request, step, rows run and ms; the first check of each request runs its whole prefix (the
cost of every check before session 17), later ones only the tokens since the last. Fits
ms = a + b * rows over all checks and prices each later check as a whole-prefix one."""
import re, sys
pat = re.compile(r'request\S*=\S*?(\d+).*?step\S*=\S*?(\d+).*?rows_run\S*=\S*?(\d+).*?ms\S*=\S*?"([\d.]+)"')
prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 32
seen, rows = set(), []
for line in open(sys.argv[1], errors="replace"):
    if "spot check recomputed" not in line:
        continue
    m = pat.search(re.sub(r'\x1b\[[0-9;]*m', '', line))
    if m:
        r, step, n, ms = int(m[1]), int(m[2]), int(m[3]), float(m[4])
        rows.append((r, step, n, ms, r not in seen)); seen.add(r)
first = [x for x in rows if x[4]]; later = [x for x in rows if not x[4]]
def mean(v): return sum(v) / len(v) if v else float("nan")
# Least squares over every check but each request's very first (the model's load is not in
# it, but a cold cache is).
xs = [x[2] for x in rows[1:]]; ys = [x[3] for x in rows[1:]]
n = len(xs); mx, my = mean(xs), mean(ys)
b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
a = my - b * mx
print(f"checks {len(rows)}: first of a request {len(first)} (rows {mean([x[2] for x in first]):.1f}, "
      f"{mean([x[3] for x in first]):.0f} ms), later {len(later)} (rows {mean([x[2] for x in later]):.1f}, "
      f"{mean([x[3] for x in later]):.0f} ms)")
print(f"fit: ms = {a:.0f} + {b:.1f} x rows")
if later:
    whole = [a + b * (prompt + x[1]) for x in later]
    print(f"the later checks as whole-prefix recomputes (prompt {prompt} + step): rows "
          f"{mean([prompt + x[1] for x in later]):.1f}, {mean(whole):.0f} ms by the fit, "
          f"against {mean([x[3] for x in later]):.0f} ms measured")
