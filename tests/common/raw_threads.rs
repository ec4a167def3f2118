//! The thread-per-stage decode loop of `threads.rs` written against the raw driver, with none of
//! the crate's layers: each stage's thread owns a stream; a boundary is a ring of slots, each a
//! `cuMemAlloc` buffer with a TX and an RX event, handed over under a mutex and condition
//! variable; activations come from the stream-ordered pool. The copies run the crate's SM copy
//! kernel and the layers its toy-model kernel, so the outputs must equal the crate's loops bit for
//! bit. `tests/gpu/pipeline.rs` compares them; `scripts/initcheck-threads-probe.sh` runs it under
//! compute-sanitizer beside the crate's loop.
#![allow(dead_code, unreachable_pub, unsafe_code)]

use std::ffi::c_void;
use std::ptr;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use ppnrt::kernels::{HELPERS_PTX, TOY_MODEL_PTX, pattern};
use ppnrt::sys::{CUcontext, CUdeviceptr, CUevent, CUfunction, CUmodule, CUstream};

// The includer mounts `raw_driver.rs` at its crate root (as `tests/gpu/pipeline.rs` does).
use crate::raw_driver::raw;

const N: usize = 1024;
const BYTES: usize = N * 4;

fn input(step: usize) -> Vec<f32> {
    (0..N as u64).map(|i| (pattern(step as u32, i) >> 8) as f32 / (1u32 << 24) as f32).collect()
}

/// Where a slot stands in the handover.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SlotState {
    /// Never filled, or received (the RX event follows the copy out).
    Free { received: bool },
    /// Filled (the TX event follows the copy in).
    Filled,
}

struct Slot {
    buffer: CUdeviceptr,
    ev_tx: CUevent,
    ev_rx: CUevent,
    state: SlotState,
}

struct Ring {
    slots: Mutex<Vec<Slot>>,
    changed: Condvar,
}

// SAFETY: driver handles and device addresses may be used from any thread.
unsafe impl Send for Slot {}

struct Kernels {
    copy: CUfunction,
    toy: CUfunction,
}

// SAFETY: functions of a loaded module may be launched from any thread.
unsafe impl Sync for Kernels {}

fn load(ptx: &str, name: &str) -> CUfunction {
    let mut module: CUmodule = ptr::null_mut();
    raw!(cuModuleLoadData(&raw mut module, ptx.as_ptr().cast()));
    let mut function: CUfunction = ptr::null_mut();
    let cname = std::ffi::CString::new(name).unwrap();
    raw!(cuModuleGetFunction(&raw mut function, module, cname.as_ptr()));
    function
}

fn launch(function: CUfunction, blocks: u32, stream: CUstream, params: &mut [*mut c_void]) {
    raw!(cuLaunchKernel(function, blocks, 1, 1, 256, 1, 1, 0, stream, params.as_mut_ptr(), ptr::null_mut()));
}

fn copy(kernels: &Kernels, dst: CUdeviceptr, src: CUdeviceptr, stream: CUstream) {
    let (mut d, mut s, mut n16, mut tail) = (dst, src, (BYTES / 16) as u64, 0u64);
    let mut params = [(&raw mut d).cast(), (&raw mut s).cast(), (&raw mut n16).cast(), (&raw mut tail).cast()];
    launch(kernels.copy, (BYTES / 16 + 1).div_ceil(256) as u32, stream, &mut params);
}

fn toy_layer(kernels: &Kernels, x: CUdeviceptr, step: u32, layer: u32, stream: CUstream) {
    let (mut x, mut n, mut step, mut layer) = (x, N as u64, step, layer);
    let mut params = [(&raw mut x).cast(), (&raw mut n).cast(), (&raw mut step).cast(), (&raw mut layer).cast()];
    launch(kernels.toy, N.div_ceil(256) as u32, stream, &mut params);
}

fn alloc_async(stream: CUstream) -> CUdeviceptr {
    let mut ptr: CUdeviceptr = 0;
    raw!(cuMemAllocAsync(&raw mut ptr, BYTES, stream));
    ptr
}

/// How long a thread waits for the other side of a slot before it gives up (a stage whose thread
/// died must fail the test, not hang it).
const HANDOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// Waits until `ready` holds for slot `index`, then runs `then` on it (under the lock) and wakes
/// the other side. Panics after [`HANDOVER_TIMEOUT`].
fn with_slot(ring: &Ring, index: usize, ready: impl Fn(SlotState) -> bool, then: impl FnOnce(&mut Slot)) {
    let deadline = Instant::now() + HANDOVER_TIMEOUT;
    let mut slots = ring.slots.lock().unwrap();
    while !ready(slots[index].state) {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "slot {index}: the other side did not hand it over in {HANDOVER_TIMEOUT:?}");
        slots = ring.changed.wait_timeout(slots, left).unwrap().0;
    }
    then(&mut slots[index]);
    drop(slots);
    ring.changed.notify_all();
}

