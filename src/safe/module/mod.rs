//! Modules (PTX text, cubins and fatbins) and their kernels.
//!
//! A [`Module`] owns a loaded module of one context (unloaded when the last [`Function`] of it
//! goes); both are `Send + Sync`. An image is checked before the driver reads it (`image`). A
//! kernel is launched by [`CudaStream::launch`](crate::CudaStream::launch) (`launch`).

use std::ffi::{CStr, CString};
use std::sync::Arc;

use super::context::Context;
use crate::cuda_error::{CudaError, Result};
use crate::result::module as raw;
use crate::sys::{CUfunction, CUmodule};
use image::{ImageKind, image_kind, ptx_entries};

mod image;

/// A module loaded into one context.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let engine = ppnrt::Engine::new(0)?;
/// let ptx = std::fs::read_to_string("kernels/scale.ptx")?; // nvcc --ptx scale.cu
/// let module = ppnrt::Module::load_ptx(engine.context(), "scale", &ptx)?;
/// println!("{} defines {:?}", module.name(), module.entries());
/// let scale = module.function("scale")?;
/// # drop(scale);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Module {
    ctx: Arc<Context>,
    raw: CUmodule,
    name: String,
    /// The kernels the image names (PTX `.entry` names, a cubin's `.text.` sections), to refuse
    /// unknown kernels before asking the driver; `None` for a fatbin (the driver is asked).
    entries: Option<Vec<String>>,
}

// SAFETY: a loaded CUmodule and its functions may be used from any thread.
unsafe impl Send for Module {}
// SAFETY: as above; methods take &self and call thread-safe driver entry points.
unsafe impl Sync for Module {}

impl Module {
    /// Loads PTX text (JIT-compiled by the driver for the device). `name` is used in errors.
    ///
    /// # Errors
    /// [`CudaError::InteriorNul`] if `ptx` contains a NUL byte before its end; the driver's error
    /// (`CUDA_ERROR_INVALID_PTX`, `CUDA_ERROR_UNSUPPORTED_PTX_VERSION` when the driver is older
    /// than the toolkit that wrote the PTX).
    #[doc(alias = "cuModuleLoadData")]
    pub fn load_ptx(ctx: &Arc<Context>, name: &str, ptx: &str) -> Result<Arc<Module>> {
        let owned;
        let image: &CStr = match CStr::from_bytes_with_nul(ptx.as_bytes()) {
            // Already NUL-terminated (the embedded modules are): no copy.
            Ok(image) => image,
            Err(_) => {
                owned = CString::new(ptx).map_err(|e| CudaError::InteriorNul {
                    what: "Module::load_ptx: PTX text",
                    position: e.nul_position(),
                })?;
                &owned
            }
        };
        let _bound = ctx.bind()?;
        let raw = raw::load_data(image)?;
        Ok(Arc::new(Module { ctx: Arc::clone(ctx), raw, name: name.to_string(), entries: Some(ptx_entries(ptx)) }))
    }

    /// Loads a module image as engines ship their kernels: a cubin (ELF, for the device's
    /// architecture), a fatbin (several architectures' cubins and PTX; the driver picks) or PTX
    /// text. The bytes are checked before the driver sees them (it reads an image without a
    /// length): every size a cubin's or fatbin's headers state must lie within `image`. `name`
    /// is used in errors.
    ///
    /// Loading an engine's own kernel and launching it (the kernel of
    /// `tests/data/test_params.cu`: two slices, a length, a `#[repr(C)]` struct, `bf16`, `bool`, and
    /// six more scalars):
    ///
    /// ```no_run
    /// # fn main() -> ppnrt::Result<()> {
    /// use ppnrt::{LaunchConfig, Module, bf16, by_value, f16};
    ///
    /// #[derive(Clone, Copy)]
    /// #[repr(C)]
    /// struct Shape { rows: u32, cols: u32, scale: f32 } // as the kernel declares it
    ///
    /// static IMAGE: &[u8] = include_bytes!("../../../tests/data/test_params.fatbin");
    /// let engine = ppnrt::Engine::new(0)?;
    /// let module = Module::load_image(engine.context(), "test_params", IMAGE)?;
    /// let kernel = module.function("ppnrt_test_params12")?;
    /// let n = 4096;
    /// let x = engine.htod(&vec![1.0f32; n])?;
    /// let mut y = engine.alloc::<f32>(n)?;
    /// let shape = Shape { rows: 3, cols: 5, scale: 0.25 };
    /// let stream = engine.stream()?;
    /// // SAFETY: the arguments match the kernel's parameters in order, size and meaning; it
    /// // reads `n` elements of `x` and writes `n` of `y`, nothing else.
    /// unsafe {
    ///     stream.launch(
    ///         &kernel,
    ///         LaunchConfig::for_elements(n, 1024),
    ///         (&x, &mut y, n as u64, by_value(shape), bf16::from_f32(1.5), false, -4i32, 200u8,
    ///          0.125f64, f16::from_f32(-2.0), 7i64, 9u32),
    ///     )?;
    /// }
    /// let values = engine.dtoh(&y)?; // ordered after the kernel by the crate's rule
    /// # let _ = values;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`CudaError::InvalidModuleImage`] for bytes that are no whole image (truncated, or neither PTX,
    /// ELF nor a fatbin); the driver's error (`CUDA_ERROR_NO_BINARY_FOR_GPU` when no image inside
    /// suits the device, `CUDA_ERROR_INVALID_IMAGE`).
    #[doc(alias = "cuModuleLoadData")]
    pub fn load_image(ctx: &Arc<Context>, name: &str, image: &[u8]) -> Result<Arc<Module>> {
        let invalid = |reason: String| CudaError::InvalidModuleImage { module: name.to_string(), reason };
        let entries = match image_kind(image).map_err(invalid)? {
            ImageKind::Ptx => {
                let text =
                    std::str::from_utf8(image).map_err(|e| invalid(format!("PTX text that is not UTF-8: {e}")))?;
                return Module::load_ptx(ctx, name, text);
            }
            ImageKind::Cubin { entries } => Some(entries),
            ImageKind::Fatbin => None,
        };
        // The driver reads the image's headers as 8-byte words: an aligned copy.
        let mut aligned = vec![0u64; image.len().div_ceil(8)];
        // SAFETY: `aligned` has at least `image.len()` bytes; the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(image.as_ptr(), aligned.as_mut_ptr().cast::<u8>(), image.len()) };
        let _bound = ctx.bind()?;
        // SAFETY: `image_kind` checked that every size the headers state lies within the image,
        // which `aligned` holds whole, 8-byte aligned, for the duration of the call.
        let raw = unsafe { raw::load_binary(aligned.as_ptr().cast::<u8>()) }?;
        Ok(Arc::new(Module { ctx: Arc::clone(ctx), raw, name: name.to_string(), entries }))
    }

