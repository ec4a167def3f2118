//! The kernels of the IPC sending rank's copy that a failure cancels (`ppnrt_gated_copy_bytes`
//! and `ppnrt_gated_signal` of the embedded helper module), launched as the sending rank launches
//! them (a thread per 16-byte word where both addresses are 16-byte aligned, else a thread per
//! byte; the grid capped at the engine's blocks), with the gate in page-locked host memory that
//! the host stores into, as the sending rank's gate words are. Through the driver double they
//! check its C twins; on a GPU, the kernels themselves.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ppnrt::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceSlice, Engine, Function, LaunchConfig, Module, PinnedHostBuffer,
};

/// The gate's value that says the wait was released (the crate's `RELEASED`).
pub const RELEASED: u64 = 1 << 62;

/// The two kernels, loaded from the embedded helper module.
pub struct GatedKernels {
    copy: Function,
    signal: Function,
    max_blocks: u32,
}

impl GatedKernels {
    pub fn load(engine: &Engine) -> GatedKernels {
        let module = Module::load_ptx(engine.context(), "helpers", ppnrt::kernels::HELPERS_PTX).unwrap();
        GatedKernels {
            copy: module.function("ppnrt_gated_copy_bytes").unwrap(),
            signal: module.function("ppnrt_gated_signal").unwrap(),
            max_blocks: engine.max_blocks(),
        }
    }

    /// The sending rank's configuration of the copy of `bytes` bytes between `dst` and `src`.
    fn config(&self, dst: u64, src: u64, bytes: u64) -> LaunchConfig {
        let elements = if (dst | src) % 16 == 0 { bytes / 16 + 1 } else { bytes };
        LaunchConfig::for_elements(elements as usize, self.max_blocks)
    }

    /// On `stream`: the copy of `src` into `dst` under `gate` (a device address of a host word)
    /// with `config` (`None`: the sending rank's), then the signal of `value` into `signal`.
    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        (dst, src): (CudaViewMut<'_, u8>, CudaView<'_, u8>),
        gate: u64,
        config: Option<LaunchConfig>,
        (signal, value): (CudaViewMut<'_, u64>, u64),
    ) {
        assert_eq!(dst.len(), src.len());
        let bytes = src.len() as u64;
        let config = config.unwrap_or_else(|| self.config(dst.device_ptr(), src.device_ptr(), bytes));
        // SAFETY: ppnrt_gated_copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t bytes, const
        // uint64_t* gate, uint64_t released) copies at most `bytes` bytes within both views (equal
        // lengths) and reads the gate, a live word of page-locked host memory (the caller's,
        // ordered by its synchronisation: passed as a plain address).
        unsafe { stream.launch(&self.copy, config, (dst, src, bytes, gate, RELEASED)) }.unwrap();
        let one = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: ppnrt_gated_signal(uint64_t* signal, uint64_t value, const uint64_t* gate,
        // uint64_t released) writes signal[0] (a view of one word) and reads the gate, as above.
        unsafe { stream.launch(&self.signal, one, (signal, value, gate, RELEASED)) }.unwrap();
    }
}

/// A gate word in page-locked host memory, reached by the device at its host address (unified
/// addressing) and stored into by the host with atomics.
pub struct Gate {
    word: PinnedHostBuffer<u64>,
}

impl Gate {
    pub fn new(engine: &Engine) -> Gate {
        Gate { word: PinnedHostBuffer::new(engine.context(), 1, false).unwrap() }
    }

    fn atomic(&mut self) -> &AtomicU64 {
        // SAFETY: the buffer's one word is page-aligned and lives as long as `self`; the host
        // reaches it only through this atomic, the device only by reads.
        unsafe { AtomicU64::from_ptr(self.word.as_mut_ptr()) }
    }

    pub fn store(&mut self, value: u64) {
        self.atomic().store(value, Ordering::SeqCst);
    }

    pub fn address(&mut self) -> u64 {
        self.word.as_mut_ptr() as u64
    }
}

fn bytes_pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u64).map(|i| (ppnrt::kernels::pattern(seed, i) % 255 + 1) as u8).collect()
}

