#!/usr/bin/env python3
"""One line per `cairn bench cluster --json` file: split, single-request speed, calibrated
and measured stage ms, and the concurrent run's aggregate, busy share and mean batch."""
import json, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f))
    except Exception as e:
        print(f, "unreadable:", e); continue
    for c in d["clusters"]:
        cut = "+".join(str(s["end"] - s["start"]) for s in c["stages"])
        cal = "/".join(f"{x:.1f}" for x in c.get("calibrated_stage_ms") or [])
        meas = "/".join(f"{(s['compute_ms'] or 0):.1f}" for s in c["stage_times"])
        line = (f"{f.split('/')[-1]}: {cut} one-device {d['one_device']['decode_tokens_per_s']:.1f} "
                f"single {c['decode_tokens_per_s']:.1f} e2e {c['single_request_tokens_per_s_end_to_end']:.1f} "
                f"calib-ms {cal} measured-ms {meas} checks {c.get('spot_checks')} gap {c.get('longest_gap_ms', 0):.0f}")
        cc = c.get("concurrent")
        if cc:
            st = ", ".join(f"{s['busy']:.2f}/{s['mean_batch']:.2f}" for s in cc["stages"])
            line += (f" | {cc['requests']} at once {cc['aggregate_tokens_per_s']:.1f} "
                     f"({cc['vs_single_request']:.2f}x) busy/batch {st} same={cc['outputs_identical']} checks {cc.get('spot_checks')}")
        print(line)
