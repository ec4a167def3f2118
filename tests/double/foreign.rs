//! An engine's own device memory through the crate, zero copy (`CudaSlice::from_foreign`): memory
//! the engine allocated and orders on a stream of its own, written there by the engine's own
//! (raw driver) work, sent through a two-stage pipeline on the crate's stage streams, and written
//! by the crate and read back by the engine's own work after the slice is dropped. Both ways the
//! crate orders itself with the engine's stream and the engine's stream with the crate, with no
//! join in the engine's code; each direction also runs with the ordering broken on purpose
//! (the slice made without the engine's pending write, and the engine reading before the drop),
//! which gives wrong values: the test can fail. And a kernel parameter of the caller's whose code
//! switches contexts cannot make a launch skip the rebinding of its context.
//!
//! Through the CUDA driver double, which runs queued work only when something synchronises and
//! then only what that needs, so a missing wait shows up as a wrong value; on a GPU machine the
//! gate runs it the same way (the double is loaded by the test).

use crate::{double, raw_driver};

use std::sync::Arc;

use double::with_double;
use ppnrt::{CudaSlice, CudaStream, Engine, PpConfig, PpNRt, sys};
use raw_driver::raw;

const N: usize = 4096;

/// Device memory the engine owns: `cuMemAlloc`, freed by the engine.
struct EngineBuffer(sys::CUdeviceptr);

impl EngineBuffer {
    fn new(engine: &Engine) -> EngineBuffer {
        raw!(cuCtxSetCurrent(engine.context().raw()));
        let mut ptr: sys::CUdeviceptr = 0;
        raw!(cuMemAlloc_v2(&mut ptr, N * 4));
        EngineBuffer(ptr)
    }

    /// The engine's own write on its stream: every element `value`.
    fn fill(&self, stream: &CudaStream, value: u32) {
        raw!(cuMemsetD32Async(self.0, value, N, stream.raw()));
    }

    /// The engine's own read on its stream, waited for.
    fn read(&self, stream: &CudaStream) -> Vec<u32> {
        let mut host = vec![0u32; N];
        raw!(cuMemcpyDtoHAsync_v2(host.as_mut_ptr().cast(), self.0, N * 4, stream.raw()));
        raw!(cuStreamSynchronize(stream.raw()));
        host
    }
}

impl Drop for EngineBuffer {
    fn drop(&mut self) {
        raw!(cuCtxSynchronize());
        raw!(cuMemFree_v2(self.0));
    }
}