/// Every alignment of source and destination (16-byte words, 8-, 2-, 1-byte offsets: the element
/// types of 16, 8, 2 and 1 byte(s) at any index) and sizes around each word boundary, up to one
/// that takes the grid two strides of 16-byte words: with the gate below the release value (a wait
/// met by a freed slot) exactly the bytes asked for are copied and the signal is the value asked
/// for; with the gate at the release value nothing is written and the signal says "released".
pub fn the_gated_copy_copies_every_alignment_and_writes_nothing_once_released(engine: &Engine) {
    const GUARD: u8 = 0xee;
    let kernels = GatedKernels::load(engine);
    let strides = 2 * 16 * 256 * kernels.max_blocks as usize + 19;
    let stream = engine.stream().unwrap();
    let mut gate = Gate::new(engine);
    let host_src = bytes_pattern(strides + 64, 11);
    let mut src = CudaSlice::<u8>::alloc(&stream, strides + 64).unwrap();
    stream.memcpy_htod(&host_src, &mut src).unwrap();
    let mut dst = CudaSlice::<u8>::alloc(&stream, strides + 64).unwrap();
    let mut signal = CudaSlice::<u64>::alloc(&stream, 1).unwrap();
    let offsets = [(0, 0), (16, 32), (8, 24), (1, 0), (0, 1), (3, 5), (2, 6), (15, 15)];
    let sizes = [1, 2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 4095, 4096 + 9, strides];
    for (src_at, dst_at) in offsets {
        for bytes in sizes {
            for released in [false, true] {
                let case = format!("{bytes} byte(s) from offset {src_at} to offset {dst_at}, released: {released}");
                // The bytes asked for and 32 guard bytes on each side.
                let window = dst_at + bytes + 32;
                gate.store(if released { RELEASED } else { 5 });
                stream.memset_bytes(&mut dst.slice_mut(..window).unwrap(), GUARD).unwrap();
                stream.memset_bytes(&mut signal, 0).unwrap();
                let (to, from) =
                    (dst.slice_mut(dst_at..dst_at + bytes).unwrap(), src.slice(src_at..src_at + bytes).unwrap());
                kernels.launch(&stream, (to, from), gate.address(), None, (signal.as_view_mut(), 6));
                let mut got = vec![0u8; window];
                stream.memcpy_dtoh(&dst.slice(..window).unwrap(), &mut got).unwrap();
                let mut said = [0u64];
                stream.memcpy_dtoh(&signal, &mut said).unwrap();
                let mut expected = vec![GUARD; window];
                if !released {
                    expected[dst_at..dst_at + bytes].copy_from_slice(&host_src[src_at..src_at + bytes]);
                }
                if got != expected {
                    let at = got.iter().zip(&expected).position(|(got, expected)| got != expected);
                    panic!("{case}: the destination differs first at byte {at:?}");
                }
                assert_eq!(said[0], if released { RELEASED } else { 6 }, "{case}: the signal");
            }
        }
    }
}

/// What the runs of [`a_release_during_the_copy_never_leaves_a_part_signalled_filled`] saw.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RaceOutcomes {
    /// Copied whole, signalled filled.
    pub whole_filled: usize,
    /// Copied whole, signalled released (the release came after every block looked).
    pub whole_released: usize,
    /// Copied in part, signalled released (the release came while the blocks looked).
    pub part_released: usize,
    /// Nothing copied, signalled released.
    pub none_released: usize,
}

/// A release that lands while a copy of `mib` MiB runs (the host stores the release value into
/// the gate at a varying delay after the launch, up to 150 µs; the copy has a block per 4 KiB, far
/// more blocks than run at once, so its blocks look at the gate over its whole run): whatever
/// part was copied, the signal says "filled" only where every byte was copied. The signal reads
/// the gate after every block of the copy; it must never see an older gate than a block saw.
/// Returns what the runs saw (on a GPU, `part_released` says whether the race was met).
pub fn a_release_during_the_copy_never_leaves_a_part_signalled_filled(
    engine: &Engine,
    mib: usize,
    runs: usize,
) -> RaceOutcomes {
    let bytes = mib << 20;
    let kernels = GatedKernels::load(engine);
    let stream = engine.stream().unwrap();
    let mut gate = Gate::new(engine);
    let host_src = bytes_pattern(bytes, 12);
    let mut src = CudaSlice::<u8>::alloc(&stream, bytes).unwrap();
    stream.memcpy_htod(&host_src, &mut src).unwrap();
    let mut dst = CudaSlice::<u8>::alloc(&stream, bytes).unwrap();
    let mut signal = CudaSlice::<u64>::alloc(&stream, 1).unwrap();
    // A block per 4 KiB (a thread per 16-byte word): far more blocks than are resident at once.
    let config = LaunchConfig { grid: ((bytes / 4096) as u32, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 };
    let mut outcomes = RaceOutcomes::default();
    let mut rng = crate::common::Rng::new(0x6a7e);
    let mut got = vec![0u8; bytes];
    for run in 0..runs {
        gate.store(7);
        stream.memset_bytes(&mut dst, 0).unwrap();
        stream.memset_bytes(&mut signal, 0).unwrap();
        stream.synchronize().unwrap();
        let delay = std::time::Duration::from_nanos(rng.below(150_000));
        let copy = (dst.as_view_mut(), src.as_view());
        kernels.launch(&stream, copy, gate.address(), Some(config), (signal.as_view_mut(), 8));
        let start = std::time::Instant::now();
        while start.elapsed() < delay {
            std::hint::spin_loop();
        }
        gate.store(RELEASED);
        stream.memcpy_dtoh(&dst, &mut got).unwrap();
        let mut said = [0u64];
        stream.memcpy_dtoh(&signal, &mut said).unwrap();
        let copied = got.iter().zip(&host_src).filter(|(got, src)| got == src).count();
        match (copied == bytes, said[0]) {
            (true, 8) => outcomes.whole_filled += 1,
            (true, RELEASED) => outcomes.whole_released += 1,
            (false, RELEASED) if copied == 0 => outcomes.none_released += 1,
            (false, RELEASED) => outcomes.part_released += 1,
            (whole, said) => panic!(
                "run {run} (release after {delay:?}): {copied} of {bytes} bytes copied (whole: {whole}), signalled {said:#x}"
            ),
        }
    }
    outcomes
}
