//! Cairn's WGSL compute kernels, one kernel per file in this crate's root folder.
