// Sums a vec4 over the workgroup's WG invocations through workgroup memory (a tree, one
// barrier a level); every invocation gets the sum. Call in uniform control flow.
struct Lanes {
    @builtin(local_invocation_index) li: u32,
}

var<workgroup> red: array<vec4<f32>, WG>;

fn reduce4(v: vec4<f32>, lanes: Lanes) -> vec4<f32> {
    let li = lanes.li;
    red[li] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    let sum = red[0];
    workgroupBarrier();
    return sum;
}
