//! Flag words in host memory that two processes share (a [`ControlBlock`]: a memfd each of them
//! maps), registered with the driver in this process so that a stream writes and waits on them
//! (`cuMemHostRegister`, `cuMemHostGetDevicePointer`): a slice of the crate's memory that keeps
//! the block mapped and registered until every use of it has completed.
//!
//! What one process's stream writes there (`cuStreamWriteValue64`, after a fence), the other
//! process's host reads with an atomic load, and the other way round: neither side's stream ever
//! waits for the other process's stream, only for a word a host stores.
//!
//! Words only this process reaches ([`PrivateWords`]: anonymous private memory, in no file
//! another process could open, nor copied into a child on `fork`) are registered the same way: a
//! stream that waits on them waits for this process's host alone, so no other process can hold
//! the wait, and it reads the page that host stores into even after a fork.

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::cuda_error::Result;
use crate::local_channel::ControlBlock;
use crate::result::memory as raw_memory;
use crate::safe::memory::{CudaSlice, ReleaseMapping};
use crate::safe::stream::CudaStream;
use crate::sys::CUdeviceptr;

/// `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP`: every context reaches the words.
const REGISTER_FLAGS: u32 = 0x1 | 0x2;

/// Host pages that live as long as the value and may be registered with the driver.
trait HostPages: Send + Sync + std::fmt::Debug {
    /// The first byte (page-aligned).
    fn first_byte(&self) -> *mut std::ffi::c_void;
    /// The byte size (a whole number of pages and of words).
    fn bytes(&self) -> usize;
}

impl HostPages for ControlBlock {
    fn first_byte(&self) -> *mut std::ffi::c_void {
        self.as_mut_ptr()
    }
    fn bytes(&self) -> usize {
        self.byte_len()
    }
}

/// Registered pages: unregistered by the slice's release, after every use. Dropped without its
/// release (a slice whose uses could not be waited for is not freed), it keeps the pages mapped
/// for good: the device may still write into them, which must stay this process's and
/// registered.
#[derive(Debug)]
struct Registration {
    pages: Option<Arc<dyn HostPages>>,
}

impl ReleaseMapping for Registration {
    unsafe fn release(&mut self, _ptr: CUdeviceptr) -> Result<()> {
        let Some(pages) = self.pages.as_ref() else { return Ok(()) };
        // SAFETY: the pages were registered once by `register`, and no use of them is pending
        // (the caller's contract); they are still mapped (held here).
        unsafe { raw_memory::host_unregister(pages.first_byte()) }?;
        self.pages = None;
        Ok(())
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(pages) = self.pages.take() {
            // Not unregistered: never unmapped either (see the type's docs).
            std::mem::forget(pages);
        }
    }
}

/// Words of anonymous private memory (whole pages), reached only by this process's host through
/// atomics and by its streams once registered ([`register_private_words`]); zero when made.
#[derive(Debug)]
pub(crate) struct PrivateWords {
    base: NonNull<AtomicU64>,
    bytes: usize,
    words: usize,
}

// SAFETY: the pages are reached only through atomics (`&AtomicU64`), which any thread may use at
// once; the mapping belongs to the value and is unmapped once, by its drop.
unsafe impl Send for PrivateWords {}
// SAFETY: as for `Send`: every access is atomic.
unsafe impl Sync for PrivateWords {}

impl PrivateWords {
    /// `words` zeroed words (at least one page).
    ///
    /// # Errors
    /// The kernel's refusal of the mapping (`ENOMEM`), or `InvalidInput` for a count whose bytes
    /// overflow.
    pub(crate) fn new(words: usize) -> std::io::Result<PrivateWords> {
        let page = rustix::param::page_size();
        let bytes =
            words.max(1).checked_mul(8).and_then(|bytes| bytes.checked_next_multiple_of(page)).ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{words} words overflow"))
            })?;
        // SAFETY: a fresh anonymous private mapping chosen by the kernel (no fixed address, so
        // nothing of this process is replaced), `bytes` long, unmapped once by `drop`.
        let at = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                bytes,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }?;
        let base = NonNull::new(at.cast::<AtomicU64>()).expect("mmap returns no null mapping");
        let words = PrivateWords { base, bytes, words };
        // Not copied into a child on `fork`: a private page shared copy-on-write would move this
        // process to a fresh copy at its host's next store, while the registration (and every
        // stream wait on a word) keeps reading the old page, whose word never rises again.
        // SAFETY: the mapping made above, `bytes` long; the advice changes no byte of it.
        unsafe { rustix::mm::madvise(at, bytes, rustix::mm::Advice::LinuxDontFork) }?;
        Ok(words)
    }

    /// Word `at`. Panics past the words asked for.
    pub(crate) fn word(&self, at: usize) -> &AtomicU64 {
        assert!(at < self.words, "word {at} of {}", self.words);
        // SAFETY: the mapping is page-aligned and holds `words` words (`at` checked above),
        // lives as long as `self`, and is only ever reached through atomics, by this process's
        // host and (once registered) its streams.
        unsafe { &*self.base.as_ptr().add(at) }
    }
}

