//! Modules (PTX text, cubins and fatbins) and kernel launch with any parameters.
//!
//! A [`Module`] owns a loaded module of one context (unloaded when the last [`Function`] of it
//! goes); both are `Send + Sync`. A launch orders the slices and views it is given by the crate's
//! rule (see `ordering`).

use std::alloc::Layout;
use std::ffi::{CStr, CString, c_void};
use std::mem::MaybeUninit;
use std::sync::Arc;

use smallvec::SmallVec;

use super::context::Context;
use super::memory::{CudaSlice, CudaView, CudaViewMut, DeviceMemory, DeviceRepr, DeviceSlice, Tracked, ordered_with};
use super::ordering::Use;
use super::peer::ensure_peer_access;
use super::stream::CudaStream;
use crate::cuda_error::{CudaError, Result};
use crate::result::module as raw;
use crate::sys::{CUdeviceptr, CUfunction, CUmodule};
use own::Own;

/// The launch's knowledge of whose code kernel arguments run, sealed.
mod own {
    use std::marker::PhantomData;

    /// The crate's word that the code of a [`KernelParam`](super::KernelParam) or
    /// [`KernelArgs`](super::KernelArgs) implementation is its own (a launch of such arguments
    /// takes its fast path: no rebinding of the context around the arguments' code). Only this
    /// crate can make one, and only of its own types: an implementation of a caller's cannot
    /// name the type, make a value of it, or take another type's (each is of its own `T`).
    pub struct Own<T: ?Sized>(PhantomData<fn() -> *const T>);

    impl<T: ?Sized> Own<T> {
        /// Vouches for `T`'s code: the crate's own implementations only.
        pub(crate) const fn vouch() -> Own<T> {
            Own(PhantomData)
        }

        /// `Some` exactly when `own` is.
        pub(crate) const fn like<U: ?Sized>(own: &Option<Own<U>>) -> Option<Own<T>> {
            if own.is_some() { Some(Own::vouch()) } else { None }
        }
    }
}

/// A module loaded into one context.
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
    /// static IMAGE: &[u8] = include_bytes!("../../tests/data/test_params.fatbin");
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
            Ok(raw) => Ok(Function { module: Arc::clone(self), raw, name: name.to_string() }),
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

/// What a module image is.
#[derive(Debug, PartialEq, Eq)]
enum ImageKind {
    Ptx,
    /// An ELF cubin and the kernels it defines (its `.text.<kernel>` sections).
    Cubin {
        entries: Vec<String>,
    },
    Fatbin,
}

const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// What `image` is, checked whole: every size a cubin's or fatbin's headers state lies within
/// it (the driver reads an image without a length). The reason, when it is no image.
fn image_kind(image: &[u8]) -> std::result::Result<ImageKind, String> {
    let u16_at = |at: usize| image.get(at..at + 2).map(|b| u16::from_le_bytes(b.try_into().expect("two bytes")));
    let u32_at = |at: usize| image.get(at..at + 4).map(|b| u32::from_le_bytes(b.try_into().expect("four bytes")));
    let u64_at = |at: usize| image.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")));
    let short = |what: &str| format!("a truncated {what} of {} bytes", image.len());
    if image.starts_with(b"\x7fELF") {
        if image.get(4) != Some(&2) || image.get(5) != Some(&1) {
            return Err("an ELF image that is not 64-bit little-endian (a cubin is)".into());
        }
        let (Some(shoff), Some(shentsize), Some(shnum), Some(shstrndx)) =
            (u64_at(0x28), u16_at(0x3A), u16_at(0x3C), u16_at(0x3E))
        else {
            return Err(short("ELF header"));
        };
        let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
            return Err(short("ELF header"));
        };
        let within = |offset: u64, size: u64| offset.checked_add(size).is_some_and(|end| end <= image.len() as u64);
        if shentsize < 64 || !within(shoff, u64::from(shentsize) * u64::from(shnum)) {
            return Err(format!("section headers past the end of a cubin of {} bytes", image.len()));
        }
        if phnum > 0 && (phentsize < 56 || !within(phoff, u64::from(phentsize) * u64::from(phnum))) {
            return Err(format!("program headers past the end of a cubin of {} bytes", image.len()));
        }
        let section = |i: u16| shoff as usize + usize::from(i) * usize::from(shentsize);
        let mut sections = Vec::with_capacity(usize::from(shnum));
        for i in 0..shnum {
            let at = section(i);
            let (Some(name), Some(kind), Some(offset), Some(size)) =
                (u32_at(at), u32_at(at + 4), u64_at(at + 0x18), u64_at(at + 0x20))
            else {
                return Err(short("cubin"));
            };
            // SHT_NOBITS (8) occupies no bytes of the file.
            if kind != 8 && !within(offset, size) {
                return Err(format!(
                    "section {i} ({size} bytes at {offset}) past the end of a cubin of {} bytes",
                    image.len()
                ));
            }
            sections.push((name, kind, offset, size));
        }
        let names = sections
            .get(usize::from(shstrndx))
            .map(|&(_, _, offset, size)| &image[offset as usize..(offset + size) as usize]);
        let entries = names
            .map(|names| {
                sections
                    .iter()
                    .filter_map(|&(name, _, _, _)| {
                        let rest = names.get(name as usize..)?;
                        let end = rest.iter().position(|&b| b == 0)?;
                        std::str::from_utf8(&rest[..end]).ok()?.strip_prefix(".text.").map(str::to_string)
                    })
                    .collect()
            })
            .unwrap_or_default();
        return Ok(ImageKind::Cubin { entries });
    }
    if u32_at(0) == Some(FATBIN_MAGIC) {
        let (Some(header), Some(size)) = (u16_at(6), u64_at(8)) else { return Err(short("fatbin header")) };
        if u64::from(header).checked_add(size).is_none_or(|end| end > image.len() as u64) {
            return Err(format!(
                "a fatbin that states {header} + {size} bytes in an image of {} bytes (truncated?)",
                image.len()
            ));
        }
        return Ok(ImageKind::Fatbin);
    }
    if image.starts_with(b"//")
        || image.windows(7).any(|w| w == b".entry ")
        || image.windows(8).any(|w| w == b".version")
    {
        return Ok(ImageKind::Ptx);
    }
    Err(format!("{} bytes that are no PTX text, cubin (ELF) or fatbin", image.len()))
}