/// Every step's output (as bits) of `stages` stages on device 0, one host thread per stage,
/// `slots` slots per boundary. With `lazy_slots` each slot's buffer is allocated by the sending
/// thread at its first use (as the crate's `tx` grows a slot), else before the threads start.
pub fn raw_thread_per_stage(stages: usize, slots: usize, steps: usize, lazy_slots: bool) -> Vec<Vec<u32>> {
    raw!(cuInit(0));
    let mut ctx: CUcontext = ptr::null_mut();
    raw!(cuDevicePrimaryCtxRetain(&raw mut ctx, 0));
    raw!(cuCtxSetCurrent(ctx));
    let kernels =
        Kernels { copy: load(HELPERS_PTX, "ppnrt_copy_bytes"), toy: load(TOY_MODEL_PTX, "ppnrt_toy_layer_f32") };
    // Kept as addresses: a raw pointer is not `Send`.
    let streams: Vec<usize> = (0..stages)
        .map(|_| {
            let mut stream: CUstream = ptr::null_mut();
            raw!(cuStreamCreate(&raw mut stream, 1));
            stream as usize
        })
        .collect();
    let rings: Vec<Ring> = (0..stages - 1)
        .map(|_| Ring {
            slots: Mutex::new(
                (0..slots)
                    .map(|_| {
                        let (mut ev_tx, mut ev_rx): (CUevent, CUevent) = (ptr::null_mut(), ptr::null_mut());
                        raw!(cuEventCreate(&raw mut ev_tx, 2));
                        raw!(cuEventCreate(&raw mut ev_rx, 2));
                        let mut buffer: CUdeviceptr = 0;
                        if !lazy_slots {
                            raw!(cuMemAlloc_v2(&raw mut buffer, BYTES));
                        }
                        Slot { buffer, ev_tx, ev_rx, state: SlotState::Free { received: false } }
                    })
                    .collect(),
            ),
            changed: Condvar::new(),
        })
        .collect();
    let outputs = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..stages)
            .map(|s| {
                let (kernels, rings, stream, ctx) = (&kernels, &rings, streams[s], ctx as usize);
                scope.spawn(move || {
                    let stream = stream as CUstream;
                    raw!(cuCtxSetCurrent(ctx as CUcontext));
                    let mut outputs = Vec::new();
                    for step in 0..steps {
                        let index = step % slots;
                        let y = alloc_async(stream);
                        if s == 0 {
                            let host = input(step);
                            raw!(cuMemcpyHtoDAsync_v2(y, host.as_ptr().cast(), BYTES, stream));
                        } else {
                            // RX: wait for the slot's TX event, copy out, record the RX event.
                            with_slot(
                                &rings[s - 1],
                                index,
                                |state| state == SlotState::Filled,
                                |slot| {
                                    raw!(cuStreamWaitEvent(stream, slot.ev_tx, 0));
                                    copy(kernels, y, slot.buffer, stream);
                                    raw!(cuEventRecord(slot.ev_rx, stream));
                                    slot.state = SlotState::Free { received: true };
                                },
                            );
                        }
                        toy_layer(kernels, y, step as u32, s as u32, stream);
                        if s + 1 < stages {
                            // TX: wait for the slot's RX event (its last copy out), copy in, record
                            // the TX event.
                            with_slot(
                                &rings[s],
                                index,
                                |state| matches!(state, SlotState::Free { .. }),
                                |slot| {
                                    if slot.buffer == 0 {
                                        raw!(cuMemAlloc_v2(&raw mut slot.buffer, BYTES));
                                    }
                                    if slot.state == (SlotState::Free { received: true }) {
                                        raw!(cuStreamWaitEvent(stream, slot.ev_rx, 0));
                                    }
                                    copy(kernels, slot.buffer, y, stream);
                                    raw!(cuEventRecord(slot.ev_tx, stream));
                                    slot.state = SlotState::Filled;
                                },
                            );
                        } else {
                            let mut host = vec![0f32; N];
                            raw!(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), y, BYTES, stream));
                            raw!(cuStreamSynchronize(stream));
                            outputs.push(host.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
                        }
                        raw!(cuMemFreeAsync(y, stream));
                    }
                    raw!(cuStreamSynchronize(stream));
                    outputs
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).last().unwrap()
    });
    for ring in rings {
        for slot in ring.slots.into_inner().unwrap() {
            if slot.buffer != 0 {
                raw!(cuMemFree_v2(slot.buffer));
            }
            raw!(cuEventDestroy_v2(slot.ev_tx));
            raw!(cuEventDestroy_v2(slot.ev_rx));
        }
    }
    for stream in streams {
        raw!(cuStreamDestroy_v2(stream as CUstream));
    }
    raw!(cuDevicePrimaryCtxRelease_v2(0));
    outputs
}
