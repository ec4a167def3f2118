//! What a test needs of the machine, declared in one place (in the spirit of wgpu's
//! `#[gpu_test]`): a test states its [`Needs`] (GPUs, NCCL, peer access between GPUs 0 and 1)
//! and [`requires`] either hands it the [`Gpus`] it may use or prints one short line saying why
//! it skips:
//!
//! ```text
//! SKIPPED devices_are_listed_with_name_capability_and_memory: needs 1 GPU (found 0: no driver)
//! ```
//!
//! With `PPNRT_REQUIRE_GPUS=N` set (the GPU gate sets it to the GPUs it sees), a test needing no
//! more than `N` GPUs fails instead of skipping; with `PPNRT_REQUIRE_NCCL` set, so does a test
//! that needs NCCL. Peer access is the hardware's to offer: a test that needs it skips without it.
//!
//! A test keeps its `Gpus` for as long as it uses the devices: on a machine with GPUs the tests
//! of one binary then take the devices one at a time (a global capture refuses every thread's
//! synchronising calls while it lasts, and drop errors are kept process-wide). Through the
//! driver double they do not wait for each other.

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};

use ppnrt::nccl::{Nccl, NcclError};
use ppnrt::{CudaError, Device, Engine, LoadError};

use super::say;

/// What a test needs: `gpus` devices, NCCL, peer access between devices 0 and 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// Devices the test uses (ordinals `0..gpus`).
    pub gpus: i32,
    /// NCCL loads ([`ppnrt::nccl::nccl`]).
    pub nccl: bool,
    /// Devices 0 and 1 can map each other's memory (implies two GPUs).
    pub peer: bool,
}

impl Needs {
    /// `n` GPUs, nothing else.
    pub const fn gpus(n: i32) -> Needs {
        Needs { gpus: n, nccl: false, peer: false }
    }

    /// NCCL besides.
    pub const fn nccl(self) -> Needs {
        Needs { nccl: true, ..self }
    }

    /// Peer access between devices 0 and 1 besides (and so at least two GPUs).
    pub const fn peer(self) -> Needs {
        Needs { peer: true, gpus: if self.gpus < 2 { 2 } else { self.gpus }, ..self }
    }

    /// What the line says the test needs: `2 GPUs with peer access and NCCL`.
    fn describe(&self) -> String {
        let mut text = format!("{} GPU{}", self.gpus, if self.gpus == 1 { "" } else { "s" });
        if self.peer {
            text.push_str(" with peer access");
        }
        if self.nccl {
            text.push_str(" and NCCL");
        }
        text
    }
}

/// What [`requires`] hands a test that may run: the devices present and, when it asked, NCCL.
/// Keep it for the test's whole body (it holds the devices, see the module's doc).
pub struct Gpus {
    test: String,
    count: i32,
    nccl: Option<&'static Nccl>,
    _hold: Hold,
}

impl Gpus {
    /// How many devices the machine has (at least what the test asked for): a test that does
    /// more with more devices looks here.
    pub fn count(&self) -> i32 {
        self.count
    }

    /// An engine on device `ordinal` (the test fails if it cannot be made).
    pub fn engine(&self, ordinal: i32) -> Engine {
        Engine::new(ordinal).unwrap_or_else(|e| panic!("{}: Engine::new({ordinal}) failed: {e}", self.test))
    }

    /// NCCL, loaded (only when the test's needs named it).
    pub fn nccl(&self) -> &'static Nccl {
        self.nccl.unwrap_or_else(|| panic!("{}: NCCL was not among its needs", self.test))
    }

    /// Whether the machine also meets `more`, for the part of the test named `part` that needs
    /// it; when it does not, says so in one line (or fails, as [`requires`] does).
    pub fn also(&self, part: &str, more: Needs) -> bool {
        match shortfall(more) {
            None => true,
            Some(lacks) => {
                refuse(&format!("{} ({part})", self.test), more, &lacks);
                false
            }
        }
    }
}

/// The devices and libraries `test` needs, or `None` after one short line saying why it skips.
/// Fails instead under `PPNRT_REQUIRE_GPUS` / `PPNRT_REQUIRE_NCCL` (see the module's doc).
pub fn requires(test: &str, needs: Needs) -> Option<Gpus> {
    if let Some(lacks) = shortfall(needs) {
        refuse(test, needs, &lacks);
        return None;
    }
    let count = Device::count().unwrap_or(0);
    let nccl = if needs.nccl { ppnrt::nccl::nccl().ok() } else { None };
    let on_double = Device::get(0).and_then(|d| d.name()).is_ok_and(|name| name.contains("driver double"));
    Some(Gpus { test: test.to_string(), count, nccl, _hold: if on_double { Hold(None) } else { Hold::take() } })
}

