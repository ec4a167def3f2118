//! The NCCL library: found, loaded once per process and checked, its entry points kept each as
//! a `Result` (NCCL's results are mapped to [`NcclError`] in `result.rs`).

use super::*;

/// The loaded NCCL: its entry points, version and the library it came from.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let nccl = ppnrt::nccl::nccl()?; // loaded on first use, once per process
/// println!("NCCL {} from {}", nccl.version(), nccl.library());
/// # Ok(()) }
/// ```
pub struct Nccl {
    pub(super) api: NcclApi,
    pub(super) version: NcclVersion,
    pub(super) library: String,
}

pub(super) static NCCL: OnceLock<std::result::Result<Nccl, NcclError>> = OnceLock::new();

/// The process's NCCL, loaded on first use.
///
/// # Errors
/// [`NcclError`] when no library loads or it is too old; the same error on every call.
pub fn nccl() -> Result<&'static Nccl> {
    match NCCL.get_or_init(|| Nccl::load(&default_candidates())) {
        Ok(nccl) => Ok(nccl),
        Err(e) => Err(e.clone()),
    }
}

/// The candidates [`nccl`] tries, in order (see the [module docs](crate::nccl)): the path in
/// [`LIBNCCL_PATH_VAR`] alone if it is set; else the wheel's libraries that [`WheelSearch`] finds
/// (by listing directories, never by running a program), then `libnccl.so.2`.
pub fn default_candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(LIBNCCL_PATH_VAR).filter(|path| !path.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    let mut candidates = WheelSearch::from_env().libraries();
    candidates.push("libnccl.so.2".to_string());
    candidates
}

impl Nccl {
    /// Opens the candidates in order and keeps the first usable one: it loads, has
    /// `ncclGetVersion`, and is at least [`MINIMUM_VERSION`]. A candidate that is not (too old,
    /// say, where a later one would do) is closed again and the next one tried. Does not touch
    /// the process's NCCL; [`nccl`] calls this once.
    ///
    /// # Errors
    /// With one candidate, why it is not usable: [`NcclError::NotFound`] (it does not load),
    /// [`NcclError::MissingEntryPoint`] (`ncclGetVersion`) or [`NcclError::TooOld`]. With several
    /// and none usable, [`NcclError::NotFound`] naming every candidate and why it was skipped.
    pub fn load(candidates: &[String]) -> std::result::Result<Nccl, NcclError> {
        let mut tried = Vec::new();
        let mut unusable = None;
        for candidate in candidates {
            let skipped = match Nccl::open(candidate) {
                Ok(nccl) => return Ok(nccl),
                Err(skipped) => skipped,
            };
            tried.push(LoadAttempt {
                candidate: candidate.clone(),
                reason: match &skipped {
                    NcclError::NotFound { tried } => tried.iter().map(|attempt| attempt.reason.clone()).collect(),
                    other => other.to_string(),
                },
            });
            unusable = Some(skipped);
        }
        match unusable {
            Some(error) if candidates.len() == 1 => Err(error),
            _ => Err(NcclError::NotFound { tried }),
        }
    }

    /// Opens one candidate and checks it (see [`load`](Self::load)); why it is not usable
    /// otherwise (a library that does not load is [`NcclError::NotFound`] with its one attempt).
    fn open(candidate: &str) -> std::result::Result<Nccl, NcclError> {
        // SAFETY: opening NCCL runs its initialisers, which have no preconditions on the caller;
        // the handle moves into the entry-point table and stays open while the table lives.
        let library = unsafe { libloading::Library::new(candidate) }.map_err(|e| NcclError::NotFound {
            tried: vec![LoadAttempt { candidate: candidate.to_string(), reason: e.to_string() }],
        })?;
        // SAFETY: `from_library` resolves symbols by name and stores function pointers whose
        // types bindgen derived from nccl.h; a missing symbol is kept as an error.
        let api = unsafe { NcclApi::from_library(library) }
            .map_err(|_| NcclError::MissingEntryPoint { library: candidate.to_string(), symbol: "(library handle)" })?;
        let get_version = api
            .ncclGetVersion
            .as_ref()
            .map_err(|_| NcclError::MissingEntryPoint { library: candidate.to_string(), symbol: "ncclGetVersion" })?;
        let mut code: c_int = 0;
        // SAFETY: ncclGetVersion writes one int through a valid pointer.
        let result = unsafe { get_version(&mut code) };
        if result != ncclResult_t::ncclSuccess {
            return Err(NcclError::NotFound {
                tried: vec![LoadAttempt {
                    candidate: candidate.to_string(),
                    reason: format!("ncclGetVersion failed ({})", result.0),
                }],
            });
        }
        let version = NcclVersion::from_code(code);
        if version < MINIMUM_VERSION {
            return Err(NcclError::TooOld {
                library: candidate.to_string(),
                found: version,
                required: MINIMUM_VERSION,
            });
        }
        Ok(Nccl { api, version, library: candidate.to_string() })
    }

    /// The raw entry points.
    pub fn api(&self) -> &NcclApi {
        &self.api
    }

    /// The library's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The library name or path that was opened.
    pub fn library(&self) -> &str {
        &self.library
    }
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl").field("library", &self.library).field("version", &self.version).finish()
    }
}

impl Nccl {
    /// Maps an NCCL result of `call` to `Ok(())` or the typed error.
    pub(super) fn check(&self, call: &'static str, result: ncclResult_t) -> Result<()> {
        if result == ncclResult_t::ncclSuccess {
            return Ok(());
        }
        let text = |ptr: *const std::ffi::c_char| {
            if ptr.is_null() {
                String::new()
            } else {
                // SAFETY: NCCL returns NUL-terminated static (or communicator-owned) strings.
                unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
            }
        };
        let description = match self.api.ncclGetErrorString.as_ref() {
            // SAFETY: takes any result code, returns a static string.
            Ok(entry) => text(unsafe { entry(result) }),
            Err(_) => String::new(),
        };
        let last_error = match self.api.ncclGetLastError.as_ref() {
            // SAFETY: a null communicator asks for the calling thread's last error.
            Ok(entry) => text(unsafe { entry(std::ptr::null_mut()) }),
            Err(_) => String::new(),
        };
        Err(NcclError::Call { call, code: result.0, name: super::result::result_name(result), description, last_error })
    }

    pub(super) fn missing(&self, symbol: &'static str) -> NcclError {
        NcclError::MissingEntryPoint { library: self.library.clone(), symbol }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_typed_error_listing_each_attempt() {
        let candidates = vec!["/nonexistent/libnccl.so.2".to_string()];
        match Nccl::load(&candidates) {
            Err(NcclError::NotFound { tried }) => {
                assert_eq!(tried.len(), 1);
                assert_eq!(tried[0].candidate, candidates[0]);
            }
            other => panic!("expected NotFound, got {other:?}"),
        }
    }
}
