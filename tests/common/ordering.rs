//! Ordering scenarios written as a user would: a buffer produced on one stream and consumed,
//! overwritten or dropped from another, with no join in user code. `tests/gpu/ordering_on_gpu.rs` runs them
//! on the GPUs present; `tests/double/` through the driver double. Each also has a deliberately
//! broken variant (the consumer gets the buffer as a raw address, which the ordering rule cannot
//! see) that the check must catch.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use ppnrt::kernels::{checksum, pattern};
use ppnrt::{CudaSlice, CudaStream, DeviceSlice, Engine, StreamOverride};

use crate::common::Rng;

/// Whether the consumer is handed the buffer so that the ordering rule sees it (a slice), or as a
/// raw address it cannot see (the broken variant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handoff {
    Ordered,
    RawAddress,
}

/// The checksum kernel for the broken variant (launched with a raw address).
fn raw_checksum(e: &Engine, handoff: Handoff) -> Option<ppnrt::Function> {
    (handoff == Handoff::RawAddress)
        .then(|| e.load_ptx("testing", ppnrt::kernels::TESTING_PTX).unwrap().function("ppnrt_checksum_u32").unwrap())
}

/// The device-side checksum of `x` on `stream`, added into `sum` — through the engine (ordered),
/// or through a launch that passes `x` as a raw address (unordered).
fn checksum_on(
    e: &Engine,
    stream: &Arc<CudaStream>,
    x: &CudaSlice<u32>,
    sum: &mut CudaSlice<u64>,
    raw: Option<&ppnrt::Function>,
) {
    let _on = StreamOverride::new(Arc::clone(stream)).unwrap();
    match raw {
        None => e.checksum_into(x, sum).unwrap(),
        Some(f) => {
            let config = ppnrt::LaunchConfig::for_elements(x.len(), e.max_blocks());
            // SAFETY: ppnrt_checksum_u32(const uint32_t*, uint64_t, unsigned long long*) reads
            // x.len() words at x's address and adds into sum[0]. x is passed as a plain address
            // on purpose: nothing orders the kernel after x's producer (the broken variant).
            unsafe { stream.launch(f, config, (x.device_ptr(), x.len() as u64, &mut *sum)).unwrap() };
        }
    }
}

/// Producer on stream A fills `x` with a fresh pattern each round (after a random delay);
/// consumer on stream B (after its own random delay) checksums it, with no join in between.
/// Returns the rounds whose checksum was wrong.
pub fn produced_on_one_stream_consumed_on_another(e: &Engine, rounds: usize, seed: u64, handoff: Handoff) -> usize {
    let a = CudaStream::new(e.context()).unwrap();
    let b = CudaStream::new(e.context()).unwrap();
    let n = 4096;
    let mut rng = Rng::new(seed);
    let raw = raw_checksum(e, handoff);
    let mut sums = Vec::with_capacity(rounds);
    let mut expected = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let seed = round as u32 ^ 0x1234_5678;
        let mut x = CudaSlice::<u32>::alloc(&a, n).unwrap();
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e.spin(rng.below(40_000)).unwrap();
            e.fill_pattern(&mut x, seed).unwrap();
        }
        let mut sum = CudaSlice::<u64>::alloc(&b, 1).unwrap();
        b.memset_bytes(&mut sum, 0).unwrap();
        {
            let _on_b = StreamOverride::new(Arc::clone(&b)).unwrap();
            e.spin(rng.below(10_000)).unwrap();
        }
        checksum_on(e, &b, &x, &mut sum, raw.as_ref());
        expected.push(checksum(&(0..n as u64).map(|i| pattern(seed, i)).collect::<Vec<_>>()));
        sums.push(sum);
    }
    let got: Vec<u64> = sums.iter().map(|s| b.synchronize().and_then(|()| e.dtoh(s)).unwrap()[0]).collect();
    got.iter().zip(&expected).filter(|(g, x)| g != x).count()
}

