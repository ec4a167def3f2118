//! An engine's cudarc buffers through the pipeline, zero copy (feature `cudarc`): a cudarc slice
//! written on the engine's cudarc stream behind a device delay is sent from stage 0 through an
//! `EngineStream` read lend; the step is received into another cudarc slice (`rx_into`, the
//! boundary's one copy) through a write lend, behind a delay on stage 1's stream; cudarc then
//! reads that slice on a third cudarc stream of its own, with no join anywhere in the engine's
//! code, and every value arrives. Then the same with the write lend's ordering broken on purpose
//! (cudarc reads the buffer inside the lend, so nothing orders cudarc after the crate's copy): the
//! values are the earlier ones, so the test can fail. Also on the GPU: a runtime keeps cudarc's
//! stream alive as a stage's stream, and every lend leaves the thread's current context as it
//! was. Needs a GPU (cudarc loads the real driver); skips, saying why, without one (the same
//! protocol runs through the driver double in `tests/double/cudarc_double.rs`).
#![cfg(feature = "cudarc")]

use crate::common;

use std::sync::Arc;

use common::needs::{Needs, requires};
use common::{spin_on, under_sanitizer};
use ppnrt::interop::EngineStream;
use ppnrt::{PpConfig, PpNRt};

const N: usize = 1 << 20;

#[test]
fn cudarc_buffers_go_through_the_pipeline_ordered_both_ways() {
    let Some(gpu) = requires("cudarc_buffers_go_through_the_pipeline_ordered_both_ways", Needs::gpus(1)) else {
        return;
    };
    let engine = gpu.engine(0);
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let reader = ctx.new_stream().unwrap();
    let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
    let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
    // Under compute-sanitizer (the gate sets PPNRT_SANITIZER) the streams' work is serialised,
    // which closes the window the broken rounds need open: they still run, unchecked.
    let sanitized = under_sanitizer();
    for round in 0..20u32 {
        let values: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ round).collect();
        // The engine's write, behind 200 µs of device work on its stream.
        spin_on(&engine, engine_stream.stream(), 200_000);
        let x = theirs.clone_htod(&values).unwrap();
        let mut y = theirs.alloc_zeros::<u32>(N).unwrap();
        let slot = engine_stream
            .read(&x, |lent| {
                let _stage = rt.enter(0).unwrap();
                rt.tx(0, &lent, N).unwrap()
            })
            .unwrap();
        let broken = round % 2 == 1;
        let seen = {
            let _stage = rt.enter(1).unwrap();
            let stage = Arc::clone(rt.stage_stream(1).unwrap());
            let early = engine_stream
                .write(&mut y, |mut lent| {
                    spin_on(&engine, &stage, 200_000);
                    // The step lands in the cudarc slice with the boundary's one copy.
                    rt.rx_into(0, slot, &mut lent).unwrap();
                    broken.then(|| {
                        // Read through a raw address inside the lend: cudarc's event does not
                        // cover the crate's copy yet.
                        // SAFETY: the address holds N u32 until `y` goes (after this block); the
                        // view is leaked (never freed by cudarc) once the copy out is done.
                        let view =
                            unsafe { reader.upgrade_device_ptr::<u32>(ppnrt::DeviceSlice::device_ptr(&lent), N) };
                        let seen = reader.clone_dtoh(&view).unwrap();
                        view.leak();
                        seen
                    })
                })
                .unwrap();
            early.unwrap_or_else(|| reader.clone_dtoh(&y).unwrap())
        };
        if broken && !sanitized {
            assert_ne!(seen, values, "round {round}: cudarc read the buffer before the crate's copy ran");
        } else if !broken {
            assert_eq!(seen, values, "round {round}");
        }
    }
    if sanitized {
        println!(
            "cudarc_buffers_go_through_the_pipeline_ordered_both_ways: 10 ordered rounds exact; the 10 broken rounds ran unchecked (under compute-sanitizer the race cannot occur)"
        );
    } else {
        println!(
            "cudarc_buffers_go_through_the_pipeline_ordered_both_ways: 10 ordered rounds exact, 10 broken rounds caught"
        );
    }
}

