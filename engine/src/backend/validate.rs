//! Shape checks every backend runs before queuing an op, so a kernel never reads or writes
//! outside its buffers and a wrong shape is an error, not garbage or a crash.

use super::{BackendError, Buffer, Result};
use crate::kernels::{Access, Op, OpSpec, Use, with_op};

/// Checks an op's shapes against its buffers.
pub fn validate_op(op: &Op<'_>) -> Result<()> {
    with_op!(op, o => validate(o).map(|_| ()))
}

/// Checks one op: its shape rules, then that each buffer holds the bytes the op touches and
/// that no output is also an input (unless the op works in place on it). Returns the
/// buffers.
pub(crate) fn validate<'a>(op: &impl OpSpec<'a>) -> Result<Vec<Use<'a>>> {
    let name = op.name();
    let invalid = |reason: String| BackendError::InvalidOp { op: name, reason };
    op.check().map_err(invalid)?;
    let uses = op.buffers();
    for u in &uses {
        need(u).map_err(invalid)?;
    }
    for out in uses.iter().filter(|u| u.access == Access::Write) {
        let aliased = uses
            .iter()
            .any(|u| u.access == Access::Read && std::ptr::eq(u.buf, out.buf));
        if aliased {
            return Err(invalid(format!(
                "output {} must not also be an input",
                out.buf.label()
            )));
        }
    }
    Ok(uses)
}

fn need(u: &Use<'_>) -> std::result::Result<(), String> {
    let buf: &Buffer = u.buf;
    match u.bytes {
        Some(b) if b <= buf.size() => Ok(()),
        Some(b) => Err(format!(
            "{} ({}) needs {b} bytes, has {}",
            u.role,
            buf.label(),
            buf.size()
        )),
        None => Err(format!("{}: size overflows", u.role)),
    }
}
