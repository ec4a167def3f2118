//! The host-cost table (`model`): what host work costs when it runs between the driver calls of
//! a boundary step, the place where the crate's own code runs. It explains the crate/raw ratios
//! of the comparison table: the crate makes the raw loop's calls plus its own bookkeeping, which
//! is instructions, atomic read-modify-writes (reference counts, the enqueue gate) and mutexes
//! (the buffers' ordering states), all between driver calls.
//!
//! The raw local step on one device (wait, copy, record on the TX stream; wait, allocation, copy,
//! record, free on the RX stream: 8 calls, 32 KiB) runs alone and with extra host work spread
//! evenly over its 8 gaps, in alternating rounds; each round's median step time is compared with
//! the same round's plain step. The same extra work also runs alone (no driver call around it).

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering, fence};
use std::time::Instant;

use ppnrt::sys::CUdeviceptr;
use ppnrt::{CudaEvent, CudaStream, DeviceSlice};

use super::{Gpus, median, raw, say};

/// Iterations of [`busy`] per step (spread over the 8 gaps).
const BUSY_ITERATIONS: u32 = 1000;
/// Atomic read-modify-writes per step, each on its own cache line.
const ATOMICS: usize = 48;
/// Uncontended mutex lock + unlock pairs per step, each mutex on its own cache line.
const MUTEXES: usize = 16;
/// Sequentially consistent fences per step.
const FENCES: usize = 8;
const GAPS: usize = 8;
const ROUNDS: usize = 12;
const STEPS: usize = 1000;

#[repr(align(128))]
struct Line(AtomicUsize);

#[repr(align(128))]
struct Locked(Mutex<usize>);

/// Host work run in one gap of the step (the gap's index, 0 to 7).
type Extra<'a> = Box<dyn Fn(usize) + 'a>;

/// A loop the optimiser keeps: each iteration is a multiply-add through `black_box`.
#[inline(never)]
fn busy(iterations: u32) -> u64 {
    let mut value = black_box(1u64);
    for _ in 0..iterations {
        value = black_box(value.wrapping_mul(3).wrapping_add(1));
    }
    value
}

pub(crate) fn host_model(gpus: &Gpus, report: &mut String) {
    let e = &gpus.engines[0];
    let ctx = e.context().clone();
    let (tx, rx) = (CudaStream::new(&ctx).unwrap(), CudaStream::new(&ctx).unwrap());
    let n = 8192;
    let x = e.htod(&(0..n as u32).collect::<Vec<_>>()).unwrap();
    let slot = e.htod(&vec![7u32; n]).unwrap();
    let (x_ptr, slot_ptr, bytes) = (x.device_ptr(), slot.device_ptr(), n * 4);
    let (ev_tx, ev_rx) = (CudaEvent::new(&ctx, false).unwrap(), CudaEvent::new(&ctx, false).unwrap());
    ev_rx.record(&rx).unwrap();
    tx.synchronize().unwrap();
    rx.synchronize().unwrap();
    raw!(cuCtxSetCurrent(ctx.raw()));

    let lines: Vec<Line> = (0..ATOMICS).map(|_| Line(AtomicUsize::new(0))).collect();
    let mutexes: Vec<Locked> = (0..MUTEXES).map(|_| Locked(Mutex::new(0))).collect();
    let extras: [(String, Extra<'_>); 5] = [
        ("the raw local step (8 driver calls)".into(), Box::new(|_| {})),
        (
            format!("+ {BUSY_ITERATIONS} iterations of a multiply-add loop"),
            Box::new(|_| {
                black_box(busy(BUSY_ITERATIONS / GAPS as u32));
            }),
        ),
        (
            format!("+ {ATOMICS} atomic read-modify-writes"),
            Box::new(|gap| {
                for line in &lines[gap * ATOMICS / GAPS..(gap + 1) * ATOMICS / GAPS] {
                    line.0.fetch_add(1, Ordering::AcqRel);
                }
            }),
        ),
        (
            format!("+ {MUTEXES} mutex lock + unlock pairs"),
            Box::new(|gap| {
                for mutex in &mutexes[gap * MUTEXES / GAPS..(gap + 1) * MUTEXES / GAPS] {
                    *mutex.0.lock().unwrap() += 1;
                }
            }),
        ),
        (
            format!("+ {FENCES} SeqCst fences"),
            Box::new(|_| {
                for _ in 0..FENCES / GAPS {
                    fence(Ordering::SeqCst);
                }
            }),
        ),
    ];
    let step = |extra: &dyn Fn(usize)| {
        raw!(cuStreamWaitEvent(tx.raw(), ev_rx.raw(), 0));
        extra(0);
        raw!(cuMemcpyAsync(slot_ptr, x_ptr, bytes, tx.raw()));
        extra(1);
        raw!(cuEventRecord(ev_tx.raw(), tx.raw()));
        extra(2);
        raw!(cuStreamWaitEvent(rx.raw(), ev_tx.raw(), 0));
        extra(3);
        let mut out: CUdeviceptr = 0;
        raw!(cuMemAllocAsync(&mut out, bytes, rx.raw()));
        extra(4);
        raw!(cuMemcpyAsync(out, slot_ptr, bytes, rx.raw()));
        extra(5);
        raw!(cuEventRecord(ev_rx.raw(), rx.raw()));
        extra(6);
        raw!(cuMemFreeAsync(out, rx.raw()));
        extra(7);
    };
    // Per round and variant: the median step time (µs).
    let mut rounds = vec![Vec::new(); extras.len()];
    for round in 0..=ROUNDS {
        for (variant, (_, extra)) in extras.iter().enumerate() {
            let mut times = Vec::with_capacity(STEPS);
            for i in 0..STEPS {
                if i % 32 == 0 {
                    tx.synchronize().unwrap();
                    rx.synchronize().unwrap();
                }
                let t = Instant::now();
                step(extra.as_ref());
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
            // Round 0 warms up.
            if round > 0 {
                rounds[variant].push(median(&mut times));
            }
        }
    }
    tx.synchronize().unwrap();
    rx.synchronize().unwrap();
    let _ = writeln!(
        report,
        "\n| host work between the calls of a raw local step (32 KiB, one device) | step (µs, median of {ROUNDS} rounds) | added to the step (µs, median of the rounds' differences) | the same work alone (µs) |\n| --- | ---: | ---: | ---: |"
    );
    for (variant, (name, extra)) in extras.iter().enumerate() {
        let step_us = median(&mut rounds[variant].clone());
        let mut added: Vec<f64> = rounds[variant].iter().zip(&rounds[0]).map(|(with, plain)| with - plain).collect();
        let alone = {
            let t = Instant::now();
            for _ in 0..STEPS * 10 {
                for gap in 0..GAPS {
                    extra(gap);
                }
            }
            t.elapsed().as_secs_f64() * 1e6 / (STEPS * 10) as f64
        };
        let line = if variant == 0 {
            format!("| {name} | {step_us:.2} | — | — |")
        } else {
            format!("| {name} | {step_us:.2} | {:+.3} | {alone:.3} |", median(&mut added))
        };
        say(&line);
        let _ = writeln!(report, "{line}");
    }
}