#[test]
fn an_engines_own_buffer_goes_through_the_pipeline_ordered_both_ways() {
    with_double("an_engines_own_buffer_goes_through_the_pipeline_ordered_both_ways", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &primary).unwrap();
        let e0 = rt.engine(0, &primary).unwrap().clone();
        let own = CudaStream::new(primary.context()).unwrap();
        for broken in [false, true] {
            // The engine writes its buffer on its stream; the crate sends it from stage 0.
            let buffer = EngineBuffer::new(&primary);
            buffer.fill(&own, 0x5eed_0000 + u32::from(broken));
            let sent = {
                // SAFETY: `buffer` holds N u32, written on `own` only, and outlives the slice and
                // its uses (freed after a full synchronisation); no other slice covers it.
                let foreign = unsafe { CudaSlice::<u32>::from_foreign(buffer.0, N, &own) };
                if broken {
                    // The crate told nothing of the engine's pending write: a slice on another
                    // stream with no mark of it (what adopting without the owner stream does).
                    let unordered = CudaStream::new(primary.context()).unwrap();
                    // SAFETY: as above; the ordering with `own` is left out on purpose.
                    let blind = unsafe { CudaSlice::<u32>::from_foreign(buffer.0, N, &unordered) };
                    drop(foreign);
                    let _stage = rt.enter(0).unwrap();
                    rt.tx(0, &blind, N).unwrap()
                } else {
                    let _stage = rt.enter(0).unwrap();
                    rt.tx(0, &foreign, N).unwrap()
                }
            };
            let received = {
                let _stage = rt.enter(1).unwrap();
                let out = rt.rx::<u32>(0, sent, N).unwrap();
                rt.engine(1, &primary).unwrap().dtoh(&out).unwrap()
            };
            let expected = vec![0x5eed_0000 + u32::from(broken); N];
            if broken {
                assert_ne!(received, expected, "unordered, the send read the buffer before the engine's write");
            } else {
                assert_eq!(received, expected, "the send waited for the engine's write on its stream");
            }
            // The crate writes the engine's buffer; the engine reads it on its stream after the drop.
            let source = e0.htod(&vec![0xc0de_0000 + u32::from(broken); N]).unwrap();
            let stage_stream = Arc::clone(rt.stage_stream(0).unwrap());
            // SAFETY: as above.
            let mut foreign = unsafe { CudaSlice::<u32>::from_foreign(buffer.0, N, &own) };
            stage_stream.memcpy_dtod(&source, &mut foreign).unwrap();
            let seen = if broken {
                // Read before the slice is dropped: nothing orders `own` after the crate's copy.
                let seen = buffer.read(&own);
                drop(foreign);
                seen
            } else {
                drop(foreign);
                buffer.read(&own)
            };
            let written = vec![0xc0de_0000 + u32::from(broken); N];
            if broken {
                assert_ne!(
                    seen, written,
                    "read before the drop, the engine's stream did not wait for the crate's copy"
                );
            } else {
                assert_eq!(seen, written, "the drop made the engine's stream wait for the crate's copy");
            }
            drop(source);
            drop(buffer);
        }
    });
}

/// `rx_into` the engine's own buffer: the step lands there with the boundary's one copy, and the
/// engine's stream reads it after the slice goes; a buffer of another device or of another length
/// is refused before anything is enqueued, and the slot is still there to receive.
#[test]
fn a_step_is_received_into_the_engines_own_buffer() {
    with_double("a_step_is_received_into_the_engines_own_buffer", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::new(2), &primary).unwrap();
        let e0 = rt.engine(0, &primary).unwrap().clone();
        let own = CudaStream::new(primary.context()).unwrap();
        let values: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(40_503) ^ 0xa5a5).collect();
        let x = e0.htod(&values).unwrap();
        let slot = {
            let _stage = rt.enter(0).unwrap();
            rt.tx(0, &x, N).unwrap()
        };
        let buffer = EngineBuffer::new(&primary);
        buffer.fill(&own, 0);
        // Refused, nothing enqueued: a buffer of device 1, and one of another length.
        let other_device = Engine::new(1).unwrap();
        let mut elsewhere = other_device.alloc::<u32>(N).unwrap();
        let refused = rt.rx_into(0, slot, &mut elsewhere).unwrap_err();
        assert!(
            matches!(refused, ppnrt::Error::Cuda(ppnrt::CudaError::WrongDevice { expected: 0, found: 1, .. })),
            "{refused}"
        );
        let mut short = e0.alloc::<u32>(N - 1).unwrap();
        let refused = rt.rx_into(0, slot, &mut short).unwrap_err();
        assert!(matches!(refused, ppnrt::Error::Pipeline(ppnrt::PpError::RxLengthMismatch { .. })), "{refused}");
        {
            // SAFETY: `buffer` holds N u32 on device 0, touched only on `own` while the slice
            // lives, and outlives it; no other slice covers it.
            let mut foreign = unsafe { CudaSlice::<u32>::from_foreign(buffer.0, N, &own) };
            let _stage = rt.enter(1).unwrap();
            rt.rx_into(0, slot, &mut foreign).unwrap();
        }
        assert_eq!(buffer.read(&own), values, "the step, in the engine's buffer, seen on the engine's stream");
    });
}

