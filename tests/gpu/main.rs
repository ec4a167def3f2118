//! The GPU tier: tests that need a GPU, each declaring what it needs (`common::needs`: GPUs,
//! NCCL, peer access) and skipping with one short line where the machine lacks it, or failing
//! under `PPNRT_REQUIRE_GPUS` / `PPNRT_REQUIRE_NCCL` (the GPU gate sets them). The scenarios of
//! `tests/common/` that the double tier runs through the driver double run here on the GPUs
//! present. On a machine with GPUs the tests take the devices one at a time.
//!
//! Beside this binary, in this folder, the GPU tests that must be processes of their own:
//! `faults` (its child processes trap on purpose), `singleton` and `sticky_build` (each builds
//! the process-wide runtime from the environment it sets).

#[path = "../common/mod.rs"]
mod common;

#[path = "../common/gated_kernels.rs"]
mod gated_kernels;
#[path = "../common/graph_order.rs"]
mod graph_order;
#[path = "../common/graphs.rs"]
mod graphs;
#[path = "../common/ipc_fd.rs"]
mod ipc_fd;
#[path = "../common/ordering.rs"]
mod ordering;
#[path = "../common/raw_driver.rs"]
mod raw_driver;
#[path = "../common/raw_threads.rs"]
mod raw_threads;
#[path = "../common/soundness.rs"]
mod soundness;
#[path = "../common/threads.rs"]
mod threads;

mod cudarc_on_gpu;
mod driver;
mod gated_copy_on_gpu;
mod graphs_on_gpu;
mod hazards;
mod ipc_on_gpu;
mod launch;
mod ordering_on_gpu;
mod pipeline;
mod safe_layer;
mod soundness_on_gpu;
