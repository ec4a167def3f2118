//! The kernels embedded in the library, and host twins of their hash functions.
//!
//! The PTX comes from `kernels/*.cu` (the committed copies in `kernels/ptx/`, see `build.rs`) and
//! is included here, NUL-terminated for `cuModuleLoadData`. It targets the lowest architecture of
//! the toolkit that built it; the driver JIT-compiles it for the device at load. A module is
//! loaded into a context only when one of its kernels is first used.
//!
//! Every build embeds:
//! - `helpers`: the SM copy kernel ([`Engine::copy_with_sms`](crate::Engine::copy_with_sms)), and
//!   the copy an IPC boundary's sending rank queues behind its wait for a free slot with the signal
//!   after it, which a failure cancels (`ppnrt_gated_copy_bytes`, `ppnrt_gated_signal`).
//! - `toy_model`: the toy residual model's layer ([`Engine::toy_layer`](crate::Engine::toy_layer)),
//!   a stand-in layer for examples and benchmarks: an elementwise, exactly rounded kernel whose
//!   output depends on the decode step and the layer, so that a transfer that delivers a wrong or
//!   stale step changes the result. [`mix32`] is the host twin of its hash; [`pattern`] makes
//!   position-dependent inputs on the host from it.
//!
//! The `testing` feature adds `testing` (fill, checksum, spin, trap: the crate's test fixtures)
//! and `checksum`, the host twin of its checksum; an application's binary carries neither.

/// PTX of `kernels/helpers.cu`: the SM copy kernel, and the IPC sender's copy a failure cancels.
pub const HELPERS_PTX: &str = concat!(include_str!(concat!(env!("OUT_DIR"), "/helpers.ptx")), "\0");

/// PTX of `kernels/testing.cu`: fill, checksum, spin, trap.
#[cfg(feature = "testing")]
pub const TESTING_PTX: &str = concat!(include_str!(concat!(env!("OUT_DIR"), "/testing.ptx")), "\0");

/// PTX of `kernels/toy_model.cu`: the toy residual model's layer (see the [module docs](self)).
pub const TOY_MODEL_PTX: &str = concat!(include_str!(concat!(env!("OUT_DIR"), "/toy_model.ptx")), "\0");

/// The embedded modules, by name.
#[cfg(not(feature = "testing"))]
pub const MODULES: &[(&str, &str)] = &[("helpers", HELPERS_PTX), ("toy_model", TOY_MODEL_PTX)];

/// The embedded modules, by name.
#[cfg(feature = "testing")]
pub const MODULES: &[(&str, &str)] =
    &[("helpers", HELPERS_PTX), ("testing", TESTING_PTX), ("toy_model", TOY_MODEL_PTX)];

/// MurmurHash3's 32-bit finalizer (a bijection that spreads every input bit); twin of
/// `ppnrt_mix32` in `kernels/mix.cuh`, the hash of the toy model's layer.
///
/// ```
/// use ppnrt::kernels::mix32;
/// assert_eq!(mix32(0), 0);
/// assert_ne!(mix32(1), mix32(2));
/// ```
#[inline]
pub const fn mix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// A pseudo-random word for index `i` under `seed`, from [`mix32`]: for making inputs that differ
/// at every position (and, with the `testing` feature, the word `Engine::fill_pattern` writes at
/// index `i`).
///
/// ```
/// use ppnrt::kernels::pattern;
/// // An f32 input in [-0.5, 0.5], different for every element and seed.
/// let input: Vec<f32> = (0..4096).map(|i| pattern(42, i) as f32 / u32::MAX as f32 - 0.5).collect();
/// assert!(input.iter().all(|x| (-0.5..=0.5).contains(x)));
/// assert_ne!(pattern(42, 0), pattern(43, 0));
/// ```
#[inline]
pub const fn pattern(seed: u32, i: u64) -> u32 {
    mix32(seed ^ mix32((i as u32) ^ mix32(((i >> 32) as u32).wrapping_add(0x9e37_79b9))))
}

/// The value `ppnrt_checksum_u32` computes over `words`.
#[cfg(feature = "testing")]
pub fn checksum(words: &[u32]) -> u64 {
    words
        .iter()
        .enumerate()
        .map(|(i, &w)| u64::from(mix32(w.wrapping_add(0x9e37_79b9u32.wrapping_mul(i as u32)))))
        .fold(0u64, u64::wrapping_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_ptx_defines_every_kernel_the_crate_launches() {
        assert!(HELPERS_PTX.contains(".entry ppnrt_copy_bytes("));
        assert!(HELPERS_PTX.contains(".entry ppnrt_gated_copy_bytes("));
        assert!(HELPERS_PTX.contains(".entry ppnrt_gated_signal("));
        assert!(!HELPERS_PTX.contains("ppnrt_trap"), "test fixtures stay out of the always-embedded module");
        assert!(TOY_MODEL_PTX.contains(".entry ppnrt_toy_layer_f32("));
        assert!(MODULES.iter().any(|(name, _)| *name == "toy_model"), "the toy model is embedded in every build");
        for (name, ptx) in MODULES {
            assert!(ptx.ends_with('\0'), "{name} is not NUL-terminated");
            assert_eq!(ptx.matches('\0').count(), 1, "{name} has an inner NUL");
            assert!(ptx.contains(".target sm_"), "{name} has no .target");
        }
    }

    #[test]
    #[cfg(feature = "testing")]
    fn embedded_testing_ptx_defines_every_test_kernel() {
        for name in ["ppnrt_fill_pattern_u32", "ppnrt_fill_u32", "ppnrt_checksum_u32", "ppnrt_spin_ns", "ppnrt_trap"] {
            assert!(TESTING_PTX.contains(&format!(".entry {name}(")), "{name} missing from testing PTX");
        }
    }

    #[test]
    #[cfg(feature = "testing")]
    fn pattern_and_checksum_are_position_sensitive() {
        let words: Vec<u32> = (0..1000).map(|i| pattern(7, i)).collect();
        assert_ne!(pattern(7, 0), pattern(8, 0));
        assert_ne!(pattern(7, 1 << 32), pattern(7, 0));
        let mut swapped = words.clone();
        swapped.swap(10, 11);
        assert_ne!(checksum(&words), checksum(&swapped));
        // mix32 is a bijection on a sample: no collisions among 1000 consecutive inputs.
        let mut seen: Vec<u32> = (0..1000).map(mix32).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 1000);
    }
}
