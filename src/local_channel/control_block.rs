//! The control block two ranks of one host share: a `memfd` of a fixed layout, created by the
//! receiving rank, passed over the local channel and mapped by both.
//!
//! Layout (little-endian, every field an aligned 64-bit word, the block a whole number of
//! 64-byte lines):
//!
//! | offset | field |
//! | --- | --- |
//! | 0 | magic, [`ControlBlock::MAGIC`] |
//! | 8 | version ([`ControlBlock::VERSION`], low 32 bits) and slot count (high 32 bits) |
//! | 16 | the heartbeat of side [`Side::Receiver`] (a count it raises while alive) |
//! | 24 | the heartbeat of side [`Side::Sender`] |
//! | 32 | announcements taken: one past the last step whose announcement the receiver took |
//! | 40 | the sleep word (32 bits; the word's other half unused): 1 while the receiver sleeps (a futex wait on it) rather than watching the block |
//! | 64 + 64·s | slot `s`: "filled", one past the last step copied in (by the sender's stream) |
//! | 72 + 64·s | slot `s`: "consumed", the step the slot is free for (raised by the receiver) |
//! | 64·(1 + slots + a) | announcement line `a`: one past the step it announces (0: none) |
//! | 64·(1 + slots + a) + 8 | announcement line `a`: the step's element count |
//!
//! Step `k`'s announcement goes into line `k mod` [`ANNOUNCEMENTS`](ControlBlock::ANNOUNCEMENTS),
//! written by the sender only once the receiver took step `k - ANNOUNCEMENTS`'s (the count at 32
//! says so): its count first, then its step. A word is stored with release ordering (a stream's
//! write, after a fence) and loaded with acquire ordering: whoever sees a value sees what it
//! announces. The sleep word and the announcement's step are each stored, then the other read,
//! with sequentially consistent fences between: a sender that announces while the receiver falls
//! asleep either sees it asleep (and wakes it: the word back to 0, then a futex wake, so a wake
//! that comes before the receiver's wait begins ends that wait at once) or is seen by its last
//! look. The futex is the shared kind (the mapping is the same memory in both processes), so a
//! wake costs the sender one system call and no record.
//!
//! Safety model: the other process may write any value into the block at any time, so the
//! block is only ever read and written through atomics (no `&mut`, no plain loads), and every
//! value read is data, never trusted as a size or an index. Its size cannot change under the
//! mapping: the creator seals the memfd against shrinking and growing before it is passed, and
//! [`ControlBlock::open`] refuses a descriptor without those seals (a shrunk file would make an
//! access fault), of another size, magic, version or slot count. The mapping lives as long as
//! the value; the descriptor is kept so it can be passed again.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use super::LocalChannelError;

/// Which rank of the pair a heartbeat belongs to.
///
/// ```
/// use ppnrt::local_channel::{ControlBlock, Side};
///
/// let block = ControlBlock::create(4)?;
/// let before = block.heartbeat(Side::Receiver);
/// block.beat(Side::Receiver);
/// assert!(block.heartbeat(Side::Receiver) > before);
/// assert_eq!(block.heartbeat(Side::Sender), 0);
/// # Ok::<(), ppnrt::local_channel::LocalChannelError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The receiving rank (which creates the block and owns the slots).
    Receiver,
    /// The sending rank.
    Sender,
}

/// A mapped control block (see the module docs).
///
/// ```
/// use ppnrt::local_channel::{ControlBlock, Side};
///
/// let block = ControlBlock::create(2)?;
/// block.publish_filled(1, 7);
/// assert_eq!(block.filled(1), 7);
/// block.beat(Side::Sender);
/// assert_eq!(block.heartbeat(Side::Sender), 1);
/// // The other rank maps the same memory from the descriptor passed to it.
/// let other = ControlBlock::open(block.fd().try_clone_to_owned().unwrap(), 2)?;
/// assert_eq!(other.filled(1), 7);
/// // Of another slot count, the block is refused.
/// assert!(ControlBlock::open(block.fd().try_clone_to_owned().unwrap(), 3).is_err());
/// # Ok::<(), ppnrt::local_channel::LocalChannelError>(())
/// ```
#[derive(Debug)]
pub struct ControlBlock {
    base: NonNull<AtomicU64>,
    bytes: usize,
    slots: usize,
    fd: OwnedFd,
}

