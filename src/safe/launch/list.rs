//! [`KernelArgList`]: kernel parameters of any number, in the order they are added. The crate's
//! own parameters make their C value as they are added, laid out in the list's storage
//! ([`ParamWord`]s); a parameter of the caller's is kept, type-erased, and makes its value at the
//! launch.

use std::alloc::Layout;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::sync::Arc;

use smallvec::SmallVec;

use super::args::{BufferUses, KernelArgs};
use super::own::Own;
use super::param::{BufferUse, ByValue, KernelParam};
use crate::safe::memory::DeviceMemory;
use crate::safe::ordering::Use;
use crate::sys::CUdeviceptr;

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
/// The crate's own parameters (numbers, `bool`, `bf16` and `f16`, [`by_value`](super::by_value), slices and views)
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
    pub(super) fn push_deferred<P: KernelParam + 'a>(&mut self, param: P)
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

#[cfg(test)]
mod tests {
    /// What a launch hands the driver: one pointer per parameter, at the parameter's C value —
    /// `bool` as one byte, `bf16` and `f16` as their bits, a `#[repr(C)]` struct as its bytes,
    /// slices as their device addresses — for tuples of up to sixteen and lists of any length.
    #[test]
    fn every_parameter_reaches_the_launch_as_its_c_value() {
        use super::super::by_value;
        use super::{KernelArgList, KernelArgs};
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
}
