//! Loading the CUDA driver library at run time.
//!
//! The library is opened once per process, on first use, and never closed (closing the driver
//! while other threads or `atexit` handlers still use it can crash at exit). The outcome, success
//! or a [`LoadError`], is decided once and returned to every later caller.
//!
//! Candidates, in order: the path in `PPNRT_LIBCUDA_PATH` if it is set (then nothing else is
//! tried), else `libcuda.so.1`, then `libcuda.so` (`nvcuda.dll` on Windows). After opening,
//! `cuInit(0)` runs and `cuDriverGetVersion` must report at least CUDA 12.0.
//!
//! Every entry point is looked up when the library opens and kept as a `Result`: a symbol that an
//! older driver lacks fails only the calls that need it, with [`CudaError::MissingEntryPoint`]. Where
//! the bindings name a newer version of an entry point than an older driver has (the `_v2` of
//! `cuEventElapsedTime`), the older version is used instead. An empty `PPNRT_LIBCUDA_PATH` counts
//! as unset.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::cuda_error::{CudaError, DriverError, DriverVersion, LoadAttempt, LoadError, Result};
use crate::sys::{CUresult, DriverApi};

/// Environment variable naming the driver library to load instead of the default candidates.
pub const LIBCUDA_PATH_VAR: &str = "PPNRT_LIBCUDA_PATH";

/// The loaded driver: its entry points, version and the library it came from.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let driver = ppnrt::loader::driver()?; // loaded once per process
/// println!("CUDA {} from {}", driver.version(), driver.library());
/// # Ok(()) }
/// ```
pub struct Driver {
    api: DriverApi,
    version: DriverVersion,
    library: String,
}

static DRIVER: OnceLock<std::result::Result<Driver, LoadError>> = OnceLock::new();

/// The driver in [`DRIVER`] once it loaded (null before, and for good after a failed load): every
/// driver call reads it, one load and one test instead of the once-cell's state and the outcome's.
static LOADED: AtomicPtr<Driver> = AtomicPtr::new(std::ptr::null_mut());

/// The process's driver, loaded and initialised on first use.
///
/// # Errors
/// [`CudaError::Load`] when no library could be opened, `cuInit` failed or the driver is too old;
/// the same error on every call.
#[inline]
pub fn driver() -> Result<&'static Driver> {
    // Acquire: the driver's fields, written before its address was published, are seen.
    let loaded = LOADED.load(Ordering::Acquire);
    if !loaded.is_null() {
        // SAFETY: `LOADED` is only ever set to the address of the `Driver` inside `DRIVER`'s
        // outcome (`load_once`), a static that is set once and never dropped or moved.
        return Ok(unsafe { &*loaded });
    }
    load_once()
}

/// [`driver`] before [`LOADED`] is set: loads the driver once (or finds it loaded, or failed).
#[cold]
#[inline(never)]
fn load_once() -> Result<&'static Driver> {
    match DRIVER.get_or_init(|| Driver::load(&default_candidates())) {
        Ok(driver) => {
            LOADED.store(std::ptr::from_ref(driver).cast_mut(), Ordering::Release);
            Ok(driver)
        }
        Err(e) => Err(CudaError::Load(e.clone())),
    }
}

/// The candidates tried by [`driver`], in order.
pub fn default_candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(LIBCUDA_PATH_VAR).filter(|path| !path.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    if cfg!(windows) {
        vec!["nvcuda.dll".to_string()]
    } else {
        vec!["libcuda.so.1".to_string(), "libcuda.so".to_string()]
    }
}

impl Driver {
    /// Opens the first candidate that loads, initialises it and checks its version. Does not
    /// touch the process-wide driver; [`driver`] calls this once.
    ///
    /// # Errors
    /// See [`LoadError`].
    pub fn load(candidates: &[String]) -> std::result::Result<Driver, LoadError> {
        let mut tried = Vec::new();
        for candidate in candidates {
            match open_library(candidate) {
                Ok(library) => return Driver::init(library, candidate.clone()),
                Err(reason) => tried.push(LoadAttempt { candidate: candidate.clone(), reason }),
            }
        }
        Err(LoadError::LibraryNotFound { tried })
    }

    fn init(library: libloading::Library, name: String) -> std::result::Result<Driver, LoadError> {
        // SAFETY: `from_library` resolves symbols by name and stores function pointers whose
        // types bindgen derived from cuda.h; the library is the CUDA driver (or fails the
        // lookups, which are kept as errors). The library value moves into the struct and stays
        // open as long as the pointers live.
        let mut api = unsafe { DriverApi::from_library(library) }
            .map_err(|_| LoadError::EntryPointMissing { library: name.clone(), symbol: "(library handle)" })?;
        resolve_older_names(&mut api, &name);
        let missing = |symbol| LoadError::EntryPointMissing { library: name.clone(), symbol };
        let init = api.cuInit.as_ref().map_err(|_| missing("cuInit"))?;
        let get_version = api.cuDriverGetVersion.as_ref().map_err(|_| missing("cuDriverGetVersion"))?;
        // SAFETY: cuInit takes a flags word that must be 0.
        let code = unsafe { init(0) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(LoadError::InitFailed { library: name, source: describe(&api, "cuInit", code) });
        }
        let mut raw: c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        let code = unsafe { get_version(&mut raw) };
        if code != CUresult::CUDA_SUCCESS {
            return Err(LoadError::InitFailed { library: name, source: describe(&api, "cuDriverGetVersion", code) });
        }
        let version = DriverVersion::from_raw(raw);
        if version < DriverVersion::MINIMUM {
            return Err(LoadError::DriverTooOld { library: name, found: version, required: DriverVersion::MINIMUM });
        }
        Ok(Driver { api, version, library: name })
    }