// SAFETY: the block is reached only through atomics (`&AtomicU64` of the mapping), which any
// thread may use at once; the mapping and the descriptor belong to the value and are released
// once, by its drop.
unsafe impl Send for ControlBlock {}
// SAFETY: as for `Send`: every access is atomic.
unsafe impl Sync for ControlBlock {}
static_assertions::assert_impl_all!(ControlBlock: Send, Sync);

const WORD: usize = 8;
const LINE: usize = 64;
const HEARTBEAT: usize = 2;
const ANNOUNCEMENTS_TAKEN: usize = 4;
const RECEIVER_ASLEEP: usize = 5;
/// A futex wake's count for every waiter.
const WAKE_ALL: u32 = i32::MAX as u32;
const FILLED: usize = 0;
const CONSUMED: usize = 1;
const ANNOUNCED_STEP: usize = 0;
const ANNOUNCED_COUNT: usize = 1;

impl ControlBlock {
    /// The block's magic.
    pub const MAGIC: u64 = u64::from_le_bytes(*b"PPNRTCB1");
    /// The layout's version.
    pub const VERSION: u32 = 3;
    /// The most slots a block holds (as many as a ring may have).
    pub const MAX_SLOTS: usize = 64;
    /// The announcement lines: how many steps the sender may announce in the block ahead of the
    /// receiver's takes.
    pub const ANNOUNCEMENTS: usize = 32;

    /// The byte size of a block of `slots` slots.
    pub const fn byte_size(slots: usize) -> usize {
        LINE + LINE * slots + LINE * Self::ANNOUNCEMENTS
    }

    /// Creates a block of `slots` slots (a sealed memfd), every counter 0, mapped.
    ///
    /// # Errors
    /// [`LocalChannelError::Block`] for a slot count of 0 or past [`MAX_SLOTS`](Self::MAX_SLOTS);
    /// [`LocalChannelError::Io`] when the memfd cannot be made, sized, sealed or mapped.
    #[doc(alias = "memfd_create")]
    pub fn create(slots: usize) -> Result<ControlBlock, LocalChannelError> {
        if slots == 0 || slots > Self::MAX_SLOTS {
            return Err(LocalChannelError::Block {
                what: format!("{slots} slot(s): a block holds 1 to {}", Self::MAX_SLOTS),
            });
        }
        let io = |what: &'static str| move |e: rustix::io::Errno| LocalChannelError::io(what, e.into());
        let fd = rustix::fs::memfd_create("ppnrt-control", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(io("memfd_create"))?;
        let bytes = Self::byte_size(slots);
        rustix::fs::ftruncate(&fd, bytes as u64).map_err(io("sizing the control block"))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(io("sealing the control block's size"))?;
        let block = ControlBlock::map(fd, bytes, slots)?;
        block.word(1).store(u64::from(Self::VERSION) | ((slots as u64) << 32), Ordering::Relaxed);
        // The magic last: a block whose magic reads right is whole.
        block.word(0).store(Self::MAGIC, Ordering::Release);
        Ok(block)
    }

    /// Maps the block passed as `fd`, expected to hold `slots` slots.
    ///
    /// # Errors
    /// [`LocalChannelError::Block`] naming what is wrong: a descriptor that is no memfd (naming
    /// it and its file type: a socket, pipe, directory...), not sealed against shrinking and
    /// growing, another byte size than [`byte_size(slots)`](Self::byte_size), another magic,
    /// version or slot count. [`LocalChannelError::Io`] when it cannot be examined or mapped.
    pub fn open(fd: OwnedFd, slots: usize) -> Result<ControlBlock, LocalChannelError> {
        if slots == 0 || slots > Self::MAX_SLOTS {
            return Err(LocalChannelError::Block {
                what: format!("{slots} slot(s): a block holds 1 to {}", Self::MAX_SLOTS),
            });
        }
        let io = |what: &'static str| move |e: rustix::io::Errno| LocalChannelError::io(what, e.into());
        let seals = match rustix::fs::fcntl_get_seals(&fd) {
            Ok(seals) => seals,
            // Only a memfd (or another shmem file) has seals: a socket, pipe, directory or file
            // of another file system is none.
            Err(rustix::io::Errno::INVAL) => {
                return Err(LocalChannelError::Block {
                    what: format!("descriptor {} is not a memfd ({})", fd.as_raw_fd(), file_type(&fd)),
                });
            }
            Err(e) => return Err(io("reading the control block's seals")(e)),
        };
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(LocalChannelError::Block {
                what: "its size is not sealed (it could shrink under the mapping)".into(),
            });
        }
        let expected = Self::byte_size(slots);
        let found = rustix::fs::fstat(&fd).map_err(io("examining the control block"))?.st_size;
        if u64::try_from(found).ok() != Some(expected as u64) {
            return Err(LocalChannelError::Block {
                what: format!("{found} bytes, {expected} expected for {slots} slot(s)"),
            });
        }
        let block = ControlBlock::map(fd, expected, slots)?;
        let magic = block.word(0).load(Ordering::Acquire);
        if magic != Self::MAGIC {
            return Err(LocalChannelError::Block {
                what: format!("magic {magic:#018x}, {:#018x} expected", Self::MAGIC),
            });
        }
        let shape = block.word(1).load(Ordering::Relaxed);
        let (version, found_slots) = (shape as u32, (shape >> 32) as usize);
        if version != Self::VERSION {
            return Err(LocalChannelError::Block {
                what: format!("layout version {version}, {} expected", Self::VERSION),
            });
        }
        if found_slots != slots {
            return Err(LocalChannelError::Block { what: format!("{found_slots} slot(s), {slots} expected") });
        }
        Ok(block)
    }

