//! The cudarc interop (`ppnrt::interop`, feature `cudarc`) through the CUDA driver double, on
//! every machine: the double is built with the driver's name inside (`libcuda.so`, its SONAME),
//! so once it is loaded, cudarc's own load of the driver by that name gets the double too, and
//! both libraries share its contexts, streams and memory as they share the driver's on a GPU.
//!
//! The double runs queued work only when something synchronises, and then only what that needs,
//! so a missing wait between cudarc's work and this crate's shows up as a wrong value. Each test
//! forces the unordered side to run first where it matters.
//!
//! - The lend's end (the engine's stream waits for the crate's uses, cudarc's event is recorded)
//!   runs when the closure returns and when it unwinds, for reads, writes and received views.
//! - No stream capture takes a lent buffer's memory into a graph that would outlive the lend.
//! - cudarc's stream lives as long as a runtime uses it as a stage's stream.
//! - Every call into cudarc leaves the thread's current context as it found it, and a
//!   `bound_unchecked` scope of another device stays right across it.
#![cfg(feature = "cudarc")]

use crate::double;

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use double::with_double;
use ppnrt::interop::EngineStream;
use ppnrt::{DeviceSlice, Engine, PpConfig, PpNRt};

const N: usize = 4096;

fn values(seed: u32) -> Vec<u32> {
    (0..N as u32).map(|i| i.wrapping_mul(2_654_435_761) ^ seed).collect()
}

fn current() -> ppnrt::sys::CUcontext {
    ppnrt::result::context::get_current().unwrap()
}

fn set_current(ctx: ppnrt::sys::CUcontext) {
    // SAFETY: a live primary context of the double (its engine outlives every use), or null.
    unsafe { ppnrt::result::context::set_current(ctx) }.unwrap();
}

/// A read lend's end is ordered before cudarc's next writer of the buffer: a `tx` from the lent
/// buffer, then cudarc overwrites the buffer on another stream of its own (forced to run at
/// once), and the receiving stage still gets the values the buffer held at the `tx`. A write
/// lend's end is ordered before cudarc's next reader: `rx_into` the lent buffer, then cudarc
/// reads it on another stream and sees the step. Each also when the closure panics after its
/// work: the end runs on unwind.
#[test]
fn a_lends_end_orders_cudarc_after_the_crate_on_return_and_on_unwind() {
    with_double("a_lends_end_orders_cudarc_after_the_crate_on_return_and_on_unwind", |_| {
        let engine = Engine::new(0).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let (theirs, other) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
        for (round, panics) in [(1u32, false), (2, true)] {
            let sent = values(round);
            let mut x = theirs.clone_htod(&sent).unwrap();
            let mut slot = None;
            let lend = std::panic::catch_unwind(AssertUnwindSafe(|| {
                engine_stream
                    .read(&x, |view| {
                        let _stage = rt.enter(0).unwrap();
                        slot = Some(rt.tx(0, &view, N).unwrap());
                        if panics {
                            panic!("after the tx");
                        }
                    })
                    .unwrap()
            }));
            assert_eq!(lend.is_err(), panics);
            // cudarc's next writer of `x`, on another stream, run at once.
            other.memcpy_htod(&values(0xdead), &mut x).unwrap();
            other.synchronize().unwrap();
            let slot = slot.expect("sent");
            let received = {
                let _stage = rt.enter(1).unwrap();
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                engine.dtoh(&y).unwrap()
            };
            assert_eq!(received, sent, "round {round}: cudarc overwrote the buffer before the crate's send read it");

            // The write lend: the step lands in a cudarc buffer, which cudarc then reads on another
            // stream.
            let step = values(round + 100);
            let x = engine.htod(&step).unwrap();
            let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &x, N)).unwrap();
            let mut y = theirs.alloc_zeros::<u32>(N).unwrap();
            let lend = std::panic::catch_unwind(AssertUnwindSafe(|| {
                engine_stream
                    .write(&mut y, |mut view| {
                        let _stage = rt.enter(1).unwrap();
                        rt.rx_into(0, slot, &mut view).unwrap();
                        if panics {
                            panic!("after the rx_into");
                        }
                    })
                    .unwrap()
            }));
            assert_eq!(lend.is_err(), panics);
            let seen = other.clone_dtoh(&y).unwrap();
            assert_eq!(seen, step, "round {round}: cudarc read the buffer before the crate's copy into it");
        }
    });
}