/// The names of the `.entry` directives of PTX text (`.visible .entry name(`).
fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|line| line.split(".entry ").nth(1))
        .map(|rest| rest.split(|c: char| c == '(' || c.is_whitespace()).next().unwrap_or("").to_string())
        .filter(|name| !name.is_empty())
        .collect()
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
#[derive(Debug, Clone)]
pub struct Function {
    module: Arc<Module>,
    raw: CUfunction,
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
    pub fn ordinal(&self) -> i32 {
        self.module.ctx.ordinal()
    }

    /// The raw handle, valid while this `Function` (which keeps its module loaded) lives.
    pub fn raw(&self) -> CUfunction {
        self.raw
    }
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks per grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block (x, y, z).
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional configuration for a grid-stride kernel over `n` elements: 256 threads a
    /// block, at most `max_blocks` blocks (at least one).
    #[inline]
    pub fn for_elements(n: usize, max_blocks: u32) -> LaunchConfig {
        let blocks = n.div_ceil(256).clamp(1, max_blocks.max(1) as usize) as u32;
        LaunchConfig { grid: (blocks, 1, 1), block: (256, 1, 1), shared_mem_bytes: 0 }
    }
}

/// A value that can be passed as one kernel parameter.
///
/// An implementation of yours runs its code during the launch, and the launch binds the
/// stream's context again around it, whatever it claims: whether a parameter's code is the
/// crate's own is the crate's knowledge alone (sealed), so no implementation can opt out. The
/// hidden flag that once said so cannot be set:
///
/// ```compile_fail,E0438
/// struct Mine(u32);
/// impl ppnrt::KernelParam for Mine {
///     const FOREIGN: bool = false;
///     type Raw = u32;
///     fn raw_param(&self) -> u32 { self.0 }
/// }
/// ```
pub trait KernelParam {
    /// `Some` for the crate's own implementations only (see `own::Own`): `raw_param` then runs
    /// none but the crate's code. Every other implementation is foreign: a launch with such a
    /// parameter rebinds the stream's context around the arguments' code.
    #[doc(hidden)]
    const OWN: Option<Own<Self>> = None;
    /// The C representation passed to the kernel.
    type Raw: Copy;
    /// The value to pass.
    fn raw_param(&self) -> Self::Raw;
    /// The device memory the parameter hands the kernel, and whether the kernel may write it:
    /// the launch orders it (see [`CudaStream::launch`]). `None` for plain values.
    fn buffer_use(&self) -> Option<BufferUse<'_>> {
        None
    }

    /// Adds the parameter to `list` ([`KernelArgList::arg`]). The crate's own parameters (their
    /// code is the crate's) make their C value now, into the list; every other parameter is kept
    /// and makes its value at the launch.
    #[doc(hidden)]
    fn push_into<'l>(self, list: &mut KernelArgList<'l>)
    where
        Self: Sized + 'l,
        Self::Raw: 'static,
    {
        list.push_deferred(self);
    }

    /// [`push_into`](Self::push_into) of a reference to the parameter.
    #[doc(hidden)]
    fn push_ref_into<'l>(&'l self, list: &mut KernelArgList<'l>)
    where
        Self::Raw: 'static,
    {
        list.push_deferred(self);
    }
}

/// Device memory a kernel parameter hands the kernel: which buffer, and whether it is read or
/// written. Only this crate's slices and views make one (`&CudaSlice` and `CudaView` read,
/// `&mut CudaSlice`, `CudaViewMut` and `&mut CudaViewMut` write).
#[derive(Debug, Clone, Copy)]
pub struct BufferUse<'a> {
    memory: &'a Arc<DeviceMemory>,
    use_: Use,
    address: CUdeviceptr,
}

impl<'a> BufferUse<'a> {
    fn of<T: DeviceRepr>(view: CudaView<'a, T>, use_: Use) -> BufferUse<'a> {
        BufferUse { memory: view.memory(), use_, address: view.device_ptr() }
    }

    fn at(memory: &'a Arc<DeviceMemory>, address: CUdeviceptr, use_: Use) -> BufferUse<'a> {
        BufferUse { memory, use_, address }
    }

    /// The stream that owns the memory.
    fn owner(&self) -> &'a Arc<CudaStream> {
        self.memory.owner()
    }
}

macro_rules! scalar_params {
    ($($t:ty),*) => {$(
        impl KernelParam for $t {
            const OWN: Option<Own<Self>> = Some(Own::vouch());
            type Raw = $t;
            fn raw_param(&self) -> $t {
                *self
            }
            #[inline]
            fn push_into<'l>(self, list: &mut KernelArgList<'l>)
            where
                Self: 'l,
            {
                list.push_value(self);
            }
        }
    )*};
}
scalar_params!(u8, i8, u16, i16, u32, i32, u64, i64, f32, f64, usize, isize, half::f16, half::bf16);