/// Across two devices: the producer on device 0's stream A rewrites one of a few buffers each
/// round (after a random delay); the consumer on device 1's stream B (after its own delay) reads
/// it, with no join in user code, and checksums what it read on device 1. So every round is a
/// read after a write and, from the second lap over the buffers on, a write after a read, each
/// across devices. Ordered: the consumer copies the buffer into device 1 memory
/// (`memcpy_dtod`) and checksums the copy. Broken: device 1's checksum kernel reads the buffer
/// over peer access at its raw address, which the ordering rule cannot see (needs peer access;
/// `None` without it). Returns the rounds whose checksum was wrong.
pub fn produced_on_one_device_consumed_on_another(
    e0: &Engine,
    e1: &Engine,
    rounds: usize,
    seed: u64,
    handoff: Handoff,
) -> Option<usize> {
    assert_ne!(e0.ordinal(), e1.ordinal(), "two devices");
    if handoff == Handoff::RawAddress && ppnrt::enable_peer_access(e0.context(), e1.context()).is_err() {
        return None;
    }
    let a = CudaStream::new(e0.context()).unwrap();
    let b = CudaStream::new(e1.context()).unwrap();
    let n = 4096;
    let mut rng = Rng::new(seed);
    let raw = raw_checksum(e1, handoff);
    // Peer-reachable (cuMemAlloc) memory, for the broken variant's direct read.
    let mut buffers: Vec<CudaSlice<u32>> = {
        let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
        (0..4).map(|_| e0.alloc_persistent::<u32>(n).unwrap()).collect()
    };
    let mut sums = Vec::with_capacity(rounds);
    let mut expected = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let seed = round as u32 ^ 0x5eed_0d1e;
        let x = &mut buffers[round % 4];
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e0.spin(rng.below(40_000)).unwrap();
            e0.fill_pattern(x, seed).unwrap();
        }
        let mut sum = CudaSlice::<u64>::alloc(&b, 1).unwrap();
        b.memset_bytes(&mut sum, 0).unwrap();
        {
            let _on_b = StreamOverride::new(Arc::clone(&b)).unwrap();
            e1.spin(rng.below(10_000)).unwrap();
            match &raw {
                None => {
                    let mut copy = e1.alloc::<u32>(n).unwrap();
                    b.memcpy_dtod(&*x, &mut copy).unwrap();
                    e1.checksum_into(&copy, &mut sum).unwrap();
                }
                Some(_) => checksum_on(e1, &b, x, &mut sum, raw.as_ref()),
            }
        }
        expected.push(checksum(&(0..n as u64).map(|i| pattern(seed, i)).collect::<Vec<_>>()));
        sums.push(sum);
    }
    let got: Vec<u64> = sums.iter().map(|s| b.synchronize().and_then(|()| e1.dtoh(s)).unwrap()[0]).collect();
    a.synchronize().unwrap();
    Some(got.iter().zip(&expected).filter(|(g, x)| g != x).count())
}

/// A buffer read on stream B (delayed) is dropped on its owner A right after the read was
/// enqueued, and A allocates and fills a new buffer at once (the pool hands out the freed block):
/// the late reader must still see the old contents. Returns the rounds whose checksum was wrong.
pub fn dropped_on_its_owner_while_read_elsewhere(e: &Engine, rounds: usize, seed: u64, handoff: Handoff) -> usize {
    let a = CudaStream::new(e.context()).unwrap();
    let b = CudaStream::new(e.context()).unwrap();
    let n = 4096;
    let mut rng = Rng::new(seed);
    let raw = raw_checksum(e, handoff);
    let mut bad = 0;
    let mut sums = Vec::new();
    let mut expected = Vec::new();
    for round in 0..rounds {
        let seed = round as u32 ^ 0x0bad_cafe;
        let mut x = CudaSlice::<u32>::alloc(&a, n).unwrap();
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e.fill_pattern(&mut x, seed).unwrap();
        }
        let mut sum = CudaSlice::<u64>::alloc(&b, 1).unwrap();
        b.memset_bytes(&mut sum, 0).unwrap();
        {
            let _on_b = StreamOverride::new(Arc::clone(&b)).unwrap();
            e.spin(20_000 + rng.below(200_000)).unwrap();
        }
        checksum_on(e, &b, &x, &mut sum, raw.as_ref());
        drop(x); // freed on A
        let mut y = CudaSlice::<u32>::alloc(&a, n).unwrap();
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e.fill_u32(&mut y, 0xffff_ffff).unwrap();
        }
        expected.push(checksum(&(0..n as u64).map(|i| pattern(seed, i)).collect::<Vec<_>>()));
        sums.push((sum, y));
        if sums.len() == 64 {
            bad += drain(e, &b, &mut sums, &mut expected);
        }
    }
    bad + drain(e, &b, &mut sums, &mut expected)
}

