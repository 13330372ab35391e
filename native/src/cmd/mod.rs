//! One module per subcommand.

pub mod devices;