    /// The raw entry points (see [`crate::sys`]).
    #[inline]
    pub fn api(&self) -> &DriverApi {
        &self.api
    }

    /// The CUDA version the driver supports.
    pub fn version(&self) -> DriverVersion {
        self.version
    }

    /// The library name or path that was opened.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Maps a result code of `call` to `Ok(())` or the typed error.
    #[inline]
    pub fn check(&self, call: &'static str, code: CUresult) -> Result<()> {
        if code == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(self.error(call, code)) }
    }

    /// The typed error for a failed `call`: [`CudaError::ContextUnusable`] for sticky codes, else
    /// [`CudaError::Driver`].
    #[cold]
    pub fn error(&self, call: &'static str, code: CUresult) -> CudaError {
        let source = describe(&self.api, call, code);
        if crate::cuda_error::is_sticky_code(code) {
            CudaError::ContextUnusable { device: current_device(&self.api), source }
        } else {
            CudaError::Driver(source)
        }
    }

    /// The error for an entry point this driver lacks.
    #[cold]
    pub fn missing(&self, symbol: &'static str) -> CudaError {
        CudaError::MissingEntryPoint { symbol, driver: self.version }
    }
}

/// Entry points that the generated bindings name by their newest version: when the driver lacks
/// that version, the older one (same C signature) serves, so that every driver from CUDA 12.0 on
/// gets every call it can make. `cuEventElapsedTime_v2` came with CUDA 12.8.
fn resolve_older_names(api: &mut DriverApi, library: &str) {
    if api.cuEventElapsedTime_v2.is_ok() {
        return;
    }
    let Ok(handle) = open_library(library) else { return };
    // SAFETY: `cuEventElapsedTime` has the C signature of `cuEventElapsedTime_v2` (float*,
    // CUevent, CUevent) -> CUresult in every cuda.h that declares it.
    if let Ok(older) = unsafe { handle.get(b"cuEventElapsedTime\0") } {
        api.cuEventElapsedTime_v2 = Ok(*older);
    }
    // The pointer must stay valid: keep the handle open for the life of the process (the library
    // is never unloaded, see the module doc).
    std::mem::forget(handle);
}

/// The device of the calling thread's current context, or -1.
fn current_device(api: &DriverApi) -> i32 {
    let Ok(get_device) = api.cuCtxGetDevice.as_ref() else { return -1 };
    let mut device: c_int = -1;
    // SAFETY: cuCtxGetDevice writes one int through a valid pointer.
    let code = unsafe { get_device(&mut device) };
    if code == CUresult::CUDA_SUCCESS { device } else { -1 }
}

fn describe(api: &DriverApi, call: &'static str, code: CUresult) -> DriverError {
    let text = |entry: Option<&unsafe extern "C" fn(CUresult, *mut *const std::os::raw::c_char) -> CUresult>| {
        let entry = entry?;
        let mut ptr: *const std::os::raw::c_char = std::ptr::null();
        // SAFETY: cuGetErrorName/cuGetErrorString write a pointer to a static NUL-terminated
        // string, or leave it null and return an error for unknown codes.
        let rc = unsafe { entry(code, &mut ptr) };
        if rc != CUresult::CUDA_SUCCESS || ptr.is_null() {
            return None;
        }
        // SAFETY: the driver returned a non-null pointer to a static NUL-terminated string.
        Some(unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned())
    };
    DriverError {
        call,
        code,
        name: text(api.cuGetErrorName.as_ref().ok()).unwrap_or_else(|| format!("CUresult({})", code.0)),
        description: text(api.cuGetErrorString.as_ref().ok()).unwrap_or_else(|| "unrecognized error code".into()),
    }
}

#[cfg(unix)]
fn open_library(candidate: &str) -> std::result::Result<libloading::Library, String> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // RTLD_NODELETE: the driver stays mapped even if the handle were ever closed.
    const RTLD_NODELETE: c_int = 0x1000;
    // SAFETY: opening the CUDA driver runs its initialisers, which have no preconditions on the
    // caller; the handle is kept for the life of the process.
    unsafe { Library::open(Some(candidate), RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE) }
        .map(Into::into)
        .map_err(|e| e.to_string())
}

#[cfg(not(unix))]
fn open_library(candidate: &str) -> std::result::Result<libloading::Library, String> {
    // SAFETY: as above; opening the CUDA driver runs its initialisers.
    unsafe { libloading::Library::new(candidate) }.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_are_a_typed_error_listing_each_attempt() {
        let candidates = vec!["/nonexistent/libcuda.so.1".to_string(), "libppnrt-no-such-driver.so".to_string()];
        let err = Driver::load(&candidates).err().expect("no such library can load");
        match &err {
            LoadError::LibraryNotFound { tried } => {
                assert_eq!(tried.len(), 2);
                assert_eq!(tried[0].candidate, candidates[0]);
                assert_eq!(tried[1].candidate, candidates[1]);
                assert!(!tried[0].reason.is_empty());
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(err.to_string().contains("/nonexistent/libcuda.so.1"));
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_library_that_is_not_the_driver_lacks_cu_init() {
        // libc opens everywhere on Linux and has no cuInit.
        let err = Driver::load(&["libc.so.6".to_string()]).err().expect("libc is not a CUDA driver");
        assert_eq!(err, LoadError::EntryPointMissing { library: "libc.so.6".into(), symbol: "cuInit" });
    }

    #[test]
    fn no_candidates_is_an_error_too() {
        let err = Driver::load(&[]).err().expect("nothing to load");
        assert!(matches!(err, LoadError::LibraryNotFound { ref tried } if tried.is_empty()));
        assert!(err.to_string().contains("tried nothing"));
    }
}