/// A C++ `bool` parameter: one byte, 0 or 1.
impl KernelParam for bool {
    const OWN: Option<Own<Self>> = Some(Own::vouch());
    type Raw = u8;
    fn raw_param(&self) -> u8 {
        u8::from(*self)
    }
    #[inline]
    fn push_into<'l>(self, list: &mut KernelArgList<'l>)
    where
        Self: 'l,
    {
        list.push_value(u8::from(self));
    }
}

/// A parameter passed by value as its bytes: a `#[repr(C)]` struct (or any `Copy` value) whose
/// layout matches the kernel's parameter type, field for field (size, alignment, padding).
/// Built by [`by_value`].
///
/// Device addresses inside the value are not ordered by the crate's rule (their ordering is the
/// caller's, as for addresses passed as integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByValue<T: Copy + 'static>(pub T);

/// Passes `value` to a kernel by value, as its bytes (see [`ByValue`]).
pub fn by_value<T: Copy + 'static>(value: T) -> ByValue<T> {
    ByValue(value)
}

impl<T: Copy + 'static> KernelParam for ByValue<T> {
    const OWN: Option<Own<Self>> = Some(Own::vouch());
    type Raw = T;
    fn raw_param(&self) -> T {
        self.0
    }
    #[inline]
    fn push_into<'l>(self, list: &mut KernelArgList<'l>)
    where
        Self: 'l,
    {
        list.push_value(self.0);
    }
}

impl<P: KernelParam + ?Sized> KernelParam for &P {
    const OWN: Option<Own<Self>> = Own::like(&P::OWN);
    type Raw = P::Raw;
    fn raw_param(&self) -> P::Raw {
        (**self).raw_param()
    }
    fn buffer_use(&self) -> Option<BufferUse<'_>> {
        (**self).buffer_use()
    }
    #[inline]
    fn push_into<'l>(self, list: &mut KernelArgList<'l>)
    where
        Self: 'l,
        P::Raw: 'static,
    {
        P::push_ref_into(self, list);
    }
}

/// What every slice and view parameter is: its device address, handing the kernel its memory for
/// `$use_` (the items of its `KernelParam` impl but the list's).
macro_rules! slice_param_items {
    ($use_:expr) => {
        const OWN: Option<Own<Self>> = Some(Own::vouch());
        type Raw = CUdeviceptr;
        fn raw_param(&self) -> CUdeviceptr {
            self.device_ptr()
        }
        fn buffer_use(&self) -> Option<BufferUse<'_>> {
            Some(BufferUse::of(self.as_view(), $use_))
        }
    };
}

/// An owned slice, read: a list keeps it to the launch; a reference to one (`&CudaSlice`) makes
/// its value when added.
impl<T: DeviceRepr> KernelParam for CudaSlice<T> {
    slice_param_items!(Use::Read);
    #[inline]
    fn push_ref_into<'l>(&'l self, list: &mut KernelArgList<'l>) {
        list.push_memory(self.memory(), self.device_ptr(), Use::Read);
    }
}

/// A slice or view passed as a parameter the kernel writes (`&mut`): its address and its memory,
/// for as long as the borrow lasts.
macro_rules! written_params {
    ($($ty:ty),* $(,)?) => {$(
        impl<T: DeviceRepr> KernelParam for $ty {
            slice_param_items!(Use::Write);
            #[inline]
            fn push_into<'l>(self, list: &mut KernelArgList<'l>)
            where
                Self: 'l,
            {
                let written: &'l _ = self;
                list.push_memory(written.memory(), written.device_ptr(), Use::Write);
            }
        }
    )*};
}
written_params!(&mut CudaSlice<T>, &mut CudaViewMut<'_, T>);

/// A view passed by value or by reference: its memory for the view's lifetime.
macro_rules! view_params {
    ($($ty:ident => $use_:expr),* $(,)?) => {$(
        impl<'v, T: DeviceRepr> KernelParam for $ty<'v, T> {
            slice_param_items!($use_);
            #[inline]
            fn push_into<'l>(self, list: &mut KernelArgList<'l>)
            where
                Self: 'l,
            {
                list.push_memory(self.memory(), self.device_ptr(), $use_);
            }
            #[inline]
            fn push_ref_into<'l>(&'l self, list: &mut KernelArgList<'l>) {
                list.push_memory(self.memory(), self.device_ptr(), $use_);
            }
        }
    )*};
}
view_params!(CudaView => Use::Read, CudaViewMut => Use::Write);

/// The most parameters a tuple passes (a [`KernelArgList`] passes any number).
pub const MAX_KERNEL_PARAMS: usize = 16;