/// An engine's own stream as a stage's stream: the stage's work and the engine's run in one
/// stream's order; a stream of another device, a list of another length and a stream for no
/// stage of this process are refused when the runtime is built.
#[test]
fn an_engines_stream_serves_as_a_stages_stream() {
    with_double("an_engines_stream_serves_as_a_stages_stream", |_| {
        let primary = Engine::new(0).unwrap();
        let own = CudaStream::new(primary.context()).unwrap();
        let rt = PpNRt::with_stage_streams(PpConfig::new(2), &primary, &[None, Some(Arc::clone(&own))]).unwrap();
        assert!(Arc::ptr_eq(rt.stage_stream(1).unwrap(), &own), "stage 1 runs on the engine's stream");
        assert!(!Arc::ptr_eq(rt.stage_stream(0).unwrap(), &own));
        let values: Vec<u32> = (0..N as u32).map(|i| i ^ 0x3c3c).collect();
        let x = rt.engine(0, &primary).unwrap().htod(&values).unwrap();
        let slot = rt.enter(0).and_then(|_stage| rt.tx(0, &x, N)).unwrap();
        let received = {
            let _stage = rt.enter(1).unwrap();
            let y = rt.rx::<u32>(0, slot, N).unwrap();
            primary.dtoh(&y).unwrap()
        };
        assert_eq!(received, values);
        let elsewhere = CudaStream::new(Engine::new(1).unwrap().context()).unwrap();
        let refused = PpNRt::with_stage_streams(PpConfig::new(2), &primary, &[None, Some(elsewhere)]).err().unwrap();
        assert!(
            matches!(refused, ppnrt::Error::Cuda(ppnrt::CudaError::WrongDevice { expected: 0, found: 1, .. })),
            "{refused}"
        );
        let refused = PpNRt::with_stage_streams(PpConfig::new(2), &primary, &[None]).err().unwrap();
        assert!(matches!(refused, ppnrt::Error::Config(_)), "{refused}");
    });
}

/// A kernel parameter of the caller's own whose code makes another device's context current:
/// launched inside `bound_unchecked` of the stream's context, in a tuple and in a list, the
/// launch still runs in the stream's context (the double refuses stream work of a context that
/// is not current) and puts the scope's context back. Whether a parameter's code is the crate's
/// own is sealed: no implementation of the caller's can claim it and skip the rebinding (the
/// `compile_fail` example on `KernelParam` shows the claim refused).
#[test]
fn a_callers_kernel_parameter_cannot_skip_the_launchs_rebinding() {
    struct Switching {
        to: sys::CUcontext,
    }

    impl ppnrt::KernelParam for Switching {
        type Raw = u64;
        fn raw_param(&self) -> u64 {
            // SAFETY: a live primary context of the double (its engine outlives the launch).
            unsafe { ppnrt::result::context::set_current(self.to) }.unwrap();
            10
        }
    }

    with_double("a_callers_kernel_parameter_cannot_skip_the_launchs_rebinding", |_| {
        let (e0, e1) = (Engine::new(0).unwrap(), Engine::new(1).unwrap());
        let spin = e0.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_spin_ns").unwrap();
        let stream = e0.default_stream();
        let config = ppnrt::LaunchConfig::for_elements(1, 1);
        let other = e1.context().raw();
        let launches = || {
            // SAFETY: ppnrt_spin_ns(uint64_t) touches no memory; one u64 parameter is passed; the
            // parameter's code ends no capture.
            unsafe { stream.launch(&spin, config, (Switching { to: other },)) }.unwrap();
            assert_eq!(ppnrt::result::context::get_current().unwrap(), e0.context().raw());
            let list = ppnrt::KernelArgList::new().arg(Switching { to: other });
            // SAFETY: as above.
            unsafe { stream.launch(&spin, config, list) }.unwrap();
            assert_eq!(ppnrt::result::context::get_current().unwrap(), e0.context().raw());
        };
        // SAFETY: in the scope only this crate and the parameter's code (which the launch's
        // contract lets change the current context) touch the current context.
        unsafe { e0.context().bound_unchecked(launches) }.unwrap();
        stream.synchronize().unwrap();
    });
}
