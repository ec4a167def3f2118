//! Safe launches of the embedded kernels (`kernels/*.cu`): each method checks what the kernel
//! needs (lengths, alignment, device) and launches it through [`CudaStream::launch`] (the SM copy
//! within one device through the same ordering, without the general parameter handling), so its
//! buffers are ordered by the crate's rule. [`Engine`](crate::Engine) holds one set per device.
//! [`HelperKernels`] (the SM copy) and [`ToyModel`] (the toy model's layer) are always there;
//! [`TestKernels`] comes with the `testing` feature.
//!
//! Lifetime: a set holds its modules alive; it belongs to one context. Threading: `Send + Sync`;
//! launches from several threads are independent.

use std::ffi::c_void;
use std::sync::Arc;

use super::context::Context;
use super::enqueue::{ordered, ordered_owned};
use super::launch::{KernelArgs, LaunchConfig};
use super::memory::{CudaView, CudaViewMut, DeviceSlice, DeviceSliceMut};
use super::module::{Function, Module};
use super::ordering::{Owned, Use};
use super::stream::{CudaStream, EnqueueGate};
use crate::cuda_error::{CudaError, Result};
use crate::kernels;

/// The helper kernels of one context: the SM copy, and the copy a failure can cancel that an IPC
/// boundary's sending rank queues behind its wait for a free slot (crate-internal).
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let helpers = engine.helper_kernels()?; // loaded once per engine
/// let x = engine.htod(&[1u8; 4096])?;
/// let mut y = engine.alloc::<u8>(4096)?;
/// let stream = engine.stream()?;
/// helpers.copy_bytes(&stream, x.as_view(), y.as_view_mut())?; // a copy made by the SMs
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct HelperKernels {
    copy_bytes: Function,
    /// `ppnrt_gated_copy_bytes` (see [`Releasable`](super::ipc::Releasable)).
    pub(super) gated_copy: Function,
    /// `ppnrt_gated_signal`.
    pub(super) gated_signal: Function,
    pub(super) max_blocks: u32,
}

/// The test fixtures' kernels of one context: fill, checksum, spin, trap (`testing` feature).
#[cfg(feature = "testing")]
#[derive(Debug)]
pub struct TestKernels {
    fill_pattern: Function,
    fill_u32: Function,
    checksum: Function,
    spin: Function,
    trap: Function,
    max_blocks: u32,
}

/// The toy residual model's layer kernel of one context: a stand-in layer that examples,
/// benchmarks and tests split over stages (see [`Engine::toy_layer`](crate::Engine::toy_layer)).
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let model = ppnrt::safe::ToyModel::load(engine.context(), engine.max_blocks())?;
/// let stream = engine.stream()?;
/// let mut x = engine.htod(&vec![0.5f32; 4096])?;
/// for layer in 0..4 {
///     model.layer(&stream, &mut x, 0, layer)?; // what `engine.toy_layer(&mut x, 0, layer)` does
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ToyModel {
    layer: Function,
    max_blocks: u32,
}

#[cfg(feature = "testing")]
const ONE_THREAD: LaunchConfig = LaunchConfig { grid: (1, 1, 1), block: (1, 1, 1), shared_mem_bytes: 0 };

fn check_device(what: &'static str, stream: &CudaStream, owner: &CudaStream) -> Result<()> {
    if owner.ordinal() == stream.ordinal() {
        Ok(())
    } else {
        Err(CudaError::WrongDevice { what, expected: stream.ordinal(), found: owner.ordinal() })
    }
}

/// [`CudaStream::launch`], kept out of its caller's hot path (a rare case's general launch).
///
/// # Safety
/// As [`CudaStream::launch`].
#[cold]
#[inline(never)]
unsafe fn launch_out_of_line<A: KernelArgs>(
    stream: &Arc<CudaStream>,
    function: &Function,
    config: LaunchConfig,
    args: A,
) -> Result<()> {
    // SAFETY: the caller meets `launch`'s contract.
    unsafe { stream.launch(function, config, args) }
}

