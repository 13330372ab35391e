// The timing harness behind decode-rows-timing.txt: appended to engine/src/backend/cpu/tests.rs
// and run as `cargo test -p cairn-engine --lib -- --ignored decode_rows_timing --nocapture`
// (TIMING_TY=Q8_0 for one format, TIMING_ROWS=N for one size).

#[test]
#[ignore]
fn decode_rows_timing() {
    let isa = Isa::detect();
    let mut rng = StdRng::seed_from_u64(1);
    let only = std::env::var("TIMING_TY").ok();
    let sizes: Vec<(usize, usize)> = std::env::var("TIMING_ROWS").map(|v| vec![(v.parse().unwrap(), 10)]).unwrap_or(vec![(1536 * 4, 300), (49152 * 2, 30)]);
    for (rows, iters) in sizes {
        for ty in [GgmlType::Q5_0, GgmlType::Q4_1, GgmlType::Q8_0] {
            if only.as_deref().is_some_and(|o| o != ty.name()) {
                continue;
            }
            let (dot, layout) = isa.dot(ty).unwrap();
            let cols = 576;
            let row_bytes = ty.row_bytes(cols).unwrap();
            let w = random_rows(&mut rng, ty, rows, cols);
            let x = activations(&mut rng, cols, 32);
            let mut q8 = Q8::default();
            q8.quantize(layout, &x, cols, 1);
            let xr = q8.row(0);
            let kernels: Vec<(&str, super::dot::RowsFn)> = [("rows", isa.rows(ty))]
                .into_iter()
                .filter_map(|(n, k)| Some((n, k?)))
                .collect();
            let mut a = vec![0f32; rows];
            let mut outs = vec![vec![0f32; rows]; kernels.len()];
            let mut ta = f64::MAX;
            let mut tk = vec![f64::MAX; kernels.len()];
            for _ in 0..iters {
                let t = std::time::Instant::now();
                for (o, wr) in a.iter_mut().zip(w.chunks_exact(row_bytes)) {
                    *o = dot(wr, xr);
                }
                ta = ta.min(t.elapsed().as_secs_f64());
                for (j, (_, k)) in kernels.iter().enumerate() {
                    let t = std::time::Instant::now();
                    k(&w, row_bytes, xr, &mut outs[j]);
                    tk[j] = tk[j].min(t.elapsed().as_secs_f64());
                }
            }
            let mut tr = f64::MAX;
            for _ in 0..iters.min(10) {
                let t = std::time::Instant::now();
                let mut acc = 0u64;
                for c in w.chunks_exact(64) {
                    acc = acc.wrapping_add(u64::from(c[0]) ^ u64::from(c[63]));
                }
                std::hint::black_box(acc);
                tr = tr.min(t.elapsed().as_secs_f64());
            }
            let gb = (rows * row_bytes) as f64 / 1e9;
            eprintln!("  touch every cache line: {:.3} ms ({:.1} GB/s)", tr * 1e3, gb / tr);
            eprintln!(
                "{} rows {rows} x {cols}: per-row dot {:.3} ms ({:.1} GB/s)",
                ty.name(),
                ta * 1e3,
                gb / ta
            );
            for (j, (n, _)) in kernels.iter().enumerate() {
                let err = a
                    .iter()
                    .zip(&outs[j])
                    .map(|(p, q)| (p - q).abs())
                    .fold(0f32, f32::max);
                eprintln!(
                    "  {n} {:.3} ms ({:.1} GB/s) {:.2}x (max diff {err:e})",
                    tk[j] * 1e3,
                    gb / tk[j],
                    ta / tk[j]
                );
            }
        }
    }
}
