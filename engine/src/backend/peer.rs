//! Sums across the GPUs of one host with no host step between them: what a tensor-parallel
//! pass (model/tensor_split.rs) queues on each device when every device of the split can read
//! the others' memory directly (CUDA peer access over NVLink or PCIe).
//!
//! A device's whole pass is one list of [`Piece`]s: its ops up to a partial product, then a
//! [`PeerSum`] that tells every other device its partial is ready (a flag written into their
//! memory), waits until every other device has said the same, and adds every device's partial
//! into its own hidden states, then the next ops. The waits are on the GPUs, so the host
//! queues each device's pass at once (one run, replayed as a CUDA graph from the second
//! decode step on) instead of a run, a copy and an add per half-layer and device.

use super::Buffer;
use crate::kernels::Op;

/// The most devices a peer sum spans (the kernel takes this many partials and flag buffers).
pub const MAX_PEER_DEVICES: usize = 8;

/// Bytes of the flag buffer each device of a split holds: a word per device, which that
/// device's [`PeerSum`]s write with their epoch.
pub const PEER_FLAG_BYTES: u64 = 4 * MAX_PEER_DEVICES as u64;

/// `h += parts[0] + parts[1] + ...` (in device order, so every device computes the same
/// floats) once every device of the split has reached the same sum.
///
/// `parts[d]` and `flags[d]` live on device `d`; `h`, `parts[index]` and `flags[index]` on
/// the device that runs it. `epoch` must grow by one per sum across every pass of the split
/// (all devices give the same sum the same epoch); flags start at zero.
#[derive(Debug, Clone)]
pub struct PeerSum<'a> {
    pub h: &'a Buffer,
    pub parts: Vec<&'a Buffer>,
    pub flags: Vec<&'a Buffer>,
    /// This device's place in `parts` and `flags`.
    pub index: u32,
    pub epoch: u32,
    /// The epoch of the pass's first sum (a device that gave up waiting, because another
    /// never came, stops waiting for the rest of that pass).
    pub first: u32,
    /// Floats to sum.
    pub n: u32,
}

/// One step of a device's queued pass.
#[derive(Debug, Clone)]
pub enum Piece<'a> {
    Ops(Vec<Op<'a>>),
    Sum(PeerSum<'a>),
}
