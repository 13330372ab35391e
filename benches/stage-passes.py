#!/usr/bin/env python3
"""Sums the stage threads' per-pass trace (idle, pass, dispatch) per worker log, over the
concurrent phase of a `cairn bench cluster` run (from its first pass of several sequences to
its last): `RUST_LOG=warn,cairn_native=info,cairn_native::worker::stage_thread=debug cairn
bench cluster ... --logs DIR`, then `benches/stage-passes.py DIR`."""
import re, sys, glob, os, statistics as st
pat = re.compile(r'^(\S+) DEBUG \S+stage_thread: pass seqs=(\d+)(?: idle_us=(\d+))? pass_us=(\d+) dispatch_us=(\d+)')
for d in sys.argv[1:]:
    for f in sorted(glob.glob(os.path.join(d, '*worker*.log'))):
        rows = []
        for line in open(f, errors='replace'):
            line = re.sub(r'\x1b\[[0-9;]*m', '', line)
            m = pat.match(line)
            if m and m.group(3) is not None:
                rows.append((int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))))
        # the concurrent phase: from the first pass of several sequences to the last
        multi = [i for i, r in enumerate(rows) if r[0] > 1]
        steady = rows[multi[0] + 1:multi[-1] + 1] if len(multi) > 1 else []
        if not steady:
            print(os.path.basename(f), 'no passes'); continue
        tot = sum(r[1] + r[2] + r[3] for r in steady)
        idle = sum(r[1] for r in steady); pas = sum(r[2] for r in steady); dis = sum(r[3] for r in steady)
        print(f"{os.path.basename(f)}: passes {len(steady)}/{len(rows)} mean seqs {st.mean(r[0] for r in steady):.2f} "
              f"idle {idle/tot:.2f} pass {pas/tot:.2f} dispatch {dis/tot:.2f}; median us idle {st.median(r[1] for r in steady):.0f} "
              f"pass {st.median(r[2] for r in steady):.0f} dispatch {st.median(r[3] for r in steady):.0f}")
        for k in sorted(set(r[0] for r in steady)):
            sel = [r for r in steady if r[0] == k]
            if len(sel) >= 5:
                print(f"   seqs={k}: n={len(sel)} median idle {st.median(r[1] for r in sel):.0f} pass {st.median(r[2] for r in sel):.0f} dispatch {st.median(r[3] for r in sel):.0f}")
