//! Integration tests: real binaries, real GGUF files, real processes.

mod archs;
mod browser;
mod endpoints;
mod badinput;
mod families;
mod far;
mod faults;
mod genmodel;
mod inspect;
mod library;
mod limit;
mod load;
mod pages;
mod pager;
mod replay;
mod server;
mod split;
mod tools;
mod util;
mod vision;