/// A slot received in place and read by cudarc through `received_view`: the slot's next `tx`
/// (forced to run before cudarc's read is needed) waits for cudarc's read on another stream, on
/// return and on unwind.
#[test]
fn a_received_views_end_orders_the_slots_next_tx_after_cudarcs_reads() {
    with_double("a_received_views_end_orders_the_slots_next_tx_after_cudarcs_reads", |_| {
        let engine = Engine::new(0).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let (theirs, reader) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt = PpNRt::new(PpConfig::new(2).with_slots(1), &engine).unwrap();
        let inputs: Vec<_> = (0..3u32).map(|round| engine.htod(&values(round)).unwrap()).collect();
        let send = |round: u32| rt.enter(0).and_then(|_stage| rt.tx(0, &inputs[round as usize], N)).unwrap();
        let mut slot = send(0);
        for (round, panics) in [(0u32, false), (1, true)] {
            let mut out = reader.alloc_zeros::<u32>(N).unwrap();
            let mut received = rt.enter(1).and_then(|_stage| rt.rx_in_place::<u32>(0, slot, N)).unwrap();
            let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
                engine_stream
                    .received_view(&mut received, |view| {
                        reader.memcpy_dtod(&view, &mut out).unwrap();
                        if panics {
                            panic!("after cudarc's read");
                        }
                    })
                    .unwrap()
            }));
            assert_eq!(read.is_err(), panics);
            drop(received);
            // The slot's next step, run at once (its receive waits for it).
            slot = send(round + 1);
            let next = {
                let _stage = rt.enter(1).unwrap();
                let y = rt.rx::<u32>(0, slot, N).unwrap();
                engine.dtoh(&y).unwrap()
            };
            assert_eq!(next, values(round + 1));
            slot = send(round + 1);
            let seen = reader.clone_dtoh(&out).unwrap();
            assert_eq!(seen, values(round), "round {round}: the slot's next tx overwrote it before cudarc's read");
        }
        drop(rt.enter(1).and_then(|_stage| rt.rx::<u32>(0, slot, N)).unwrap());
    });
}

/// cudarc's stream, a stage's stream: after the engine drops every handle of its own (cudarc's
/// stream and the `EngineStream`), the runtime still runs stage 1 on it, and cudarc destroys it
/// only when the runtime lets go; that destruction (cudarc binds its context for it) leaves the
/// thread's current context as it was.
#[test]
fn a_runtime_keeps_cudarcs_stream_alive_as_a_stages_stream() {
    with_double("a_runtime_keeps_cudarcs_stream_alive_as_a_stages_stream", |double| {
        // Drop errors are the process's: those of a test before this one are not this test's.
        let _ = ppnrt::take_drop_errors();
        let engine = Engine::new(0).unwrap();
        let elsewhere = Engine::new(1).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let theirs = ctx.new_stream().unwrap();
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt =
            PpNRt::with_stage_streams(PpConfig::new(2), &engine, &[None, Some(Arc::clone(engine_stream.stream()))])
                .unwrap();
        let destroyed = double.calls("cuStreamDestroy_v2");
        drop(engine_stream);
        drop(theirs);
        assert_eq!(
            double.calls("cuStreamDestroy_v2"),
            destroyed,
            "cudarc destroyed its stream while stage 1 of a runtime runs on it"
        );
        let sent = values(7);
        let x = engine.htod(&sent).unwrap();
        let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &x, N)).unwrap();
        let received = {
            let _stage = rt.enter(1).unwrap();
            let y = rt.rx::<u32>(0, slot, N).unwrap();
            engine.dtoh(&y).unwrap()
        };
        assert_eq!(received, sent, "stage 1, on cudarc's stream");
        set_current(elsewhere.context().raw());
        drop(rt);
        assert!(double.calls("cuStreamDestroy_v2") > destroyed, "cudarc's stream was destroyed with the runtime");
        assert_eq!(current(), elsewhere.context().raw(), "cudarc's drop of its stream left its context current");
        drop(ctx);
        set_current(std::ptr::null_mut());
        let drop_errors = ppnrt::take_drop_errors();
        assert!(drop_errors.is_empty(), "{drop_errors:?}");
    });
}

