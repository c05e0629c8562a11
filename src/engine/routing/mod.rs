//! Routing kept across runs: traces of which experts each step used
//! (`--sdq-trace`, [`trace`]) and hot sets that warm the next run's arena
//! (`--sdq-hotset`, [`hotset`]).

pub mod hotset;
pub mod trace;