    /// The kernel `name`.
    ///
    /// # Errors
    /// [`CudaError::KernelNotFound`] when the module has no such kernel (checked against the
    /// image's entries before the driver is asked, where the image lists them).
    #[doc(alias = "cuModuleGetFunction")]
    pub fn function(self: &Arc<Self>, name: &str) -> Result<Function> {
        let not_found = || CudaError::KernelNotFound { module: self.name.clone(), kernel: name.to_string() };
        if self.entries.as_ref().is_some_and(|entries| !entries.iter().any(|entry| entry == name)) {
            return Err(not_found());
        }
        let c_name = CString::new(name).map_err(|e| CudaError::InteriorNul {
            what: "Module::function: kernel name",
            position: e.nul_position(),
        })?;
        let _bound = self.ctx.bind()?;
        // SAFETY: self.raw is live while self lives.
        match unsafe { raw::get_function(self.raw, &c_name) } {
            Ok(raw) => {
                Ok(Function { _module: Arc::clone(self), raw, ordinal: self.ctx.ordinal(), name: name.to_string() })
            }
            Err(CudaError::Driver(e)) if e.code == crate::sys::CUresult::CUDA_ERROR_NOT_FOUND => Err(not_found()),
            Err(e) => Err(e),
        }
    }

    /// The kernels the module defines (its PTX `.entry` names, or a cubin's kernels); empty for
    /// a fatbin, whose kernels the driver knows (ask [`function`](Self::function)).
    pub fn entries(&self) -> &[String] {
        self.entries.as_deref().unwrap_or(&[])
    }

    /// The module's context.
    pub fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The name given at load.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let result = self.ctx.bind().and_then(|_bound| {
            // SAFETY: every Function holds an Arc<Module>, so no function of this module is used
            // after this; launches already queued keep the code resident in the driver.
            unsafe { raw::unload(self.raw) }
        });
        if let Err(e) = result {
            super::record_drop_error(e);
        }
    }
}

/// A kernel of a loaded module.
///
/// ```no_run
/// use ppnrt::{LaunchConfig, Module};
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let engine = ppnrt::Engine::new(0)?;
/// let image = std::fs::read("scale.cubin")?;
/// let module = Module::load_image(engine.context(), "scale", &image)?;
/// // extern "C" __global__ void scale(float *x, unsigned long long n, float by)
/// let scale = module.function("scale")?;
/// let n = 1024;
/// let mut x = engine.htod(&vec![1.0f32; n])?;
/// let stream = engine.stream()?;
/// let config = LaunchConfig::for_elements(n, engine.max_blocks());
/// // SAFETY: the arguments match `scale`'s parameters; it writes n elements of x, nothing else.
/// unsafe { stream.launch(&scale, config, (&mut x, n as u64, 2.0f32))? };
/// assert_eq!(engine.dtoh(&x)?, vec![2.0f32; n]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Function {
    /// Keeps the module loaded while the function lives.
    _module: Arc<Module>,
    raw: CUfunction,
    /// The module's device ordinal, kept beside the handle: every launch compares it.
    ordinal: i32,
    name: String,
}

// SAFETY: a CUfunction may be launched from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device ordinal of the module.
    #[inline]
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw handle, valid while this `Function` (which keeps its module loaded) lives.
    pub fn raw(&self) -> CUfunction {
        self.raw
    }
}