impl HelperKernels {
    /// Loads the helper module into `ctx`. `max_blocks` caps the grid of grid-stride kernels.
    ///
    /// # Errors
    /// The module load's error (a driver older than the toolkit that built the PTX cannot load
    /// it: [`DriverError::is_unrunnable_code`](crate::DriverError::is_unrunnable_code)).
    pub fn load(ctx: &Arc<Context>, max_blocks: u32) -> Result<HelperKernels> {
        let module = Module::load_ptx(ctx, "helpers", kernels::HELPERS_PTX)?;
        Ok(HelperKernels {
            copy_bytes: module.function("ppnrt_copy_bytes")?,
            gated_copy: module.function("ppnrt_gated_copy_bytes")?,
            gated_signal: module.function("ppnrt_gated_signal")?,
            max_blocks,
        })
    }

    /// Copies `src` into `dst` with the SMs of `stream`'s device. Memory of another device must be
    /// `cuMemAlloc` memory (peer access is enabled by the launch).
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless the lengths agree; [`CudaError::Misaligned`] unless both
    /// addresses are 16-byte aligned; as [`CudaStream::launch`].
    pub fn copy_bytes(&self, stream: &Arc<CudaStream>, src: CudaView<'_, u8>, dst: CudaViewMut<'_, u8>) -> Result<()> {
        let (src_ptr, dst_ptr) = check_copy_bytes(&src, &dst)?;
        if src.is_empty() {
            return Ok(());
        }
        let bytes = src.len();
        let (n16, tail) = ((bytes / 16) as u64, (bytes % 16) as u64);
        let config = LaunchConfig::for_elements(bytes / 16 + 1, self.max_blocks);
        let device = stream.ordinal();
        if self.copy_bytes.ordinal() != device || src.ordinal() != device || dst.ordinal() != device {
            // Memory of another device (peer access to enable, pool memory to refuse) or a
            // stream of another device (refused): the general launch checks all of it.
            // SAFETY: ppnrt_copy_bytes(uint4* dst, const uint4* src, uint64_t n16, uint64_t
            // tail) copies n16 * 16 + tail = bytes bytes, within both ranges (equal lengths,
            // checked), both 16-byte aligned (checked).
            return unsafe { launch_out_of_line(stream, &self.copy_bytes, config, (dst, src, n16, tail)) };
        }
        // Everything on the stream's device: the launch's own path, with the two buffers ordered
        // by the crate's rule as `CudaStream::launch` orders them.
        let (mut dst_ptr, mut src_ptr, mut n16, mut tail) = (dst_ptr, src_ptr, n16, tail);
        let mut params: [*mut c_void; 4] =
            [(&raw mut dst_ptr).cast(), (&raw mut src_ptr).cast(), (&raw mut n16).cast(), (&raw mut tail).cast()];
        ordered(
            stream,
            [(src.tracked(), Use::Read), (dst.tracked(), Use::Write)],
            #[inline(always)]
            || {
                // SAFETY: the parameters match ppnrt_copy_bytes(uint4* dst, const uint4* src,
                // uint64_t n16, uint64_t tail), which copies n16 * 16 + tail = bytes bytes within
                // both ranges (equal lengths, 16-byte aligned: checked); function, stream and memory
                // are of one device (checked above), the memory is ordered on the stream (by
                // `ordered`, around this call).
                unsafe { stream.launch_ordered(&self.copy_bytes, &config, &mut params) }
            },
        )
    }
}

