//! RMSNorm.

pub fn rms_norm(x: &[f32], weight: &[f32], y: &mut [f32], dim: usize, eps: f32) {
    for (xr, yr) in x.chunks_exact(dim).zip(y.chunks_exact_mut(dim)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in yr.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}
