// Sums a vec4 over the workgroup's WG invocations: subgroupAdd in each subgroup, then the
// subgroups' sums through workgroup memory behind one barrier; every invocation gets the sum.
// Assumes subgroups are contiguous runs of local_invocation_index of a power-of-two size, as
// drivers lay out 1-D workgroups. Call in uniform control flow. (No `enable subgroups;`: naga
// rejects the directive and gates the builtins on the SUBGROUP capability instead.)
struct Lanes {
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_size) sg_size: u32,
}

var<workgroup> red: array<vec4<f32>, WG>;

fn reduce4(v: vec4<f32>, lanes: Lanes) -> vec4<f32> {
    let s = subgroupAdd(v);
    let width = min(lanes.sg_size, WG);
    if (lanes.li % width == 0u) {
        red[lanes.li / width] = s;
    }
    workgroupBarrier();
    var sum = red[0];
    for (var j = 1u; j < WG / width; j++) {
        sum += red[j];
    }
    workgroupBarrier();
    return sum;
}
