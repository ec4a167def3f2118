//! `Engine`: one device's execution context.
//!
//! An engine owns the device's primary context (retained), a default stream, and the embedded
//! kernels (the helper copy and the toy model's layer, each loaded on first use). Its allocations, copies and launches run on the calling
//! thread's ambient stream when a [`StreamOverride`](crate::StreamOverride) is active, else on the
//! default stream; an ambient stream of another device is an error, never a silent fallback.
//! `Engine` is cheap to clone and may be used from many threads at once.

use std::sync::{Arc, Mutex, OnceLock};

use crate::cuda_error::{CudaError, Result};
#[cfg(feature = "testing")]
use crate::safe::TestKernels;
use crate::safe::{
    Context, CudaSlice, CudaStream, Device, DeviceRepr, DeviceSlice, DeviceSliceMut, HelperKernels, Module, ToyModel,
    with_ambient_stream,
};

/// The value in `cell`, made by `load` on first use. A failed load is returned and not kept: the
/// next call tries again. `lock` serialises loads.
#[inline]
fn load_once<'a, T>(cell: &'a OnceLock<T>, lock: &Mutex<()>, load: impl FnOnce() -> Result<T>) -> Result<&'a T> {
    match cell.get() {
        Some(value) => Ok(value),
        None => load_first(cell, lock, load),
    }
}

/// [`load_once`] before the value is there: loads it under the lock, once.
#[cold]
fn load_first<'a, T>(cell: &'a OnceLock<T>, lock: &Mutex<()>, load: impl FnOnce() -> Result<T>) -> Result<&'a T> {
    let _loading = lock.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(value) = cell.get() {
        return Ok(value);
    }
    let value = load()?;
    Ok(cell.get_or_init(|| value))
}

/// One device's execution context. See the [module docs](self).
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let x = engine.htod(&[1.0f32, 2.0, 3.0])?;
/// let mut y = engine.alloc_zeroed::<f32>(3)?;
/// engine.dtod(&x, &mut y)?;
/// assert_eq!(engine.dtoh(&y)?, [1.0, 2.0, 3.0]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

#[derive(Debug)]
struct EngineInner {
    device: Device,
    ctx: Arc<Context>,
    stream: Arc<CudaStream>,
    max_blocks: u32,
    modules: Modules,
}

/// The engine's modules, each loaded on first use.
#[derive(Debug, Default)]
struct Modules {
    /// Loaded on first use; a failed load (say, out of memory) is not kept, the next use retries.
    helpers: OnceLock<HelperKernels>,
    /// The test kernels (`testing` feature), loaded on first use as `helpers` is.
    #[cfg(feature = "testing")]
    test_kernels: OnceLock<TestKernels>,
    /// The toy model's layer ([`Engine::toy_layer`]), loaded on first use as `helpers` is.
    toy_model: OnceLock<ToyModel>,
    /// Serialises the loads above, so that concurrent first uses load each module once.
    loading: Mutex<()>,
}

impl Engine {
    /// The engine of device `ordinal`.
    ///
    /// # Errors
    /// [`CudaError::DeviceOutOfRange`]; the loader's or driver's error.
    pub fn new(ordinal: i32) -> Result<Engine> {
        let device = Device::get(ordinal)?;
        let ctx = Context::primary(&device)?;
        let stream = CudaStream::new(&ctx)?;
        let max_blocks = u32::try_from(device.multiprocessor_count()?.max(1) * 8).unwrap_or(1024);
        Ok(Engine { inner: Arc::new(EngineInner { device, ctx, stream, max_blocks, modules: Modules::default() }) })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.inner.device.ordinal()
    }