/// Kernel parameters, passed in order: a tuple of up to [`MAX_KERNEL_PARAMS`] parameters, or a
/// [`KernelArgList`] of any number.
pub trait KernelArgs {
    /// `Some` for the crate's own implementations only (its tuples of its own parameters; see
    /// `own::Own`): [`with_params`](Self::with_params) then runs none but the crate's code. For
    /// every other implementation the launch binds the stream's context again right before
    /// `cuLaunchKernel`, and checks afterwards that the thread's current context was left as it
    /// was.
    #[doc(hidden)]
    const OWN: Option<Own<Self>> = None;

    /// [`OWN`](Self::OWN) of these arguments (a list knows it only from its parameters).
    #[doc(hidden)]
    fn own(&self) -> Option<Own<Self>> {
        Self::OWN
    }

    /// Calls `f` with one pointer per parameter, each valid for the duration of the call.
    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R;
    /// Hands `each` the device memory each parameter gives the kernel (see
    /// [`KernelParam::buffer_use`]).
    fn buffer_uses<'a>(&'a self, each: &mut dyn FnMut(BufferUse<'a>));

    /// Adds the device memory each parameter gives the kernel to `uses`, as
    /// [`buffer_uses`](Self::buffer_uses) hands it (the crate's tuples add theirs without a call
    /// per parameter).
    #[doc(hidden)]
    #[inline]
    fn collect_buffer_uses<'a>(&'a self, uses: &mut BufferUses<'a>) {
        self.buffer_uses(&mut |used| uses.0.push(used));
    }
}

/// The device memory a launch's parameters give its kernel, in parameter order (filled by
/// [`KernelArgs::collect_buffer_uses`]).
#[doc(hidden)]
#[derive(Debug, Default)]
pub struct BufferUses<'a>(SmallVec<[BufferUse<'a>; 8]>);

impl<'a> BufferUses<'a> {
    /// Adds `used`.
    #[inline]
    pub fn push(&mut self, used: BufferUse<'a>) {
        self.0.push(used);
    }
}

macro_rules! kernel_args {
    ($($name:ident : $idx:tt),*) => {
        impl<$($name: KernelParam),*> KernelArgs for ($($name,)*) {
            // A tuple runs its parameters' `raw_param`: the crate's own when all of them are.
            const OWN: Option<Own<Self>> = if $($name::OWN.is_some() &&)* true { Some(Own::vouch()) } else { None };

            #[allow(non_snake_case)]
            #[inline(always)]
            fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
                $(let mut $name = self.$idx.raw_param();)*
                let mut params = [$((&raw mut $name).cast::<c_void>()),*];
                f(&mut params)
            }
            fn buffer_uses<'a>(&'a self, each: &mut dyn FnMut(BufferUse<'a>)) {
                $(if let Some(used) = self.$idx.buffer_use() { each(used) })*
            }
            #[inline(always)]
            fn collect_buffer_uses<'a>(&'a self, uses: &mut BufferUses<'a>) {
                $(if let Some(used) = self.$idx.buffer_use() { uses.push(used) })*
            }
        }
    };
}
impl KernelArgs for () {
    const OWN: Option<Own<Self>> = Some(Own::vouch());

    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        f(&mut [])
    }
    fn buffer_uses<'a>(&'a self, _each: &mut dyn FnMut(BufferUse<'a>)) {}
}
kernel_args!(A: 0);
kernel_args!(A: 0, B: 1);
kernel_args!(A: 0, B: 1, C: 2);
kernel_args!(A: 0, B: 1, C: 2, D: 3);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11, M: 12);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11, M: 12, N: 13);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11, M: 12, N: 13, O: 14);
kernel_args!(A: 0, B: 1, C: 2, D: 3, E: 4, F: 5, G: 6, H: 7, I: 8, J: 9, K: 10, L: 11, M: 12, N: 13, O: 14, P: 15);

/// One parameter of a [`KernelArgList`], its type erased.
trait ListedParam {
    /// Writes the parameter's C value at `at`.
    ///
    /// # Safety
    /// `at` is valid for writes of the parameter's C value (`KernelParam::Raw`) and aligned for
    /// it.
    unsafe fn write_raw(&self, at: *mut u8);
    /// The parameter's value, boxed where the launch can point at it (for a value aligned beyond
    /// a [`ParamWord`]).
    fn raw_boxed(&self) -> Box<dyn RawValue>;
    fn buffer_use(&self) -> Option<BufferUse<'_>>;
}

impl<P: KernelParam> ListedParam for P
where
    P::Raw: 'static,
{
    unsafe fn write_raw(&self, at: *mut u8) {
        // SAFETY: the caller gives room for a `P::Raw`, aligned for it.
        unsafe { at.cast::<P::Raw>().write(self.raw_param()) }
    }
    fn raw_boxed(&self) -> Box<dyn RawValue> {
        Box::new(self.raw_param())
    }
    fn buffer_use(&self) -> Option<BufferUse<'_>> {
        KernelParam::buffer_use(self)
    }
}

/// The storage of a [`KernelArgList`]'s values: each value at its own alignment (at most this
/// word's) in a run of words, inline in the list for up to 128 bytes of values (and in a launch's
/// copy of them for up to 256).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct ParamWord([u8; 64]);

/// Parameters of a list whose pointers a launch passes inline (no allocation): most lists.
const INLINE_PARAMS: usize = 24;

/// A parameter's C value, at an address the launch passes.
trait RawValue {
    fn address(&mut self) -> *mut c_void;
}

impl<T: Copy + 'static> RawValue for T {
    fn address(&mut self) -> *mut c_void {
        (self as *mut T).cast()
    }
}

