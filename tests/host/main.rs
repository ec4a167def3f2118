//! The host tier: tests that load no driver at all (no GPU, no driver double): NCCL's loading
//! from stand-in libraries, the rendezvous of ranks and its job secret, the examples' command
//! lines, the scripts' exit statuses, the crate's sources read as text, and the test tree's own
//! layout. (The configuration, the boundary plan, the errors, the wire format and the secret's
//! file are unit tests of the library: `cargo test --lib`.)
//!
//! Beside this binary, in this folder, the host tests that must be processes of their own:
//! `no_driver` (points the process-wide loader at a missing library before anything loads one)
//! and `environment` (changes the process's environment).

#[path = "../common/mod.rs"]
mod common;

mod docs;
mod examples;
mod layout;
mod local_channel;
mod module_graph;
mod nccl_loading;
mod rendezvous;
mod scripts;
mod sources;
