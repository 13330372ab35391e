#!/bin/sh
# Host time of the wgpu/vulkan backends' decode steps, from the `wgpu run` trace events
# (engine/src/backend/wgpu/mod.rs): medians over the runs of DISPATCHES dispatches, the
# count `cairn bench` prints as "dispatches per decode step" (135M: 454 unfused, 243 fused;
# its dispatch-cost probe's runs are 256).
#
#   RUST_LOG=cairn_engine::backend::wgpu=trace cairn bench --backend wgpu ... 2> trace.txt
#   benches/wgpu-host-time.sh trace.txt DISPATCHES
set -eu
f=$1
plain=$(sed 's/\x1b\[[0-9;]*m//g' "$f" | grep "wgpu run" |
    grep -o 'dispatches=[0-9]* plan_us=[0-9]* bind_us=[0-9]* encode_us=[0-9]* submit_us=[0-9]*' |
    tr '=' ' ')
want=$2
printf '%s\n' "$plain" | awk -v want="$want" '
$2 == want { n++; p[n] = $4; b[n] = $6; e[n] = $8; s[n] = $10; t[n] = $4 + $6 + $8 + $10 }
function med(a, n,   i, j, x) {
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x }
    return a[int((n + 1) / 2)]
}
END {
    if (n == 0) { print "no run of " want " dispatches"; exit 1 }
    printf "%s dispatches, %d runs, median us: plan %d, bind groups + params %d, encode %d, submit %d, total %d (%.2f us a dispatch)\n",
        want, n, med(p, n), med(b, n), med(e, n), med(s, n), med(t, n), med(t, n) / want
}'
