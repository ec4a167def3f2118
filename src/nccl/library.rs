//! The NCCL library: found, loaded once per process and checked, its entry points kept each as
//! a `Result`, and NCCL's results mapped to [`NcclError`].

use super::*;

/// The loaded NCCL: its entry points, version and the library it came from.
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

/// The candidates [`nccl`] tries, in order (see the [module docs](crate::nccl)).
pub fn default_candidates() -> Vec<String> {
    if let Some(path) = std::env::var_os(LIBNCCL_PATH_VAR).filter(|path| !path.is_empty()) {
        return vec![path.to_string_lossy().into_owned()];
    }
    let mut sites: Vec<PathBuf> = Vec::new();
    let mut python_dirs = |base: PathBuf, leaf: &str| {
        if let Ok(entries) = std::fs::read_dir(&base) {
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .map(|entry| entry.path())
                .filter(|path| path.file_name().is_some_and(|name| name.to_string_lossy().starts_with("python3")))
                .map(|path| path.join(leaf))
                .collect();
            found.sort();
            sites.extend(found);
        }
    };
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        python_dirs(PathBuf::from(venv).join("lib"), "site-packages");
    }
    if let Some(home) = std::env::var_os("HOME") {
        python_dirs(PathBuf::from(home).join(".local/lib"), "site-packages");
    }
    python_dirs(PathBuf::from("/usr/local/lib"), "dist-packages");
    python_dirs(PathBuf::from("/usr/local/lib"), "site-packages");
    sites.push(PathBuf::from("/usr/lib/python3/dist-packages"));
    if let Ok(out) = std::process::Command::new("python3")
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .stderr(std::process::Stdio::null())
        .output()
    {
        if out.status.success() {
            sites.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
        }
    }
    let mut candidates: Vec<String> = Vec::new();
    for site in sites {
        let library = site.join("nvidia/nccl/lib/libnccl.so.2");
        let library = library.to_string_lossy().into_owned();
        if std::path::Path::new(&library).is_file() && !candidates.contains(&library) {
            candidates.push(library);
        }
    }
    candidates.push("libnccl.so.2".to_string());
    candidates
}

impl Nccl {
    /// Opens the first candidate that loads and checks its version. Does not touch the process's
    /// NCCL; [`nccl`] calls this once.
    ///
    /// # Errors
    /// [`NcclError::NotFound`], [`NcclError::MissingEntryPoint`] (`ncclGetVersion`),
    /// [`NcclError::TooOld`].
    pub fn load(candidates: &[String]) -> std::result::Result<Nccl, NcclError> {
        let mut tried = Vec::new();
        for candidate in candidates {
            // SAFETY: opening NCCL runs its initialisers, which have no preconditions on the
            // caller; the handle moves into the entry-point table and stays open.
            let library = match unsafe { libloading::Library::new(candidate) } {
                Ok(library) => library,
                Err(e) => {
                    tried.push(LoadAttempt { candidate: candidate.clone(), reason: e.to_string() });
                    continue;
                }
            };
            // SAFETY: `from_library` resolves symbols by name and stores function pointers whose
            // types bindgen derived from nccl.h; a missing symbol is kept as an error.
            let api = unsafe { NcclApi::from_library(library) }
                .map_err(|_| NcclError::MissingEntryPoint { library: candidate.clone(), symbol: "(library handle)" })?;
            let get_version = api
                .ncclGetVersion
                .as_ref()
                .map_err(|_| NcclError::MissingEntryPoint { library: candidate.clone(), symbol: "ncclGetVersion" })?;
            let mut code: c_int = 0;
            // SAFETY: ncclGetVersion writes one int through a valid pointer.
            let result = unsafe { get_version(&mut code) };
            if result != ncclResult_t::ncclSuccess {
                tried.push(LoadAttempt {
                    candidate: candidate.clone(),
                    reason: format!("ncclGetVersion failed ({})", result.0),
                });
                continue;
            }
            let version = NcclVersion::from_code(code);
            if version < MINIMUM_VERSION {
                return Err(NcclError::TooOld {
                    library: candidate.clone(),
                    found: version,
                    required: MINIMUM_VERSION,
                });
            }
            return Ok(Nccl { api, version, library: candidate.clone() });
        }
        Err(NcclError::NotFound { tried })
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
                unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
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
        Err(NcclError::Call { call, code: result.0, name: result_name(result), description, last_error })
    }

    pub(super) fn missing(&self, symbol: &'static str) -> NcclError {
        NcclError::MissingEntryPoint { library: self.library.clone(), symbol }
    }
}

impl fmt::Debug for Nccl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nccl").field("library", &self.library).field("version", &self.version).finish()
    }
}

pub(super) fn result_name(result: ncclResult_t) -> &'static str {
    match result {
        ncclResult_t::ncclUnhandledCudaError => "ncclUnhandledCudaError",
        ncclResult_t::ncclSystemError => "ncclSystemError",
        ncclResult_t::ncclInternalError => "ncclInternalError",
        ncclResult_t::ncclInvalidArgument => "ncclInvalidArgument",
        ncclResult_t::ncclInvalidUsage => "ncclInvalidUsage",
        ncclResult_t::ncclRemoteError => "ncclRemoteError",
        ncclResult_t::ncclInProgress => "ncclInProgress",
        ncclResult_t::ncclTimeout => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}
