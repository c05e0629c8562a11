//! Memory: sizes and the process's measured memory ([`budget`]), cgroup
//! limits ([`cgroup`]), and what the tools allocate after load, fitted into
//! the reserve ([`growth`]).

pub mod budget;
pub mod cgroup;
pub mod growth;