/// Kernel parameters of any number, in the order they are added: for kernels with more
/// parameters than a tuple passes, or built in a loop.
///
/// The crate's own parameters (numbers, `bool`, `bf16` and `f16`, [`by_value`], slices and views)
/// make their C value as they are added, laid out in the list: a list of up to 12 of them and 128
/// bytes of values is built and launched without a heap allocation. A parameter of the caller's
/// own [`KernelParam`] implementation is kept and makes its value at the launch, as in a tuple.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// use ppnrt::{KernelArgList, by_value};
/// # let engine = ppnrt::Engine::new(0)?;
/// # let stream = engine.stream()?;
/// # let x = engine.alloc::<f32>(1024)?;
/// # let mut y = engine.alloc::<f32>(1024)?;
/// #[derive(Clone, Copy)]
/// #[repr(C)]
/// struct Shape { rows: u32, cols: u32, scale: f32 }
/// let args = KernelArgList::new()
///     .arg(&x) // read by the kernel
///     .arg(&mut y) // written by the kernel
///     .arg(by_value(Shape { rows: 32, cols: 32, scale: 0.5 }))
///     .arg(ppnrt::bf16::from_f32(1.5))
///     .arg(true);
/// assert_eq!(args.len(), 5);
/// # let _ = (stream, args);
/// # Ok(())
/// # }
/// ```
#[derive(Default)]
pub struct KernelArgList<'a> {
    /// Each parameter, in order: its value made when it was added, or its parameter kept to make
    /// the value at the launch.
    entries: SmallVec<[ListEntry<'a>; LISTED_INLINE]>,
    /// The values made when their parameters were added, each at its own alignment (at most a
    /// word's), at the offsets their entries name; and room at the offsets of the values made at
    /// the launch.
    values: SmallVec<[MaybeUninit<ParamWord>; 2]>,
    /// The bytes of `values` in use.
    end: usize,
    foreign: bool,
}

/// Parameters a list holds without an allocation.
const LISTED_INLINE: usize = 12;

/// One parameter of a [`KernelArgList`].
enum ListEntry<'a> {
    /// A value made when the parameter was added (the crate's own parameters), at `offset` in
    /// the list's values, and the device memory the parameter gives the kernel.
    Made { offset: usize, used: Option<BufferUse<'a>> },
    /// A parameter whose value is made at the launch (a caller's implementation, whose code runs
    /// then; a slice the list owns), at `offset` (`None`: aligned beyond a word, boxed then).
    Deferred { param: Box<dyn ListedParam + 'a>, offset: Option<usize> },
}

impl<'a> KernelArgList<'a> {
    /// An empty list.
    pub fn new() -> KernelArgList<'a> {
        KernelArgList::default()
    }

    /// Adds `param` as the next parameter.
    #[inline]
    pub fn arg<P: KernelParam + 'a>(mut self, param: P) -> KernelArgList<'a>
    where
        P::Raw: 'static,
    {
        self.foreign |= P::OWN.is_none();
        param.push_into(&mut self);
        self
    }

    /// How many parameters the list holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the list holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Room for a value of `layout` (at most a word's alignment) after the values so far: its
    /// offset.
    #[inline(always)]
    fn reserve(&mut self, layout: Layout) -> usize {
        // A layout's alignment is a power of two.
        let at = (self.end + layout.align() - 1) & !(layout.align() - 1);
        self.end = at + layout.size();
        let words = self.end.div_ceil(size_of::<ParamWord>());
        if words > self.values.len() {
            self.values.reserve(words - self.values.len());
            // SAFETY: the capacity holds `words` elements (just reserved), and a `MaybeUninit`
            // needs no initialisation.
            unsafe { self.values.set_len(words) };
        }
        at
    }

    /// Adds a parameter whose C value is `raw`, made now, which gives the kernel no memory.
    #[inline(always)]
    pub(crate) fn push_value<R: Copy + 'static>(&mut self, raw: R) {
        if align_of::<R>() > align_of::<ParamWord>() {
            // Aligned beyond the list's words (a `#[repr(align)]` struct by value): boxed at the
            // launch.
            self.entries.push(ListEntry::Deferred { param: Box::new(ByValue(raw)), offset: None });
            return;
        }
        let offset = self.write_value(raw);
        self.entries.push(ListEntry::Made { offset, used: None });
    }

    /// Adds a parameter that hands the kernel `memory` at `address`, for `use_`: the address is
    /// its C value, made now.
    #[inline(always)]
    pub(crate) fn push_memory(&mut self, memory: &'a Arc<DeviceMemory>, address: CUdeviceptr, use_: Use) {
        let offset = self.write_value(address);
        self.entries.push(ListEntry::Made { offset, used: Some(BufferUse::at(memory, address, use_)) });
    }

    /// Writes `raw` (aligned at most to a word) after the values so far: its offset.
    #[inline(always)]
    fn write_value<R: Copy + 'static>(&mut self, raw: R) -> usize {
        let offset = self.reserve(Layout::new::<R>());
        // SAFETY: `offset` + the value's size is within the values' words (just reserved), and
        // `offset` is a multiple of the value's alignment in storage aligned to a word, at least
        // the value's alignment (every caller's value is aligned at most to a word).
        unsafe { self.values.as_mut_ptr().cast::<u8>().add(offset).cast::<R>().write(raw) };
        offset
    }

    /// Adds `param`, kept to make its value at the launch.
    fn push_deferred<P: KernelParam + 'a>(&mut self, param: P)
    where
        P::Raw: 'static,
    {
        let layout = Layout::new::<P::Raw>();
        let offset = (layout.align() <= align_of::<ParamWord>()).then(|| self.reserve(layout));
        self.entries.push(ListEntry::Deferred { param: Box::new(param), offset });
    }
}

