//! Tensors larger than a device binds in one buffer (an 8B model's 532 MiB embedding against
//! WebGPU's 128 MiB per storage binding), held as several buffers of whole rows.
//!
//! Only the `wgpu` and `vulkan` backends make them ([`Device::upload_rows`]), and only their
//! planner takes them, in the ops that read weights by rows: a `Linear`'s weights (a product
//! per part into its slice of the output) and an `Embed`'s table (each part fills the rows of
//! the ids it holds). Anywhere else such a buffer is refused with an error that says so.
//!
//! [`Device::upload_rows`]: super::Device::upload_rows

use std::ops::Range;

use super::Buffer;

/// The parts of a tensor cut by rows: every part but the last holds `rows_per_part` rows.
pub(crate) struct RowParts {
    pub(crate) parts: Vec<Buffer>,
    pub(crate) rows_per_part: u64,
    pub(crate) row_bytes: u64,
}

impl RowParts {
    /// Bytes of every part but the last.
    fn part_bytes(&self) -> u64 {
        self.rows_per_part * self.row_bytes
    }

    /// The first row of each part and its buffer.
    pub(crate) fn with_first_rows(&self) -> impl Iterator<Item = (u64, &Buffer)> {
        self.parts
            .iter()
            .enumerate()
            .map(|(i, b)| (i as u64 * self.rows_per_part, b))
    }

    /// The pieces of the byte range `offset..offset + len` of the whole tensor: (part, byte
    /// offset in it, range of the caller's bytes).
    pub(crate) fn pieces(&self, offset: u64, len: u64) -> Vec<(&Buffer, u64, Range<usize>)> {
        let per = self.part_bytes().max(1);
        let mut out = Vec::new();
        let (mut at, end) = (offset, offset + len);
        while at < end {
            let p = (at / per) as usize;
            let Some(part) = self.parts.get(p) else {
                break;
            };
            let in_part = at - p as u64 * per;
            let n = (per - in_part)
                .min(end - at)
                .min(part.size() - in_part.min(part.size()));
            if n == 0 {
                break;
            }
            out.push((
                part,
                in_part,
                (at - offset) as usize..(at - offset + n) as usize,
            ));
            at += n;
        }
        out
    }
}

/// How many rows of `row_bytes` each part of a tensor of `total` bytes holds when a buffer
/// takes at most `max` bytes; `None` where one part holds it all or a row alone is too large.
pub(crate) fn rows_per_part(total: u64, row_bytes: u64, max: u64) -> Option<u64> {
    if total <= max || row_bytes == 0 || !total.is_multiple_of(row_bytes) {
        return None;
    }
    let rows = max / row_bytes;
    (rows > 0).then_some(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_hold_whole_rows_up_to_the_limit() {
        assert_eq!(rows_per_part(100, 10, 100), None);
        assert_eq!(rows_per_part(110, 10, 100), Some(10));
        assert_eq!(rows_per_part(110, 10, 35), Some(3));
        // A row larger than a buffer cannot be cut by rows.
        assert_eq!(rows_per_part(110, 10, 9), None);
        // Not whole rows: not cut.
        assert_eq!(rows_per_part(115, 10, 35), None);
    }
}