fn drain(
    e: &Engine,
    b: &Arc<CudaStream>,
    sums: &mut Vec<(CudaSlice<u64>, CudaSlice<u32>)>,
    expected: &mut Vec<u64>,
) -> usize {
    b.synchronize().unwrap();
    let bad = sums.iter().zip(expected.iter()).filter(|((s, _), x)| e.dtoh(s).unwrap()[0] != **x).count();
    sums.clear();
    expected.clear();
    bad
}

/// Work that stays on a buffer's own stream takes the rule's plain path (no lock, nothing
/// recorded); here it must still wait for a read on another stream. The producer on stream A
/// rewrites one buffer each round; the consumer on stream B (after a random delay) checksums it,
/// then A checksums it too, before the next rewrite, with no join in user code: each rewrite on A
/// is a write after B's read, with a read on A in between (which leaves the buffer's last write
/// with no event, but B's read still recorded). Stream A is synchronised first, so a rewrite that
/// did not wait runs before B's read (on the double as on a GPU). Returns the rounds whose
/// checksum (either stream's) was wrong.
pub fn rewritten_on_its_own_stream_after_a_read_elsewhere(e: &Engine, rounds: usize, seed: u64) -> usize {
    let a = CudaStream::new(e.context()).unwrap();
    let b = CudaStream::new(e.context()).unwrap();
    let n = 4096;
    let mut rng = Rng::new(seed);
    let mut x = CudaSlice::<u32>::alloc(&a, n).unwrap();
    let mut sums = Vec::with_capacity(rounds);
    let mut expected = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let seed = round as u32 ^ 0x0bad_cafe;
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e.fill_pattern(&mut x, seed).unwrap();
        }
        let mut sum = CudaSlice::<u64>::alloc(&b, 1).unwrap();
        b.memset_bytes(&mut sum, 0).unwrap();
        {
            let _on_b = StreamOverride::new(Arc::clone(&b)).unwrap();
            e.spin(rng.below(40_000)).unwrap();
        }
        checksum_on(e, &b, &x, &mut sum, None);
        let mut own_sum = CudaSlice::<u64>::alloc(&a, 1).unwrap();
        a.memset_bytes(&mut own_sum, 0).unwrap();
        checksum_on(e, &a, &x, &mut own_sum, None);
        expected.push(checksum(&(0..n as u64).map(|i| pattern(seed, i)).collect::<Vec<_>>()));
        sums.push((sum, own_sum));
    }
    a.synchronize().unwrap();
    let got: Vec<(u64, u64)> = sums
        .iter()
        .map(|(sum, own_sum)| {
            b.synchronize().unwrap();
            (e.dtoh(sum).unwrap()[0], e.dtoh(own_sum).unwrap()[0])
        })
        .collect();
    got.iter().zip(&expected).filter(|((b_sum, a_sum), x)| b_sum != *x || a_sum != *x).count()
}

/// A pinned buffer read on the host (its last write's event then shared with the host wait),
/// written again on the same stream (after a delay) and read on the host again must show the new
/// data: the second write takes the rule's locked path, which makes the next host wait wait for
/// it, not for the event of the write before. Returns the rounds whose host read was stale.
pub fn pinned_rewritten_on_its_own_stream_after_a_host_read(e: &Engine, rounds: usize, seed: u64) -> usize {
    let a = CudaStream::new(e.context()).unwrap();
    let n = 4096;
    let mut rng = Rng::new(seed);
    let mut x = CudaSlice::<u32>::alloc(&a, n).unwrap();
    let mut host = ppnrt::PinnedHostBuffer::<u32>::new(e.context(), n, false).unwrap();
    let mut stale = 0;
    for round in 0..rounds {
        let seed = round as u32 ^ 0x5eed_f00d;
        {
            let _on_a = StreamOverride::new(Arc::clone(&a)).unwrap();
            e.spin(rng.below(40_000)).unwrap();
            e.fill_pattern(&mut x, seed).unwrap();
        }
        a.memcpy_dtoh_pinned(&x, &mut host).unwrap();
        let read = host.as_slice().unwrap();
        if (0..n).any(|i| read[i] != pattern(seed, i as u64)) {
            stale += 1;
        }
    }
    stale
}
