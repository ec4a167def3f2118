//! The parameter model of a launch: [`KernelParam`], one value passed as one kernel parameter
//! (its C value, and the device memory it hands the kernel as a [`BufferUse`], which the launch
//! orders), with the crate's own implementations (numbers, `bool`, `bf16` and `f16`, [`ByValue`],
//! slices and views). How a parameter enters a [`KernelArgList`] is the trait's hidden hook
//! (`push_into`): the crate's own make their C value into the list at once (`list`).

use std::sync::Arc;

use super::list::KernelArgList;
use super::own::Own;
use crate::safe::element::DeviceRepr;
use crate::safe::memory::{CudaSlice, CudaView, CudaViewMut, DeviceMemory, DeviceSlice};
use crate::safe::ordering::Use;
use crate::safe::stream::CudaStream;
use crate::sys::CUdeviceptr;

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
///
/// ```
/// use ppnrt::{KernelArgList, KernelParam};
///
/// /// A token count, which the kernels take as `unsigned int`.
/// #[derive(Clone, Copy)]
/// struct Tokens(usize);
///
/// impl KernelParam for Tokens {
///     type Raw = u32;
///     fn raw_param(&self) -> u32 {
///         self.0 as u32
///     }
/// }
///
/// let args = KernelArgList::new().arg(Tokens(128)).arg(1.5f32);
/// assert_eq!(args.len(), 2);
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
///
/// ```no_run
/// use ppnrt::{BufferUse, CudaView, KernelParam};
///
/// /// Token ids the kernels read, passed as their device address. Handing the launch their memory
/// /// makes it wait for the ids' last write (and a later write wait for the kernel).
/// struct TokenIds<'a>(CudaView<'a, u32>);
///
/// impl KernelParam for TokenIds<'_> {
///     type Raw = u64;
///     fn raw_param(&self) -> u64 {
///         self.0.raw_param()
///     }
///     fn buffer_use(&self) -> Option<BufferUse<'_>> {
///         self.0.buffer_use() // a read of the view's memory
///     }
/// }
///
/// # fn main() -> ppnrt::Result<()> {
/// # let engine = ppnrt::Engine::new(0)?;
/// let ids = engine.htod(&[3u32, 1, 4])?;
/// let args = ppnrt::KernelArgList::new().arg(TokenIds(ids.as_view())).arg(3u64);
/// # let _ = args;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy)]
pub struct BufferUse<'a> {
    pub(super) memory: &'a Arc<DeviceMemory>,
    pub(super) use_: Use,
    pub(super) address: CUdeviceptr,
}

impl<'a> BufferUse<'a> {
    fn of<T: DeviceRepr>(view: CudaView<'a, T>, use_: Use) -> BufferUse<'a> {
        BufferUse { memory: view.memory(), use_, address: view.device_ptr() }
    }

    pub(super) fn at(memory: &'a Arc<DeviceMemory>, address: CUdeviceptr, use_: Use) -> BufferUse<'a> {
        BufferUse { memory, use_, address }
    }

    /// The stream that owns the memory.
    pub(super) fn owner(&self) -> &'a Arc<CudaStream> {
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
///
/// ```
/// use ppnrt::{ByValue, KernelArgList, by_value};
///
/// /// The kernel's `struct Shape { unsigned rows, cols; float scale; }`, field for field.
/// #[derive(Clone, Copy)]
/// #[repr(C)]
/// struct Shape {
///     rows: u32,
///     cols: u32,
///     scale: f32,
/// }
///
/// let shape: ByValue<Shape> = by_value(Shape { rows: 4, cols: 8, scale: 0.5 });
/// let args = KernelArgList::new().arg(shape).arg(7u32);
/// assert_eq!(args.len(), 2);
/// ```
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
