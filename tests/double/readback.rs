//! Deferred readback through the double: the readback ring's pinned buffers ordered by their own
//! event, the given buffer's state handed to the readback stream, and a pinned buffer's values
//! read only after the copy into it.

use super::*;

/// A pinned buffer's bytes read as values (`as_slice_of`) wait for the copy into them: the double
/// runs the copy only when something waits for it, so values read without the wait would be the
/// buffer's zeros.
#[test]
fn pinned_bytes_read_as_values_wait_for_the_copy_into_them() {
    with_double("pinned_bytes_read_as_values_wait_for_the_copy_into_them", |_| {
        let e = Engine::new(0).unwrap();
        let stream = e.stream().unwrap();
        let words: Vec<u32> = (0..1024u64).map(|i| ppnrt::kernels::pattern(9, i)).collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let source = e.htod(&bytes).unwrap();
        let mut host = PinnedHostBuffer::<u8>::new(e.context(), bytes.len(), false).unwrap();
        stream.memcpy_dtoh_pinned(&source, &mut host).unwrap();
        assert_eq!(host.as_slice_of::<u32>(words.len()).unwrap(), &words[..]);
    });
}

/// A readback of a buffer given up (its only handle) reads the step's write, however late the
/// stage stream runs it, and frees the buffer only after the copy: the step's write is held back
/// behind a spin on the stage stream, the readback stream runs first, and the buffer is dropped
/// with the readback before either ran. No freed memory is touched, and the values are the
/// step's, readback after readback into the ring's reused buffers.
#[test]
fn a_given_up_buffer_is_read_after_its_step_and_freed_after_the_copy() {
    with_double("a_given_up_buffer_is_read_after_its_step_and_freed_after_the_copy", |double| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let e = rt.engine(1, &primary).unwrap().clone();
        let n = 2048;
        for seed in 0..6u32 {
            let logits = {
                let _last = rt.enter(1).unwrap();
                let mut logits = e.alloc::<u32>(n).unwrap();
                e.spin(200_000).unwrap();
                e.fill_pattern(&mut logits, seed).unwrap();
                logits
            };
            let pending = rt.readback(logits).unwrap();
            // Dropped unread every other step: the buffer goes back to the ring with its copy
            // still queued, and the next readback's copy into it comes after.
            if seed % 2 == 1 {
                let expected: Vec<u32> = (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect();
                assert_eq!(pending.wait().unwrap(), &expected[..], "step {seed}");
            }
        }
        rt.synchronize().unwrap();
        double.flush();
        assert_eq!(double.violations(), 0, "{}", double.last_violation());
    });
}

/// A readback made while the stage stream that wrote its buffer is being captured waits for that
/// write through the capture's own event: an event recorded on the stage stream now would land in
/// the graph, not on the stream, and the copy (run first by the double) would read the buffer
/// before the write.
#[test]
fn a_readback_while_its_writer_is_captured_waits_for_the_write() {
    with_double("a_readback_while_its_writer_is_captured_waits_for_the_write", |_| {
        let primary = Engine::new(0).unwrap();
        let rt = PpNRt::new(PpConfig::with_devices(&[0, 1]), &primary).unwrap();
        let e = rt.engine(1, &primary).unwrap().clone();
        let stage = rt.stage_stream(1).unwrap().clone();
        let n = 2048;
        for seed in [5u32, 6] {
            let logits = {
                let _last = rt.enter(1).unwrap();
                let mut logits = e.alloc::<u32>(n).unwrap();
                e.fill_pattern(&mut logits, seed).unwrap();
                logits
            };
            let capture = stage.begin_capture(ppnrt::CaptureMode::Relaxed).unwrap();
            let pending = rt.readback(logits).unwrap();
            drop(capture.end());
            let expected: Vec<u32> = (0..n as u64).map(|i| ppnrt::kernels::pattern(seed, i)).collect();
            assert_eq!(pending.wait().unwrap(), &expected[..], "step {seed}");
        }
        rt.synchronize().unwrap();
    });
}