impl std::fmt::Debug for KernelArgList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KernelArgList({} parameters)", self.entries.len())
    }
}

impl KernelArgs for KernelArgList<'_> {
    fn own(&self) -> Option<Own<Self>> {
        if self.foreign { None } else { Some(Own::vouch()) }
    }

    fn with_params<R>(&self, f: impl FnOnce(&mut [*mut c_void]) -> R) -> R {
        // The launch's copy of the values: those made when added, and room for the others.
        let mut storage: SmallVec<[MaybeUninit<ParamWord>; 4]> = SmallVec::from_slice(&self.values);
        let base = storage.as_mut_ptr().cast::<u8>();
        // Values aligned beyond a word, boxed (their addresses stay put as the vector grows).
        let mut boxed: Vec<Box<dyn RawValue>> = Vec::new();
        let mut pointers: SmallVec<[*mut c_void; INLINE_PARAMS]> = SmallVec::with_capacity(self.entries.len());
        for entry in &self.entries {
            let at = match entry {
                // SAFETY: the offset is within the storage's bytes (reserved when the entry was
                // added; the storage copies every word).
                ListEntry::Made { offset, .. } => unsafe { base.add(*offset) },
                ListEntry::Deferred { param, offset: Some(offset) } => {
                    // SAFETY: as above: room reserved for the value at its alignment, in storage
                    // aligned to a word (at least the value's alignment).
                    let at = unsafe { base.add(*offset) };
                    // SAFETY: as above.
                    unsafe { param.write_raw(at) };
                    at
                }
                ListEntry::Deferred { param, offset: None } => {
                    boxed.push(param.raw_boxed());
                    boxed.last_mut().expect("pushed above").address().cast()
                }
            };
            pointers.push(at.cast());
        }
        f(&mut pointers)
    }

    fn buffer_uses<'a>(&'a self, each: &mut dyn FnMut(BufferUse<'a>)) {
        self.entries.iter().filter_map(ListEntry::buffer_use).for_each(each);
    }

    #[inline]
    fn collect_buffer_uses<'a>(&'a self, uses: &mut BufferUses<'a>) {
        for entry in &self.entries {
            if let Some(used) = entry.buffer_use() {
                uses.push(used);
            }
        }
    }
}

impl<'a> ListEntry<'a> {
    /// The device memory the parameter gives the kernel.
    #[inline]
    fn buffer_use(&self) -> Option<BufferUse<'_>> {
        match self {
            ListEntry::Made { used, .. } => *used,
            ListEntry::Deferred { param, .. } => param.buffer_use(),
        }
    }
}

