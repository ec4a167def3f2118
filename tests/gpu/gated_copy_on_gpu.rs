//! The IPC sending rank's copy that a failure cancels, its kernels on the GPU
//! (`tests/common/gated_kernels.rs`): every alignment and size copied exactly below the release
//! value and nothing written at it, and a release that lands while the copy runs never leaves a
//! part of the slot signalled filled (the signal kernel reads the gate after every block of the
//! copy, on the same stream: it must see a gate at least as new as any block saw).

use crate::common::needs::{Needs, requires};
use crate::common::{say, under_sanitizer};
use crate::gated_kernels::{
    a_release_during_the_copy_never_leaves_a_part_signalled_filled,
    the_gated_copy_copies_every_alignment_and_writes_nothing_once_released,
};

#[test]
fn the_gated_copy_is_exact_below_the_release_and_never_signals_a_part_filled_on_a_gpu() {
    let Some(gpu) =
        requires("the_gated_copy_is_exact_below_the_release_and_never_signals_a_part_filled_on_a_gpu", Needs::gpus(1))
    else {
        return;
    };
    let engine = gpu.engine(0);
    the_gated_copy_copies_every_alignment_and_writes_nothing_once_released(&engine);
    // Under the sanitizer the copy is serialised and slow: a few runs check the kernels only.
    let runs = if under_sanitizer() { 4 } else { 300 };
    let outcomes = a_release_during_the_copy_never_leaves_a_part_signalled_filled(&engine, 64, runs);
    say(&format!("the gated copy raced with its release {runs} times: {outcomes:?}"));
}