    /// The device's primary context.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner.ctx
    }

    /// The engine's own stream, used when no ambient stream is set.
    pub fn default_stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The stream this thread's operations run on: the ambient stream if one is set, else the
    /// default stream.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] when the ambient stream belongs to another device.
    #[inline]
    pub fn stream(&self) -> Result<Arc<CudaStream>> {
        self.on_stream(|stream| Ok(Arc::clone(stream)))
    }

    /// Runs `f` on the stream this thread's operations run on (see [`stream`](Self::stream)),
    /// borrowed: an operation pays no reference count for it. `f` runs the crate's own code
    /// only (see [`with_ambient_stream`]).
    #[inline]
    fn on_stream<R>(&self, f: impl FnOnce(&Arc<CudaStream>) -> Result<R>) -> Result<R> {
        with_ambient_stream(|ambient| match ambient? {
            None => f(&self.inner.stream),
            Some(stream) if stream.ordinal() == self.ordinal() => f(stream),
            Some(stream) => Err(CudaError::WrongDevice {
                what: "Engine: the ambient stream belongs to another device than the engine",
                expected: self.ordinal(),
                found: stream.ordinal(),
            }),
        })
    }

    /// A block-count cap for grid-stride kernels (8 blocks per multiprocessor).
    pub fn max_blocks(&self) -> u32 {
        self.inner.max_blocks
    }

    /// `len` elements from the memory pool, owned by the current stream; contents unspecified.
    ///
    /// # Errors
    /// As [`CudaSlice::alloc`] and [`stream`](Self::stream).
    pub fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.on_stream(|stream| CudaSlice::alloc(stream, len))
    }

    /// `len` elements from the memory pool, zeroed on the current stream.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn alloc_zeroed<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.on_stream(|stream| {
            let mut slice = CudaSlice::alloc(stream, len)?;
            stream.memset_bytes(&mut slice, 0)?;
            Ok(slice)
        })
    }

    /// `len` elements with `cuMemAlloc` (reachable by peers), owned by the current stream.
    ///
    /// # Errors
    /// As [`CudaSlice::alloc_persistent`].
    pub fn alloc_persistent<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.on_stream(|stream| CudaSlice::alloc_persistent(stream, len))
    }

    /// A new device array holding `src`, copied on the current stream.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc) and [`CudaStream::memcpy_htod`].
    pub fn htod<T: DeviceRepr>(&self, src: &[T]) -> Result<CudaSlice<T>> {
        self.on_stream(|stream| {
            let mut dst = CudaSlice::alloc(stream, src.len())?;
            stream.memcpy_htod(src, &mut dst)?;
            Ok(dst)
        })
    }

    /// Copies `src` into `dst` on the current stream, or, for memory of another device, on the
    /// stream that owns `dst` (host-device copies run on the memory's own device).
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_htod`].
    pub fn htod_into<T: DeviceRepr, D: DeviceSliceMut<T>>(&self, src: &[T], dst: &mut D) -> Result<()> {
        match self.owner_elsewhere(dst) {
            Some(owner) => owner.memcpy_htod(src, dst),
            None => self.on_stream(|stream| stream.memcpy_htod(src, dst)),
        }
    }

    /// The contents of `src`, copied on the current stream, or, for memory of another device, on
    /// the stream that owns `src`; waits for it.
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_dtoh`].
    pub fn dtoh<T: DeviceRepr + Default, S: DeviceSlice<T>>(&self, src: &S) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len()];
        match self.owner_elsewhere(src) {
            Some(owner) => owner.memcpy_dtoh(src, &mut out)?,
            None => self.on_stream(|stream| stream.memcpy_dtoh(src, &mut out))?,
        }
        Ok(out)
    }

    /// The stream that owns `memory` when it is memory of another device than this engine's (a
    /// host-device copy runs on the memory's own device), else `None`: the current stream's.
    fn owner_elsewhere<T: DeviceRepr, S: DeviceSlice<T>>(&self, memory: &S) -> Option<Arc<CudaStream>> {
        (memory.ordinal() != self.ordinal()).then(|| Arc::clone(memory.stream()))
    }

    /// Copies `src` into `dst` (either may be on another device) on the current stream.
    ///
    /// # Errors
    /// As [`CudaStream::memcpy_dtod`].
    pub fn dtod<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(&self, src: &S, dst: &mut D) -> Result<()> {
        self.on_stream(|stream| stream.memcpy_dtod(src, dst))
    }

    /// Blocks until the current stream's work is done.
    ///
    /// # Errors
    /// The driver's error, including errors of earlier asynchronous work.
    pub fn synchronize(&self) -> Result<()> {
        self.on_stream(|stream| stream.synchronize())
    }

    /// Loads PTX into this engine's context.
    ///
    /// # Errors
    /// As [`Module::load_ptx`].
    pub fn load_ptx(&self, name: &str, ptx: &str) -> Result<Arc<Module>> {
        Module::load_ptx(&self.inner.ctx, name, ptx)
    }

    /// This device's helper kernels, loaded on first use (a failed load is retried next time).
    ///
    /// # Errors
    /// The module load's error.
    #[inline]
    pub fn helper_kernels(&self) -> Result<&HelperKernels> {
        load_once(&self.inner.modules.helpers, &self.inner.modules.loading, || {
            HelperKernels::load(&self.inner.ctx, self.max_blocks())
        })
    }

    /// This device's helper kernels where the driver can run them: `Ok(None)` when it cannot run
    /// the embedded PTX (a driver older than the toolkit that built it), whose callers then keep
    /// their copies on the copy engines. Any other failure is the load's error.
    ///
    /// # Errors
    /// The module load's error, but an unrunnable image's.
    pub(crate) fn helper_kernels_if_runnable(&self) -> Result<Option<&HelperKernels>> {
        match self.helper_kernels() {
            Ok(kernels) => Ok(Some(kernels)),
            Err(CudaError::Driver(e)) if e.is_unrunnable_code() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// This device's test fixtures' kernels (`testing` feature), loaded on first use.
    ///
    /// # Errors
    /// The module load's error.
    #[cfg(feature = "testing")]
    pub fn test_kernels(&self) -> Result<&TestKernels> {
        load_once(&self.inner.modules.test_kernels, &self.inner.modules.loading, || {
            TestKernels::load(&self.inner.ctx, self.max_blocks())
        })
    }

    /// This device's toy model layer, loaded on first use (a failed load is retried next time).
    fn toy_model(&self) -> Result<&ToyModel> {
        load_once(&self.inner.modules.toy_model, &self.inner.modules.loading, || {
            ToyModel::load(&self.inner.ctx, self.max_blocks())
        })
    }

    /// Writes [`kernels::pattern`](crate::kernels::pattern)`(seed, i)` into element `i` of `dst`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device; the driver's error.
    #[cfg(feature = "testing")]
    pub fn fill_pattern<D: DeviceSliceMut<u32>>(&self, dst: &mut D, seed: u32) -> Result<()> {
        self.on_stream(|stream| self.test_kernels()?.fill_pattern(stream, dst, seed))
    }

    /// Sets every element of `dst` to `value`.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device; the driver's error.
    #[cfg(feature = "testing")]
    pub fn fill_u32<D: DeviceSliceMut<u32>>(&self, dst: &mut D, value: u32) -> Result<()> {
        self.on_stream(|stream| self.test_kernels()?.fill_u32(stream, dst, value))
    }

    /// The [`kernels::checksum`](crate::kernels::checksum) of `src`, computed on the device; waits for the result.
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device; the driver's error.
    #[cfg(feature = "testing")]
    pub fn checksum<S: DeviceSlice<u32>>(&self, src: &S) -> Result<u64> {
        let mut sum = self.alloc_zeroed::<u64>(1)?;
        self.checksum_into(src, &mut sum)?;
        Ok(self.dtoh(&sum)?[0])
    }

    /// Adds the [`kernels::checksum`](crate::kernels::checksum) of `src` into `out[0]` (which should start at zero), without
    /// waiting: for checking many transfers with one readback at the end.
    ///
    /// # Errors
    /// [`CudaError::LengthMismatch`] unless `out` has exactly one element; [`CudaError::WrongDevice`] for
    /// memory of another device; the driver's error.
    #[cfg(feature = "testing")]
    pub fn checksum_into<S: DeviceSlice<u32>, D: DeviceSliceMut<u64>>(&self, src: &S, out: &mut D) -> Result<()> {
        self.on_stream(|stream| self.test_kernels()?.checksum_into(stream, src, out))
    }

    /// Enqueues a kernel that keeps the current stream busy for `ns` nanoseconds.
    ///
    /// # Errors
    /// The driver's error.
    #[cfg(feature = "testing")]
    pub fn spin(&self, ns: u64) -> Result<()> {
        self.on_stream(|stream| self.test_kernels()?.spin(stream, ns))
    }

    /// Copies `src` into `dst` with the SMs of this engine's device (a kernel, not the copy
    /// engines), on the current stream. Either side may be on another device: peer access to it
    /// is enabled first (as [`enable_peer_access`](crate::enable_peer_access) does), and it must
    /// not be pool memory (pools are not peer-mapped; use [`CudaSlice::alloc_persistent`]).
    ///
    /// # Errors
    /// Checked before anything is enqueued: [`CudaError::LengthMismatch`] unless the lengths agree;
    /// [`CudaError::Misaligned`] when either address is not 16-byte aligned;
    /// [`CudaError::NotPeerReachable`] for pool memory of another device;
    /// [`CudaError::PeerAccessUnsupported`] when the devices cannot reach each other. Else the
    /// driver's error.
    pub fn copy_with_sms<T: DeviceRepr, S: DeviceSlice<T>, D: DeviceSliceMut<T>>(
        &self,
        src: &S,
        dst: &mut D,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(CudaError::LengthMismatch {
                what: "Engine::copy_with_sms",
                expected: dst.len(),
                found: src.len(),
            });
        }
        self.on_stream(|stream| {
            self.helper_kernels()?.copy_bytes(stream, src.as_view().into_bytes(), dst.as_view_mut().into_bytes())
        })
    }

    /// Applies layer `layer` of the toy residual model at decode step `step` to `x`, in place, on
    /// the current stream.
    ///
    /// A stand-in layer for examples and benchmarks, in place of a real model's: elementwise,
    /// `x[i] = fma(x[i], a, b)` with `a` in [0.5, 1) and `b` in [-0.5, 0.5) drawn from a hash
    /// ([`kernels::mix32`](crate::kernels::mix32)) of `(step, layer, i)`. The fused multiply-add
    /// is exactly rounded, so every GPU gives the same bits for the same inputs, and a pipeline's
    /// output can be compared bit for bit with one engine running the same layers; since the
    /// output depends on the step and the layer, a transfer that delivers a wrong or stale step
    /// (or elements in the wrong place) shows. Its module (`kernels/toy_model.cu`,
    /// [`kernels::TOY_MODEL_PTX`](crate::kernels::TOY_MODEL_PTX)) is loaded into the engine's
    /// context on the first call only.
    ///
    /// ```no_run
    /// # fn main() -> ppnrt::Result<()> {
    /// let engine = ppnrt::Engine::new(0)?;
    /// let mut x = engine.htod(&[0.25f32; 4096])?;
    /// for layer in 0..8 {
    ///     engine.toy_layer(&mut x, 0, layer)?; // step 0, layers 0..8
    /// }
    /// let output = engine.dtoh(&x)?;
    /// # let _ = output;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`CudaError::WrongDevice`] for memory of another device; the module load's error on the
    /// first call; the driver's error.
    pub fn toy_layer<D: DeviceSliceMut<f32>>(&self, x: &mut D, step: u32, layer: u32) -> Result<()> {
        self.on_stream(|stream| self.toy_model()?.layer(stream, x, step, layer))
    }

    /// Launches a kernel that traps: the context becomes unusable and later calls on it return
    /// [`CudaError::ContextUnusable`]. For fault-handling tests; run it in a process you can lose.
    ///
    /// # Errors
    /// The driver's error.
    #[cfg(feature = "testing")]
    pub fn inject_trap(&self) -> Result<()> {
        self.on_stream(|stream| self.test_kernels()?.trap(stream))
    }
}