impl CudaStream {
    /// Checks that this stream's device may reach the memory of other devices in `uses` (not pool
    /// memory; peer access enabled first): [`CudaError::NotPeerReachable`], else the error of
    /// enabling peer access.
    #[cold]
    #[inline(never)]
    fn reach_other_devices(&self, uses: &[BufferUse<'_>]) -> Result<()> {
        for used in uses.iter().filter(|used| used.owner().ordinal() != self.ordinal()) {
            if used.memory.is_pooled() {
                return Err(CudaError::NotPeerReachable {
                    what: "CudaStream::launch",
                    device: self.ordinal(),
                    memory_device: used.owner().ordinal(),
                    address: used.address,
                });
            }
            ensure_peer_access(self.context(), used.owner().context())?;
        }
        Ok(())
    }

    /// `cuLaunchKernel` of `function` with `config` and `params` on this stream: the launch itself,
    /// once its parameters are made and its buffers ordered ([`launch`](Self::launch)).
    ///
    /// # Safety
    /// `params` match the kernel's parameter list; the kernel touches only memory they give it,
    /// which is reachable from this stream's device and ordered on this stream; `function` is of
    /// this stream's device.
    #[inline(always)]
    pub(super) unsafe fn launch_ordered(
        &self,
        function: &Function,
        config: &LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller meets the contract above; function and stream are live (borrowed).
        unsafe {
            raw::launch_kernel(function.raw, config.grid, config.block, config.shared_mem_bytes, self.raw(), params)
        }
    }

    /// Launches `function` on this stream. Device memory passed as slices and views is ordered
    /// by the crate's rule before the kernel runs and after it (see the `safe` module docs): the
    /// kernel waits for the last write of what it reads and for every use of what it writes, and
    /// later users, including the free of a dropped buffer, wait for the kernel. Memory of another
    /// device must be `cuMemAlloc` memory (pool memory is not peer-mapped); peer access to it is
    /// enabled first.
    ///
    /// # Errors
    /// Checked before anything is enqueued: [`CudaError::WrongDevice`] when the function's module is
    /// on another device; [`CudaError::NotPeerReachable`] for pool memory of another device;
    /// [`CudaError::PeerAccessUnsupported`]. Else the driver's error.
    ///
    /// # Safety
    /// - `args` matches the kernel's parameter list exactly: count, order and each type's size
    ///   and meaning (a slice passes its device address).
    /// - The kernel accesses only memory that `args` give it, within their lengths, and writes
    ///   only memory passed as a mutable slice or view. (Device addresses passed as plain integers
    ///   are not ordered: their ordering is the caller's.)
    /// - The arguments' own code ([`KernelArgs::with_params`], [`KernelParam::raw_param`]), which
    ///   runs during the launch, does not end a capture of this stream. (Beginning one there is
    ///   refused with [`CaptureError::CannotBegin`](crate::CaptureError::CannotBegin).)
    #[doc(alias = "cuLaunchKernel")]
    pub unsafe fn launch<A: KernelArgs>(
        self: &Arc<Self>,
        function: &Function,
        config: LaunchConfig,
        args: A,
    ) -> Result<()> {
        if function.ordinal() != self.ordinal() {
            return Err(CudaError::WrongDevice {
                what: "CudaStream::launch: the kernel's module must be on the stream's device",
                expected: self.ordinal(),
                found: function.ordinal(),
            });
        }
        let mut uses = BufferUses::default();
        args.collect_buffer_uses(&mut uses);
        let uses = &uses.0;
        if uses.iter().any(|used| used.owner().ordinal() != self.ordinal()) {
            self.reach_other_devices(uses)?;
        }
        let tracked = uses.iter().map(|used| (Tracked::Device(used.memory), used.use_));
        if A::OWN.is_some() || args.own().is_some() {
            // The crate's own parameters (a tuple of them, or a list that holds only them): their
            // values are made first (no caller code runs), and the buffers' states stay locked
            // from the waits to the notes around the launch alone.
            return args.with_params(
                #[inline(always)]
                |params| {
                    // SAFETY: as below; the parameters' code is the crate's own.
                    ordered_with(
                        self,
                        tracked,
                        true,
                        #[inline(always)]
                        || unsafe { self.launch_ordered(function, &config, params) },
                    )
                },
            );
        }
        let foreign = args.own().is_none();
        // A caller's kernel-argument code may use the same buffers through this crate: their
        // states are not held locked while it runs.
        ordered_with(self, tracked, !foreign, || {
            let launch = |params: &mut [*mut c_void]| {
                // A caller's `with_params` runs its own code first, which may change the current
                // context: the launch binds the stream's again.
                let _bound = if foreign { Some(self.context().bind()?) } else { None };
                // SAFETY: the caller guarantees that params match the kernel and that it touches
                // only the memory they give it; function and stream are of one device (checked
                // above), the memory reachable from it (checked above) and ordered on this stream
                // (by `ordered_with`, around this call).
                unsafe { self.launch_ordered(function, &config, params) }
            };
            if foreign {
                // A caller's implementation runs code that is not the crate's own.
                self.run_launch_arguments(|| super::context::outside_call_scope(|| args.with_params(launch)))
            } else {
                args.with_params(launch)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ptx_entries_are_found_with_and_without_parameters() {
        let ptx =
            ".visible .entry ppnrt_trap()\n{\n}\n.visible .entry ppnrt_fill_u32(\n.param .u64 a\n)\n.func helper(\n";
        assert_eq!(super::ptx_entries(ptx), vec!["ppnrt_trap", "ppnrt_fill_u32"]);
        assert!(super::ptx_entries("// no kernels here\n.func f(\n").is_empty());
        assert_eq!(super::ptx_entries(crate::kernels::HELPERS_PTX), ["ppnrt_copy_bytes"]);
    }

    #[test]
    fn module_images_are_checked_whole_before_the_driver_reads_them() {
        use super::{ImageKind, image_kind};
        let fatbin: &[u8] = include_bytes!("../../tests/data/test_params.fatbin");
        let cubin: &[u8] = include_bytes!("../../tests/data/test_params.cubin");
        assert_eq!(image_kind(fatbin), Ok(ImageKind::Fatbin));
        assert_eq!(image_kind(cubin), Ok(ImageKind::Cubin { entries: vec!["ppnrt_test_params12".into()] }));
        assert_eq!(image_kind(crate::kernels::HELPERS_PTX.as_bytes()), Ok(ImageKind::Ptx));
        // Every truncation of either is refused (never handed to the driver).
        for image in [fatbin, cubin] {
            for len in [0, 3, 16, 63, 64, image.len() / 2, image.len() - 1] {
                let refused = image_kind(&image[..len]);
                assert!(refused.is_err(), "{len} of {} bytes: {refused:?}", image.len());
            }
        }
        assert!(image_kind(&[0u8; 64]).unwrap_err().contains("no PTX text, cubin (ELF) or fatbin"));
        let mut huge = fatbin.to_vec();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(image_kind(&huge).unwrap_err().contains("truncated"), "a size that overflows");
        let mut far = cubin.to_vec();
        far[0x28..0x30].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(image_kind(&far).unwrap_err().contains("section headers past the end"));
    }

    /// What a launch hands the driver: one pointer per parameter, at the parameter's C value —
    /// `bool` as one byte, `bf16` and `f16` as their bits, a `#[repr(C)]` struct as its bytes,
    /// slices as their device addresses — for tuples of up to sixteen and lists of any length.
    #[test]
    fn every_parameter_reaches_the_launch_as_its_c_value() {
        use super::{KernelArgList, KernelArgs, by_value};
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[repr(C)]
        struct Shape {
            rows: u32,
            cols: u32,
            scale: f32,
        }
        let shape = Shape { rows: 3, cols: 5, scale: 0.25 };
        let bias = half::bf16::from_f32(1.5);
        let h = half::f16::from_f32(-2.0);
        // The alignment of each parameter's C type, checked before any is read.
        let aligns = [8, 8, 8, 4, 2, 1, 4, 1, 8, 2, 8, 4];
        let check = |params: &mut [*mut std::ffi::c_void]|
        // SAFETY: each pointer points at a value of the type read, alive for the closure's call
        // (and aligned for it: checked first).
        unsafe {
            assert_eq!(params.len(), 12);
            for (at, (param, align)) in params.iter().zip(aligns).enumerate() {
                assert_eq!(*param as usize % align, 0, "parameter {at} is not {align}-byte aligned");
            }
            assert_eq!(*params[0].cast::<u64>(), 0x1000);
            assert_eq!(*params[2].cast::<u64>(), 77);
            assert_eq!(*params[3].cast::<Shape>(), shape);
            assert_eq!(*params[4].cast::<u16>(), bias.to_bits());
            assert_eq!(*params[5].cast::<u8>(), 1);
            assert_eq!(*params[6].cast::<i32>(), -4);
            assert_eq!(*params[7].cast::<u8>(), 200);
            assert_eq!(*params[8].cast::<f64>(), 0.125);
            assert_eq!(*params[9].cast::<u16>(), h.to_bits());
            assert_eq!(*params[10].cast::<i64>(), -(1 << 40));
            assert_eq!(*params[11].cast::<u32>(), 9);
        };
        let tuple =
            (0x1000u64, 0x2000u64, 77u64, by_value(shape), bias, true, -4i32, 200u8, 0.125f64, h, -(1i64 << 40), 9u32);
        assert!(tuple.own().is_some());
        tuple.with_params(check);
        let list = KernelArgList::new()
            .arg(0x1000u64)
            .arg(0x2000u64)
            .arg(77u64)
            .arg(by_value(shape))
            .arg(bias)
            .arg(true)
            .arg(-4i32)
            .arg(200u8)
            .arg(0.125f64)
            .arg(h)
            .arg(-(1i64 << 40))
            .arg(9u32);
        assert!(list.own().is_some());
        list.with_params(check);
        let mut uses = 0;
        list.buffer_uses(&mut |_| uses += 1);
        assert_eq!(uses, 0, "plain values hand the kernel no memory");
        let long = (0..40u32).fold(KernelArgList::new(), |list, i| list.arg(i));
        long.with_params(|params| {
            assert_eq!(params.len(), 40);
            // SAFETY: each points at a live u32.
            assert!((0..40).all(|i| unsafe { *params[i].cast::<u32>() } == i as u32));
        });
        // Values of every alignment side by side, more bytes of them than the inline storage
        // holds: each at its own aligned place, none overwriting another.
        let block = |seed: u64| std::array::from_fn::<u64, 32, _>(|i| seed * 1000 + i as u64);
        let wide = (0..3u64)
            .fold(KernelArgList::new(), |list, seed| list.arg(true).arg(by_value(block(seed))).arg(h).arg(-7i8));
        wide.with_params(|params| {
            assert_eq!(params.len(), 12);
            for chunk in params.chunks(4) {
                assert_eq!(chunk[1] as usize % std::mem::align_of::<[u64; 32]>(), 0, "aligned for its type");
                assert_eq!(chunk[2] as usize % 2, 0, "aligned for its type");
            }
            for (k, chunk) in params.chunks(4).enumerate() {
                // SAFETY: each points at a live value of the type read.
                unsafe {
                    assert_eq!(*chunk[0].cast::<u8>(), 1);
                    assert_eq!(*chunk[1].cast::<[u64; 32]>(), block(k as u64));
                    assert_eq!(*chunk[2].cast::<u16>(), h.to_bits());
                    assert_eq!(*chunk[3].cast::<i8>(), -7);
                }
            }
        });
        // A value aligned beyond the list's storage words still reaches the launch aligned.
        #[derive(Clone, Copy, Debug, PartialEq)]
        #[repr(C, align(128))]
        struct Wide([u32; 4]);
        let over = KernelArgList::new().arg(5u8).arg(by_value(Wide([1, 2, 3, 4]))).arg(6u16);
        over.with_params(|params| {
            assert_eq!(params[1] as usize % 128, 0);
            // SAFETY: each points at a live value of the type read.
            unsafe {
                assert_eq!(
                    (*params[0].cast::<u8>(), *params[1].cast::<Wide>(), *params[2].cast::<u16>()),
                    (5, Wide([1, 2, 3, 4]), 6)
                );
            }
        });
    }

    #[test]
    fn launch_configs_cover_every_element_and_respect_the_cap() {
        use super::LaunchConfig;
        let one = LaunchConfig::for_elements(0, 1056);
        assert_eq!((one.grid, one.block), ((1, 1, 1), (256, 1, 1)), "an empty launch still has one block");
        assert_eq!(LaunchConfig::for_elements(256, 1056).grid.0, 1);
        assert_eq!(LaunchConfig::for_elements(257, 1056).grid.0, 2);
        assert_eq!(LaunchConfig::for_elements(1 << 30, 1056).grid.0, 1056, "grid-stride kernels cover the rest");
        assert_eq!(LaunchConfig::for_elements(1 << 30, 0).grid.0, 1, "a zero cap still launches");
    }
}
