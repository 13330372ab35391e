//! One module per subcommand.

pub mod audit;
pub mod bench;
pub mod bench_batch;
pub mod bench_split;
pub mod cluster_bench;
pub mod devices;
pub mod engine_args;
pub mod formats;
pub mod ice_args;
pub mod link_bench;
pub mod model_args;
pub mod quantize;
pub mod run;
pub mod score;
pub mod serve;
pub mod signal_args;
pub mod token;
pub mod worker;
