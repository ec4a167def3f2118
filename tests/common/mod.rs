//! Helpers shared by the integration tests of every tier: what a GPU test needs ([`needs`]),
//! visible skips, and a small deterministic random generator (no dependency needed).
#![allow(dead_code, unreachable_pub)]

pub mod needs;

use std::sync::Arc;

use ppnrt::{CudaStream, Engine, StreamOverride};

/// Writes a line to the process's stderr directly: the test harness captures `eprintln!` of
/// passing tests, and a skip must be visible.
pub fn say(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A port on 127.0.0.1 for a rendezvous that rank 0 binds later. A port the system hands out
/// for `bind("127.0.0.1:0")` and the caller closes again can be taken before rank 0 binds it:
/// every connection another test opens meanwhile (NCCL's own sockets included) picks its local
/// port from the same ephemeral range, and so does every other `bind(..:0)`. This one is picked
/// below that range (`/proc/sys/net/ipv4/ip_local_port_range`), where only an explicit bind
/// takes a port: each call of a process steps through a permutation of 8,192 ports from a start
/// of its own, and returns the first one it could bind.
pub fn rendezvous_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static CALLS: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    // 8,192 ports (a power of two, so an odd stride visits each once) above the reserved 1,024.
    const SPAN: u32 = 8_192;
    if ephemeral_low >= 1_024 + SPAN {
        let base = ephemeral_low - SPAN;
        let start = std::process::id().wrapping_mul(2_654_435_761);
        for _ in 0..SPAN {
            let call = CALLS.fetch_add(1, Ordering::Relaxed);
            let port = base + start.wrapping_add(call.wrapping_mul(7_919)) % SPAN;
            if std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
                return port as u16;
            }
        }
    }
    // No room below the range (an unusual system setting): one the system hands out.
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Whether the tests run through the CUDA driver double (`tests/driver_double`), which names its
/// devices so: queued work runs there when waited for, taking no time, so races and overlaps a
/// test needs from a GPU do not happen.
pub fn on_driver_double(engine: &Engine) -> bool {
    engine.device().name().is_ok_and(|name| name.contains("driver double"))
}

/// Whether the test runs under compute-sanitizer (the GPU gate sets `PPNRT_SANITIZER`): the tool
/// serialises streams and reports deliberate API errors, so races a test provokes cannot happen
/// and deliberate misuse would count as findings.
pub fn under_sanitizer() -> bool {
    std::env::var_os("PPNRT_SANITIZER").is_some()
}

/// Occupies `stream` for `ns` nanoseconds of device time (`engine`'s spin kernel): a delay that
/// makes a missing wait show up as a wrong value.
pub fn spin_on(engine: &Engine, stream: &Arc<CudaStream>, ns: u64) {
    let _on = StreamOverride::new(Arc::clone(stream)).unwrap();
    engine.spin(ns).unwrap();
}

/// SplitMix64: deterministic, seedable, good enough for test data and delays.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn next_u32(&mut self) -> u32 {
        (self.next_u64() >> 32) as u32
    }

    /// Uniform in `0..bound` (bound > 0).
    pub fn below(&mut self, bound: u64) -> u64 {
        self.next_u64() % bound
    }

    /// Uniform in [-1, 1).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    pub fn vec_u32(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.next_u32()).collect()
    }

    pub fn vec_f32(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// A word no test payload is likely to equal, for poisoning outputs.
pub const POISON: u32 = 0xdead_beef;