    fn map(fd: OwnedFd, bytes: usize, slots: usize) -> Result<ControlBlock, LocalChannelError> {
        // SAFETY: a fresh shared mapping chosen by the kernel (no fixed address, so nothing of
        // this process is replaced) of `bytes` bytes of `fd`, whose size is `bytes` and sealed
        // against change (checked, or made so, by the callers); it is unmapped once, by `drop`.
        let at = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), bytes, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, &fd, 0)
        }
        .map_err(|e| LocalChannelError::io("mapping the control block", e.into()))?;
        let base = NonNull::new(at.cast::<AtomicU64>()).expect("mmap returns no null mapping");
        Ok(ControlBlock { base, bytes, slots, fd })
    }

    /// The `at`-th word of the block.
    fn word(&self, at: usize) -> &AtomicU64 {
        assert!((at + 1) * WORD <= self.bytes, "word {at} is past the block");
        // SAFETY: the mapping is page-aligned and `bytes` long (`at` checked above), lives as
        // long as `self`, and is only ever reached through atomics here and in the other
        // process, so an `&AtomicU64` into it is valid for the borrow.
        unsafe { &*self.base.as_ptr().add(at) }
    }

    fn slot_word(&self, slot: usize, field: usize) -> &AtomicU64 {
        assert!(slot < self.slots, "slot {slot} of a block of {} slot(s)", self.slots);
        self.word((LINE + LINE * slot) / WORD + field)
    }

    /// The block's descriptor, to pass to the other rank.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The slot count.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The byte size.
    pub fn byte_len(&self) -> usize {
        self.bytes
    }

    /// Slot `slot`'s "filled" word (0: nothing copied in yet). Panics for a slot past the block.
    pub fn filled(&self, slot: usize) -> u64 {
        self.slot_word(slot, FILLED).load(Ordering::Acquire)
    }

    /// Stores `step` into slot `slot`'s "filled" word (a plain store: it may lower the word).
    pub fn publish_filled(&self, slot: usize, step: u64) {
        self.slot_word(slot, FILLED).store(step, Ordering::Release);
    }

    /// Slot `slot`'s "consumed" word (0 when the block is created).
    pub fn consumed(&self, slot: usize) -> u64 {
        self.slot_word(slot, CONSUMED).load(Ordering::Acquire)
    }

    /// Stores `step` into slot `slot`'s "consumed" word (a plain store: it may lower the word).
    pub fn publish_consumed(&self, slot: usize, step: u64) {
        self.slot_word(slot, CONSUMED).store(step, Ordering::Release);
    }

    /// The index of slot `slot`'s "filled" word among the block's 64-bit words.
    pub(crate) fn filled_word(&self, slot: usize) -> usize {
        assert!(slot < self.slots, "slot {slot} of a block of {} slot(s)", self.slots);
        (LINE + LINE * slot) / WORD + FILLED
    }

    /// Raises slot `slot`'s "consumed" word to `step`, never lowering it (an atomic maximum, so
    /// a larger value written meanwhile by either process stays).
    pub(crate) fn raise_consumed(&self, slot: usize, step: u64) {
        self.slot_word(slot, CONSUMED).fetch_max(step, Ordering::AcqRel);
    }

    /// Releases slot `slot`'s "consumed" word at `value` (below `2^63`): afterwards every
    /// stream's wait for a step up to `value` on it is met (see [`release_word`]).
    pub(crate) fn release_consumed(&self, slot: usize, value: u64) {
        release_word(self.slot_word(slot, CONSUMED), value);
    }

    /// Releases slot `slot`'s "filled" word at `value`, as [`release_consumed`](Self::release_consumed).
    pub(crate) fn release_filled(&self, slot: usize, value: u64) {
        release_word(self.slot_word(slot, FILLED), value);
    }

    /// The mapping's first byte (page-aligned, [`byte_len`](Self::byte_len) bytes, alive as long
    /// as `self`): for registering it with the driver.
    pub(crate) fn as_mut_ptr(&self) -> *mut std::ffi::c_void {
        self.base.as_ptr().cast()
    }

    fn announcement_word(&self, step: u64, field: usize) -> &AtomicU64 {
        let line = (step % Self::ANNOUNCEMENTS as u64) as usize;
        self.word((LINE + LINE * self.slots + LINE * line) / WORD + field)
    }

    /// Announces step `step` of `count` elements in its line (the count, then the step), where
    /// the receiver finds it with [`announced`](Self::announced). The sender writes a line only
    /// once [`announcements_taken`](Self::announcements_taken) shows the receiver took the step
    /// it held before (`step < taken + ANNOUNCEMENTS`).
    ///
    /// ```
    /// use ppnrt::local_channel::ControlBlock;
    ///
    /// let block = ControlBlock::create(2)?;
    /// assert_eq!(block.announced(0), None);
    /// block.announce(0, 1024);
    /// assert_eq!(block.announced(0), Some(1024));
    /// // Step 32 shares step 0's line: not announced until written there.
    /// assert_eq!(block.announced(ControlBlock::ANNOUNCEMENTS as u64), None);
    /// # Ok::<(), ppnrt::local_channel::LocalChannelError>(())
    /// ```
    pub fn announce(&self, step: u64, count: u64) {
        self.announcement_word(step, ANNOUNCED_COUNT).store(count, Ordering::Relaxed);
        self.announcement_word(step, ANNOUNCED_STEP).store(step.wrapping_add(1), Ordering::Release);
    }

    /// The element count of step `step`'s announcement, when its line holds it (`None` when it
    /// holds another step's or none). A value the other process wrote: data, never trusted.
    pub fn announced(&self, step: u64) -> Option<u64> {
        let held = self.announcement_word(step, ANNOUNCED_STEP).load(Ordering::Acquire);
        (held == step.wrapping_add(1)).then(|| self.announcement_word(step, ANNOUNCED_COUNT).load(Ordering::Relaxed))
    }

    /// One past the last step whose announcement the receiver took (0 when none).
    pub fn announcements_taken(&self) -> u64 {
        self.word(ANNOUNCEMENTS_TAKEN).load(Ordering::Acquire)
    }

    /// Records that the receiver took the announcements of every step up to `step` (an atomic
    /// maximum): their lines may be written again.
    pub fn take_announcements(&self, step: u64) {
        self.word(ANNOUNCEMENTS_TAKEN).fetch_max(step.wrapping_add(1), Ordering::AcqRel);
    }

    /// The sleep word: the first half of its 64-bit field, a futex word.
    fn sleep_word(&self) -> &AtomicU32 {
        let field = self.word(RECEIVER_ASLEEP);
        // SAFETY: the field is an 8-aligned word inside the mapping (checked by `word`), so its
        // first four bytes are a 4-aligned `u32` there; they are only ever reached as this
        // `AtomicU32` (by this process and, through the same layout version, by the other), and
        // the mapping lives as long as `self`.
        unsafe { &*std::ptr::from_ref(field).cast::<AtomicU32>() }
    }

    /// Marks the receiver asleep (or awake again), then fences: a later look at an announcement
    /// sees any the sender made before it looked at this word (see the module docs).
    pub fn set_receiver_asleep(&self, asleep: bool) {
        self.sleep_word().store(u32::from(asleep), Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Whether the receiver is marked asleep, after a fence.
    pub fn receiver_asleep(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.sleep_word().load(Ordering::SeqCst) != 0
    }

    /// The receiver, marked asleep and having found nothing in its last look: sleeps until the
    /// sender wakes it ([`wake_receiver`](Self::wake_receiver)) or for `timeout`, whichever
    /// comes first (at once if a wake came since it was marked asleep). It stays marked asleep:
    /// mark it awake after. A spurious wake (a signal, a peer that wakes for nothing) only ends
    /// the sleep early.
    pub fn sleep_while_asleep(&self, timeout: Duration) {
        let timeout = rustix::fs::Timespec {
            tv_sec: timeout.as_secs().try_into().unwrap_or(i64::MAX),
            tv_nsec: timeout.subsec_nanos().into(),
        };
        let _ =
            rustix::thread::futex::wait(self.sleep_word(), rustix::thread::futex::Flags::empty(), 1, Some(&timeout));
    }

    /// The sender, after a fence following what it published: wakes the receiver if it is marked
    /// asleep (the mark back to 0 first, so a wake that comes before the receiver's wait ends
    /// it at once); returns whether it did. Every waiter on the word is woken: the receiver's
    /// thread is the only one of the pair, and a stranger that maps the block and waits there
    /// first cannot take the receiver's wake (a wake of one goes to the first queued).
    pub fn wake_receiver(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        // A plain look first: a step to an awake receiver (the common case) takes no locked
        // read-modify-write of the line the receiver writes.
        let word = self.sleep_word();
        let woke =
            word.load(Ordering::SeqCst) == 1 && word.compare_exchange(1, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok();
        if woke {
            // The kernel reads the count as a signed int: `i32::MAX` is "all" (`u32::MAX` would
            // read as -1, waking one).
            let _ = rustix::thread::futex::wake(self.sleep_word(), rustix::thread::futex::Flags::empty(), WAKE_ALL);
        }
        woke
    }

    /// Raises `side`'s heartbeat (a sign of life the other side watches).
    pub fn beat(&self, side: Side) {
        self.word(HEARTBEAT + side as usize).fetch_add(1, Ordering::Release);
    }

    /// `side`'s heartbeat count.
    pub fn heartbeat(&self, side: Side) -> u64 {
        self.word(HEARTBEAT + side as usize).load(Ordering::Acquire)
    }
}

/// Sets `word` so that a stream's wait for any step up to `value` (`value < 2^63`) is met: a
/// stream compares cyclically (`(word - step) as i64 >= 0`), so a word the other process took to
/// `2^63` or past (`u64::MAX`, say) is below every step there, and an atomic maximum would keep
/// it. A word in `value..2^63` is kept (it meets every such wait and never goes down); any other
/// becomes `value`.
fn release_word(word: &AtomicU64, value: u64) {
    debug_assert!(value < 1 << 63, "a release value of {value:#x} is below step 0 for a stream");
    let _ = word.fetch_update(Ordering::AcqRel, Ordering::Acquire, |found| {
        (!(value..1 << 63).contains(&found)).then_some(value)
    });
}

/// What kind of file `fd` is, in words (for an error).
fn file_type(fd: &OwnedFd) -> &'static str {
    use rustix::fs::FileType;
    match rustix::fs::fstat(fd).map(|stat| FileType::from_raw_mode(stat.st_mode)) {
        Ok(FileType::Socket) => "a socket",
        Ok(FileType::Fifo) => "a pipe",
        Ok(FileType::Directory) => "a directory",
        Ok(FileType::RegularFile) => "a regular file",
        Ok(FileType::CharacterDevice) => "a character device",
        Ok(FileType::BlockDevice) => "a block device",
        Ok(FileType::Symlink) => "a symbolic link",
        _ => "of an unknown type",
    }
}

impl Drop for ControlBlock {
    fn drop(&mut self) {
        // SAFETY: the mapping made by `map`, of `bytes` bytes, unmapped once; no borrow of it
        // outlives `self` (every `&AtomicU64` is borrowed from `self`).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}