impl HelperKernels {
    /// [`copy_bytes`](Self::copy_bytes) of which one side is a buffer its owner orders (`owned`,
    /// see [`OwnOrder`](super::ordering::OwnOrder)), the other side ordered by the rule; `gate`
    /// is `stream`'s enqueue gate, held by the caller, which saw the stream not capturing. What
    /// the SMs of `stream`'s device cannot copy (memory of another device, a kernel of another
    /// device, an address not 16-byte aligned, lengths that differ) goes to the copy engine
    /// ([`CudaStream::memcpy_dtod_owned`], which checks the lengths).
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_dtod_owned`].
    #[inline(always)]
    pub(crate) fn copy_bytes_owned(
        &self,
        stream: &Arc<CudaStream>,
        gate: &EnqueueGate<'_>,
        src: CudaView<'_, u8>,
        dst: CudaViewMut<'_, u8>,
        owned: Owned<'_>,
    ) -> Result<()> {
        let device = stream.ordinal();
        let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
        if src.len() != dst.len()
            || (src_ptr | dst_ptr) % 16 != 0
            || self.copy_bytes.ordinal() != device
            || src.ordinal() != device
            || dst.ordinal() != device
        {
            return stream.memcpy_dtod_owned(gate, src, dst, owned);
        }
        if src.is_empty() {
            return Ok(());
        }
        let bytes = src.len();
        let (mut n16, mut tail) = ((bytes / 16) as u64, (bytes % 16) as u64);
        let config = LaunchConfig::for_elements(bytes / 16 + 1, self.max_blocks);
        let (mut dst_ptr, mut src_ptr) = (dst_ptr, src_ptr);
        let mut params: [*mut c_void; 4] =
            [(&raw mut dst_ptr).cast(), (&raw mut src_ptr).cast(), (&raw mut n16).cast(), (&raw mut tail).cast()];
        ordered_owned(
            stream,
            gate,
            src.tracked(),
            dst.tracked(),
            owned,
            #[inline(always)]
            || {
                // SAFETY: the parameters match ppnrt_copy_bytes(uint4* dst, const uint4* src,
                // uint64_t n16, uint64_t tail), which copies n16 * 16 + tail = bytes bytes within
                // both ranges (equal lengths, 16-byte aligned: checked); function, stream and memory
                // are of one device (checked above), the memory is ordered on the stream (the
                // owned side by its events, the other by the rule: `ordered_owned`, around this).
                unsafe { stream.launch_ordered(&self.copy_bytes, &config, &mut params) }
            },
        )
    }
}

#[cfg(feature = "testing")]
impl TestKernels {
    /// Loads the test fixtures' module into `ctx`. `max_blocks` caps the grid of grid-stride
    /// kernels.
    ///
    /// # Errors
    /// The module load's error.
    pub fn load(ctx: &Arc<Context>, max_blocks: u32) -> Result<TestKernels> {
        let module = Module::load_ptx(ctx, "testing", kernels::TESTING_PTX)?;
        Ok(TestKernels {
            fill_pattern: module.function("ppnrt_fill_pattern_u32")?,
            fill_u32: module.function("ppnrt_fill_u32")?,
            checksum: module.function("ppnrt_checksum_u32")?,
            spin: module.function("ppnrt_spin_ns")?,
            trap: module.function("ppnrt_trap")?,
            max_blocks,
        })
    }

    /// Writes [`kernels::pattern`](crate::kernels::pattern)`(seed, i)` into element `i` of `dst`, on `stream`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device than `stream`'s; the driver's error.
    pub fn fill_pattern(&self, stream: &Arc<CudaStream>, dst: &mut impl DeviceSliceMut<u32>, seed: u32) -> Result<()> {
        check_device("fill_pattern", stream, dst.stream())?;
        let config = LaunchConfig::for_elements(dst.len(), self.max_blocks);
        let len = dst.len() as u64;
        // SAFETY: ppnrt_fill_pattern_u32(uint32_t* dst, uint64_t n, uint32_t seed) writes dst[i]
        // for i < n = dst's length, and nothing else.
        unsafe { stream.launch(&self.fill_pattern, config, (dst.as_view_mut(), len, seed)) }
    }

    /// Sets every element of `dst` to `value`, on `stream`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device than `stream`'s; the driver's error.
    pub fn fill_u32(&self, stream: &Arc<CudaStream>, dst: &mut impl DeviceSliceMut<u32>, value: u32) -> Result<()> {
        check_device("fill_u32", stream, dst.stream())?;
        let config = LaunchConfig::for_elements(dst.len(), self.max_blocks);
        let len = dst.len() as u64;
        // SAFETY: ppnrt_fill_u32(uint32_t* dst, uint64_t n, uint32_t value) writes dst[i] for
        // i < n = dst's length, and nothing else.
        unsafe { stream.launch(&self.fill_u32, config, (dst.as_view_mut(), len, value)) }
    }

    /// Adds the [`kernels::checksum`](crate::kernels::checksum) of `src` into `out[0]`, on `stream`.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless `out` has one element; [`CudaError::WrongDevice`] for memory
    /// of another device than `stream`'s; the driver's error.
    pub fn checksum_into(
        &self,
        stream: &Arc<CudaStream>,
        src: &impl DeviceSlice<u32>,
        out: &mut impl DeviceSliceMut<u64>,
    ) -> Result<()> {
        if out.len() != 1 {
            return Err(CudaError::LengthMismatch { what: "checksum_into: out", expected: 1, found: out.len() });
        }
        check_device("checksum_into", stream, src.stream())?;
        check_device("checksum_into", stream, out.stream())?;
        let config = LaunchConfig::for_elements(src.len(), self.max_blocks);
        let len = src.len() as u64;
        // SAFETY: ppnrt_checksum_u32(const uint32_t* src, uint64_t n, unsigned long long* out)
        // reads src[i] for i < n = src's length and adds into out[0] (out has one element).
        unsafe { stream.launch(&self.checksum, config, (src.as_view(), len, out.as_view_mut())) }
    }

    /// Enqueues a kernel that keeps `stream` busy for `ns` nanoseconds (hazard tests widen race
    /// windows with it).
    ///
    /// # Errors
    /// The driver's error.
    pub fn spin(&self, stream: &Arc<CudaStream>, ns: u64) -> Result<()> {
        // SAFETY: ppnrt_spin_ns(uint64_t ns) touches no memory.
        unsafe { stream.launch(&self.spin, ONE_THREAD, (ns,)) }
    }

    /// Launches a kernel that traps: the context becomes unusable and later calls on it return
    /// [`CudaError::ContextUnusable`]. For fault-handling tests; run it in a process you can lose.
    ///
    /// # Errors
    /// The driver's error.
    pub fn trap(&self, stream: &Arc<CudaStream>) -> Result<()> {
        // SAFETY: ppnrt_trap() takes no parameters and touches no memory.
        unsafe { stream.launch(&self.trap, ONE_THREAD, ()) }
    }
}

impl ToyModel {
    /// Loads the toy model's module into `ctx`.
    ///
    /// # Errors
    /// The module load's error.
    pub fn load(ctx: &Arc<Context>, max_blocks: u32) -> Result<ToyModel> {
        let layer = Module::load_ptx(ctx, "toy_model", kernels::TOY_MODEL_PTX)?.function("ppnrt_toy_layer_f32")?;
        Ok(ToyModel { layer, max_blocks })
    }

    /// Applies layer `layer` at decode step `step` to `x`, in place, on `stream`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device than `stream`'s; the driver's error.
    pub fn layer(
        &self,
        stream: &Arc<CudaStream>,
        x: &mut impl DeviceSliceMut<f32>,
        step: u32,
        layer: u32,
    ) -> Result<()> {
        check_device("toy_layer", stream, x.stream())?;
        let config = LaunchConfig::for_elements(x.len(), self.max_blocks);
        let len = x.len() as u64;
        // SAFETY: ppnrt_toy_layer_f32(float* x, uint64_t n, uint32_t step, uint32_t layer)
        // updates x[i] in place for i < n = x's length, and nothing else.
        unsafe { stream.launch(&self.layer, config, (x.as_view_mut(), len, step, layer)) }
    }
}

/// What the SM copy kernel needs of its two ranges (both copies through it check here): equal
/// lengths, both addresses 16-byte aligned.
/// Returns the two addresses.
fn check_copy_bytes(
    src: &CudaView<'_, u8>,
    dst: &CudaViewMut<'_, u8>,
) -> Result<(crate::sys::CUdeviceptr, crate::sys::CUdeviceptr)> {
    if src.len() != dst.len() {
        return Err(CudaError::LengthMismatch { what: "copy_bytes", expected: dst.len(), found: src.len() });
    }
    let (src_ptr, dst_ptr) = (src.device_ptr(), dst.device_ptr());
    if (src_ptr | dst_ptr) % 16 != 0 {
        let address = if src_ptr % 16 != 0 { src_ptr } else { dst_ptr };
        return Err(CudaError::Misaligned { what: "copy_bytes", address, align: 16 });
    }
    Ok((src_ptr, dst_ptr))
}