/// A slot received in place is read by cudarc through `EngineStream::received_view`, zero copy:
/// a second cudarc stream copies the view into a cudarc buffer; the view and the slot are
/// dropped and stage 0 sends the next round into the same slot (one slot per boundary). The
/// copy must hold this round's values: after its send, which comes behind a device delay in
/// rounds 0, 4, ... (read after write), and before the next one, which comes at once while the
/// copy waits behind a delay in rounds 2, 6, ... (write after read). The broken rounds read the
/// slot's memory late through a raw view that cudarc's events do not cover: the next send then
/// overwrites it before the copy runs.
#[test]
fn a_slot_received_in_place_is_read_by_cudarc_as_a_view_ordered_both_ways() {
    let name = "a_slot_received_in_place_is_read_by_cudarc_as_a_view_ordered_both_ways";
    let Some(gpu) = requires(name, Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let (theirs, reader) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
    let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
    let reader_stream = EngineStream::new(&engine, &reader).unwrap();
    let rt = PpNRt::new(PpConfig::new(2).with_slots(1), &engine).unwrap();
    let sanitized = under_sanitizer();
    let values = |round: u32| -> Vec<u32> { (0..N as u32).map(|i| i.wrapping_mul(2_246_822_519) ^ round).collect() };
    let (mut caught, rounds) = (0, 20u32);
    // Every round's input on the device beforehand: a send then enqueues at once (a copy from
    // pageable host memory would hold the host until the late reads were done).
    let inputs: Vec<_> = (0..=rounds).map(|round| engine.htod(&values(round)).unwrap()).collect();
    engine.synchronize().unwrap();
    let send = |round: u32, delay: u64| {
        let _stage = rt.enter(0).unwrap();
        spin_on(&engine, rt.stage_stream(0).unwrap(), delay);
        rt.tx(0, &inputs[round as usize], N).unwrap()
    };
    let mut slot = send(0, 300_000);
    for round in 0..rounds {
        let broken = round % 2 == 1;
        let mut out = reader.alloc_zeros::<u32>(N).unwrap();
        let mut received = rt.rx_in_place::<u32>(0, slot, N).unwrap();
        let address = ppnrt::DeviceSlice::device_ptr(&received.view().unwrap());
        engine_stream
            .received_view(&mut received, |view| {
                // Rounds 2, 6, ...: the read comes late, the next send at once (write after read).
                if broken || round % 4 == 2 {
                    spin_on(&engine, reader_stream.stream(), 200_000);
                }
                if broken {
                    // SAFETY: the slot holds N u32 while `received` lives; the raw slice is
                    // leaked, never freed by cudarc. Nothing orders it: that is the broken
                    // protocol.
                    let raw = unsafe { reader.upgrade_device_ptr::<u32>(address, N) };
                    reader.memcpy_dtod(&raw, &mut out).unwrap();
                    raw.leak();
                } else {
                    reader.memcpy_dtod(&view, &mut out).unwrap();
                }
            })
            .unwrap();
        drop(received);
        // The next round into the same slot: ordered after the reads (write after read). Rounds
        // 0, 4, ...: its data comes late, the read at once (read after write).
        slot = send(round + 1, if (round + 1) % 4 == 0 { 300_000 } else { 0 });
        let seen = reader.clone_dtoh(&out).unwrap();
        if !broken {
            assert_eq!(seen, values(round), "round {round}");
        } else if seen != values(round) {
            caught += 1;
        }
    }
    drop(rt.rx::<u32>(0, slot, N).unwrap());
    if sanitized {
        println!(
            "{name}: 10 ordered rounds exact; the broken rounds ran unchecked (serialised under compute-sanitizer)"
        );
    } else {
        assert!(caught > 0, "no broken round read a value the next send had overwritten: the test cannot fail");
        println!("{name}: 10 ordered rounds exact, {caught} of 10 broken rounds caught");
    }
}

/// cudarc's stream as a stage's stream on the GPU: after the engine drops every handle of its
/// own, the runtime still runs stage 1 on it (cudarc has not destroyed it), and a lend on device
/// 0 leaves the thread's current context (none, or device 1's where there is one) as it was.
#[test]
fn cudarcs_stream_lives_with_the_runtime_and_lends_leave_the_context_as_it_was() {
    let name = "cudarcs_stream_lives_with_the_runtime_and_lends_leave_the_context_as_it_was";
    let Some(gpu) = requires(name, Needs::gpus(1)) else { return };
    let engine = gpu.engine(0);
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let theirs = ctx.new_stream().unwrap();
    let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
    let x = theirs.clone_htod(&vec![7u32; N]).unwrap();
    let elsewhere = ppnrt::Engine::new(1).ok();
    let before = elsewhere.as_ref().map_or(std::ptr::null_mut(), |e| e.context().raw());
    // SAFETY: a live primary context (its engine outlives every use), or null.
    unsafe { ppnrt::result::context::set_current(before) }.unwrap();
    assert_eq!(engine_stream.read(&x, |view| ppnrt::DeviceSlice::len(&view)).unwrap(), N);
    assert_eq!(ppnrt::result::context::get_current().unwrap(), before, "a lend left cudarc's context current");
    let rt = PpNRt::with_stage_streams(PpConfig::new(2), &engine, &[None, Some(Arc::clone(engine_stream.stream()))])
        .unwrap();
    drop(engine_stream);
    drop(theirs);
    let sent: Vec<u32> = (0..N as u32).collect();
    let input = engine.htod(&sent).unwrap();
    let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &input, N)).unwrap();
    let received = {
        let _stage = rt.enter(1).unwrap();
        engine.dtoh(&rt.rx::<u32>(0, slot, N).unwrap()).unwrap()
    };
    assert_eq!(received, sent, "stage 1 on cudarc's stream, after the engine let go of it");
    drop(rt);
    assert!(ppnrt::take_drop_errors().is_empty(), "cudarc's stream was destroyed once, after the runtime");
}
