//! Rotary position embedding.

/// Rotates `x` (`tokens × heads × head_dim`) in place; see [`super::Op::Rope`].
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &mut [f32],
    heads: usize,
    head_dim: usize,
    rope_dim: usize,
    pos0: u32,
    freq_base: f32,
    neox: bool,
) {
    let half = rope_dim / 2;
    for (t, tok) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let pos = (pos0 as usize + t) as f32;
        for head in tok.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let theta = pos * freq_base.powf(-2.0 * i as f32 / rope_dim as f32);
                let (s, c) = theta.sin_cos();
                let (a, b) = if neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}
