//! Kernel arguments: [`KernelArgs`], the parameters of one launch in order (a tuple of up to
//! [`MAX_KERNEL_PARAMS`] [`KernelParam`]s, implemented here, or a
//! [`KernelArgList`](super::KernelArgList) of any number), and the device memory they hand the
//! kernel ([`BufferUses`]).

use std::ffi::c_void;

use smallvec::SmallVec;

use super::own::Own;
use super::param::{BufferUse, KernelParam};

/// The most parameters a tuple passes (a [`KernelArgList`](super::KernelArgList) passes any number).
pub const MAX_KERNEL_PARAMS: usize = 16;

/// Kernel parameters, passed in order: a tuple of up to [`MAX_KERNEL_PARAMS`] parameters, or a
/// [`KernelArgList`](super::KernelArgList) of any number.
///
/// ```no_run
/// use std::sync::Arc;
/// use ppnrt::{CudaResult, CudaStream, Function, KernelArgList, KernelArgs, LaunchConfig};
///
/// /// Launches `f` over `n` elements with whatever arguments it takes.
/// ///
/// /// # Safety
/// /// As `CudaStream::launch`: `args` match `f`'s parameters and `f` stays within them.
/// unsafe fn launch_over(stream: &Arc<CudaStream>, f: &Function, n: usize, args: impl KernelArgs) -> CudaResult<()> {
///     // SAFETY: the caller's contract.
///     unsafe { stream.launch(f, LaunchConfig::for_elements(n, 1024), args) }
/// }
///
/// # fn main() -> ppnrt::Result<()> {
/// # let engine = ppnrt::Engine::new(0)?;
/// # let stream = engine.stream()?;
/// # let f = engine.load_ptx("m", "")?.function("f")?;
/// let mut x = engine.alloc::<f32>(256)?;
/// // SAFETY (both): `f` takes (float *x, unsigned long long n) and writes x[..n].
/// unsafe { launch_over(&stream, &f, 256, (&mut x, 256u64))? }; // a tuple
/// unsafe { launch_over(&stream, &f, 256, KernelArgList::new().arg(&mut x).arg(256u64))? }; // a list
/// # Ok(()) }
/// ```
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
pub struct BufferUses<'a>(pub(super) SmallVec<[BufferUse<'a>; 8]>);

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