/// Every call into cudarc leaves the thread's current context as it was (none, or another
/// device's), through the crate's context rule; inside `bound_unchecked` of device 1, a lend on
/// device 0's cudarc stream leaves the scope right: the crate's next calls for device 1 land in
/// device 1's context.
#[test]
fn cudarc_calls_leave_the_callers_context_and_call_scope_as_they_were() {
    with_double("cudarc_calls_leave_the_callers_context_and_call_scope_as_they_were", |_| {
        let engine = Engine::new(0).unwrap();
        let elsewhere = Engine::new(1).unwrap();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let theirs = ctx.new_stream().unwrap();
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &engine).unwrap();
        let x = theirs.clone_htod(&values(1)).unwrap();
        let mut y = theirs.alloc_zeros::<u32>(N).unwrap();
        for before in [std::ptr::null_mut(), elsewhere.context().raw()] {
            set_current(before);
            assert_eq!(engine_stream.read(&x, |view| view.len()).unwrap(), N);
            assert_eq!(current(), before, "a read lend left cudarc's context current");
            engine_stream.write(&mut y, |view| assert_eq!(view.len(), N)).unwrap();
            assert_eq!(current(), before, "a write lend left cudarc's context current");
            let slot =
                rt.enter(0).and_then(|_stage| engine_stream.read(&x, |view| rt.tx(0, &view, N)).unwrap()).unwrap();
            set_current(before);
            let mut received = rt.enter(1).and_then(|_stage| rt.rx_in_place::<u32>(0, slot, N)).unwrap();
            engine_stream.received_view(&mut received, |view| assert_eq!(view.len(), N)).unwrap();
            assert_eq!(current(), before, "a received view left cudarc's context current");
            drop(received);
        }
        set_current(std::ptr::null_mut());
        // SAFETY: nothing in the scope changes the current context but this crate (cudarc's
        // calls are the interop's, made under the crate's context rule).
        let filled = unsafe {
            elsewhere.context().bound_unchecked(|| {
                engine_stream.read(&x, |view| view.len()).unwrap();
                engine_stream.write(&mut y, |view| view.len()).unwrap();
                let mut there = elsewhere.alloc::<u32>(64).unwrap();
                elsewhere.fill_u32(&mut there, 0x5eed).unwrap();
                elsewhere.dtoh(&there).unwrap()
            })
        }
        .unwrap();
        assert_eq!(filled, vec![0x5eed; 64], "device 1's work, in its own context");
        assert_eq!(current(), std::ptr::null_mut());
        let errors = ppnrt::take_drop_errors();
        assert!(errors.is_empty(), "{errors:?}");
    });
}

/// A cudarc buffer of another device than the stream's is refused, naming both devices, and the
/// closure does not run.
#[test]
fn a_buffer_of_another_device_is_refused() {
    with_double("a_buffer_of_another_device_is_refused", |_| {
        let engine = Engine::new(0).unwrap();
        let theirs = cudarc::driver::CudaContext::new(0).unwrap().new_stream().unwrap();
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let other = cudarc::driver::CudaContext::new(1).unwrap().new_stream().unwrap();
        let mut there = other.alloc_zeros::<u32>(N).unwrap();
        let refused = engine_stream.read(&there, |_| unreachable!("not lent")).unwrap_err();
        assert!(matches!(refused, ppnrt::CudaError::WrongDevice { expected: 0, found: 1, .. }), "{refused}");
        let refused = engine_stream.write(&mut there, |_| unreachable!("not lent")).unwrap_err();
        assert!(matches!(refused, ppnrt::CudaError::WrongDevice { expected: 0, found: 1, .. }), "{refused}");
    });
}

/// No stream capture may take a lent buffer's memory (the graph would launch on it after the
/// lend, when cudarc may have freed it): the copy is refused and the capture ends in error; the
/// same copy outside a capture goes through.
#[test]
fn a_lent_buffer_cannot_be_captured_into_a_graph() {
    with_double("a_lent_buffer_cannot_be_captured_into_a_graph", |_| {
        let engine = Engine::new(0).unwrap();
        let theirs = cudarc::driver::CudaContext::new(0).unwrap().new_stream().unwrap();
        let engine_stream = EngineStream::new(&engine, &theirs).unwrap();
        let x = theirs.clone_htod(&values(3)).unwrap();
        let stream = engine.stream().unwrap();
        let mut y = engine.alloc::<u32>(N).unwrap();
        let (copied, ended) = engine_stream
            .read(&x, |view| {
                let capture = stream.begin_capture(ppnrt::CaptureMode::ThreadLocal).unwrap();
                let copied = stream.memcpy_dtod(&view, &mut y);
                (copied, capture.end())
            })
            .unwrap();
        assert!(
            matches!(copied, Err(ppnrt::CudaError::Capture(ppnrt::CaptureError::IllegalCall { .. }))),
            "{copied:?}"
        );
        assert!(ended.is_err(), "a capture that was refused a lent buffer ended with a graph");
        engine_stream.read(&x, |view| stream.memcpy_dtod(&view, &mut y)).unwrap().unwrap();
        assert_eq!(engine.dtoh(&y).unwrap(), values(3));
    });
}
