//! One module per subcommand.

pub mod devices;
pub mod run;
pub mod score;