impl HostPages for PrivateWords {
    fn first_byte(&self) -> *mut std::ffi::c_void {
        self.base.as_ptr().cast()
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for PrivateWords {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `new`, of `bytes` bytes, unmapped once; no borrow of it
        // outlives `self`, and a registration holds `self` until it unregistered the pages.
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

/// Registers `block`'s mapping in `stream`'s context and returns its words as a slice owned by
/// `stream` (the block stays mapped as long as the slice, and is unregistered once every use of
/// the slice has completed).
///
/// # Errors
/// [`CaptureError::IllegalCall`](crate::CaptureError::IllegalCall) on a capturing stream; the
/// driver's error (a block registered already in this process is
/// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`).
pub(crate) fn register_control_block(stream: &Arc<CudaStream>, block: Arc<ControlBlock>) -> Result<CudaSlice<u64>> {
    register(stream, block)
}

/// Registers `words` in `stream`'s context, as [`register_control_block`] does a block: the
/// slice's first `words`' count of elements are its words (the rest of the page past them).
///
/// # Errors
/// As [`register_control_block`].
pub(crate) fn register_private_words(stream: &Arc<CudaStream>, words: Arc<PrivateWords>) -> Result<CudaSlice<u64>> {
    register(stream, words)
}

fn register(stream: &Arc<CudaStream>, pages: Arc<dyn HostPages>) -> Result<CudaSlice<u64>> {
    stream.refuse_in_capture("registering host flag words (cuMemHostRegister)")?;
    let _bound = stream.context().bind()?;
    let (ptr, bytes) = (pages.first_byte(), pages.bytes());
    // SAFETY: the pages are `bytes` long and stay mapped as long as `pages`, which the
    // registration holds until it unregisters the range.
    unsafe { raw_memory::host_register(ptr, bytes, REGISTER_FLAGS)? };
    let device = match raw_memory::host_device_pointer(ptr) {
        Ok(device) => device,
        Err(e) => {
            // SAFETY: registered just above, never used.
            let _ = unsafe { raw_memory::host_unregister(ptr) };
            return Err(e);
        }
    };
    let release = Box::new(Registration { pages: Some(pages) });
    // SAFETY: `device` addresses the pages' `bytes` bytes (a whole number of words) for this
    // context until the release unregisters them, which only the slice's drop calls; the range
    // was registered here once, so no other slice covers it.
    Ok(unsafe { CudaSlice::from_mapping(device, bytes / 8, stream, release, true) })
}

#[cfg(test)]
mod tests {
    use super::PrivateWords;

    /// The kernel's flags (`VmFlags` in `/proc/self/smaps`) of the mapping that starts at `at`.
    fn vm_flags(at: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let start = format!("{at:x}-");
        let mut lines = smaps.lines().skip_while(|line| !line.starts_with(&start));
        assert!(lines.next().is_some(), "no mapping starts at {at:#x}");
        let flags = lines.find_map(|line| line.strip_prefix("VmFlags:")).expect("the mapping's VmFlags");
        flags.split_whitespace().map(str::to_string).collect()
    }

    /// The words stay this process's own page across a `fork` (`dc`: not copied into the child),
    /// so no copy-on-write moves this process's stores away from the page the driver registered
    /// (a stream would then wait on a word that never rises).
    #[test]
    fn private_words_are_not_copied_into_a_forked_child() {
        let words = PrivateWords::new(4).unwrap();
        words.word(3).store(7, std::sync::atomic::Ordering::SeqCst);
        let flags = vm_flags(words.base.as_ptr() as usize);
        assert!(flags.iter().any(|flag| flag == "dc"), "the words' mapping is copied on fork: {flags:?}");
    }
}