/// What the machine lacks of a test's [`Needs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shortfall {
    /// Fewer GPUs: how many there are and, with none, why (`0: no driver`).
    Gpus(String),
    /// Devices 0 and 1 are not peers.
    Peer,
    /// NCCL does not load: why, in a few words.
    Nccl(String),
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Shortfall::Gpus(found) => write!(f, "found {found}"),
            Shortfall::Peer => f.write_str("GPUs 0 and 1 are not peers"),
            Shortfall::Nccl(why) => write!(f, "NCCL {why}"),
        }
    }
}

/// What the machine lacks of `needs`; `None` when it meets them.
pub fn shortfall(needs: Needs) -> Option<Shortfall> {
    let count = match Device::count() {
        Ok(count) => count,
        Err(e) if needs.gpus > 0 => return Some(Shortfall::Gpus(format!("0: {}", no_driver(&e)))),
        Err(_) => 0,
    };
    if count < needs.gpus {
        return Some(Shortfall::Gpus(count.to_string()));
    }
    if needs.peer {
        let peers = Device::peer_matrix()
            .map(|m| m[0][1].access_supported && m[1][0].access_supported)
            .unwrap_or_else(|e| panic!("the peer matrix of {count} devices: {e}"));
        if !peers {
            return Some(Shortfall::Peer);
        }
    }
    if needs.nccl {
        if let Err(e) = ppnrt::nccl::nccl() {
            return Some(Shortfall::Nccl(no_nccl(&e)));
        }
    }
    None
}

/// The line a test that skips prints: `SKIPPED test: needs 2 GPUs (found 0: no driver)`.
pub fn skip_line(test: &str, needs: Needs, lacks: &Shortfall) -> String {
    format!("SKIPPED {test}: needs {} ({lacks})", needs.describe())
}

/// Skips `test` with one line, or fails it where the environment requires what it lacks.
fn refuse(test: &str, needs: Needs, lacks: &Shortfall) {
    let line = skip_line(test, needs, lacks);
    let required: i32 = std::env::var("PPNRT_REQUIRE_GPUS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    match lacks {
        Shortfall::Gpus(_) if required >= needs.gpus => panic!("PPNRT_REQUIRE_GPUS={required}, but {line}"),
        Shortfall::Nccl(_) if std::env::var_os("PPNRT_REQUIRE_NCCL").is_some() => {
            panic!("PPNRT_REQUIRE_NCCL is set, but {line}")
        }
        _ => say(&line),
    }
}

/// A few words on why no driver could be used (the loader's own error lists every path tried).
fn no_driver(e: &CudaError) -> String {
    match e {
        CudaError::Load(LoadError::LibraryNotFound { .. }) => "no driver".into(),
        CudaError::Load(LoadError::EntryPointMissing { symbol, .. }) => format!("the driver lacks {symbol}"),
        CudaError::Load(LoadError::DriverTooOld { found, .. }) => format!("the driver supports only CUDA {found}"),
        CudaError::Load(LoadError::InitFailed { .. }) => "the driver failed to initialise".into(),
        other => short(&other.to_string()),
    }
}

/// A few words on why NCCL could not be used.
fn no_nccl(e: &NcclError) -> String {
    match e {
        NcclError::NotFound { .. } => "not found".into(),
        NcclError::TooOld { found, .. } => format!("{found} is too old"),
        NcclError::MissingEntryPoint { symbol, .. } => format!("lacks {symbol}"),
        other => short(&other.to_string()),
    }
}

/// At most 60 characters of `text`.
fn short(text: &str) -> String {
    match text.char_indices().nth(60) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text.to_string(),
    }
}

/// The devices held by one test of this process at a time (a test that asks again on the
/// thread that holds them does not wait for itself).
struct Hold(Option<MutexGuard<'static, ()>>);

static DEVICES: Mutex<()> = Mutex::new(());

thread_local! {
    static HOLDING: Cell<bool> = const { Cell::new(false) };
}

impl Hold {
    fn take() -> Hold {
        if HOLDING.with(Cell::get) {
            return Hold(None);
        }
        let guard = DEVICES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        HOLDING.with(|held| held.set(true));
        Hold(Some(guard))
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if self.0.is_some() {
            HOLDING.with(|held| held.set(false));
        }
    }
}
