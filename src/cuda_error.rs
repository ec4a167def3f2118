//! The errors of the CUDA layers (the loader, the driver calls, the safe wrappers, the engine):
//! the bottom of the crate's errors, naming nothing above the bindings.
//!
//! Every layer keeps its own error at its own level: this file for the CUDA layers, NCCL's
//! [`NcclError`](crate::NcclError) in `nccl/result.rs`, the rendezvous's in `rendezvous.rs`, and the
//! crate-wide [`Error`](crate::Error) above them all in `error.rs`, which every one of them
//! converts into with `?`. The loader reports with these types too, so they cannot live in the
//! driver-call layer (`result`) that calls the loader: they sit below both.
//!
//! [`CudaError`] keeps loader failures ([`LoadError`]: no library, no `cuInit`, a driver too old)
//! apart from driver failures ([`DriverError`]: a call returned a `CUresult` other than success)
//! and from misuse caught on the host before anything is enqueued (each variant names the bad
//! value). Errors are `Clone` so that a failed build can be returned again, unchanged, to every
//! later caller (see [`PpNRt::get`](crate::PpNRt::get)).

use std::fmt;

use crate::sys::CUresult;

/// A CUDA driver version, as `cuDriverGetVersion` reports it (`1000 * major + 10 * minor`).
///
/// ```
/// use ppnrt::DriverVersion;
///
/// let version = DriverVersion::from_raw(12080); // as cuDriverGetVersion writes it
/// assert_eq!(version.to_string(), "12.8");
/// assert!(version >= DriverVersion::MINIMUM);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DriverVersion {
    /// Major CUDA version (the 13 of 13.0).
    pub major: u32,
    /// Minor CUDA version (the 0 of 13.0).
    pub minor: u32,
}

impl DriverVersion {
    /// The oldest driver this crate accepts: CUDA 12.0.
    pub const MINIMUM: DriverVersion = DriverVersion { major: 12, minor: 0 };

    /// Decodes the integer `cuDriverGetVersion` writes (`13000` is 13.0, `12080` is 12.8).
    /// Negative values (never written by a real driver) decode as 0.0.
    pub fn from_raw(raw: i32) -> DriverVersion {
        let raw = u32::try_from(raw).unwrap_or(0);
        DriverVersion { major: raw / 1000, minor: (raw % 1000) / 10 }
    }
}

impl fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// One failed attempt to open the driver library.
///
/// ```no_run
/// use ppnrt::{CudaError, LoadAttempt, LoadError};
///
/// if let Err(CudaError::Load(LoadError::LibraryNotFound { tried })) = ppnrt::Engine::new(0) {
///     for LoadAttempt { candidate, reason } in &tried {
///         eprintln!("{candidate}: {reason}");
///     }
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// The name or path handed to the dynamic loader.
    pub candidate: String,
    /// What the dynamic loader said.
    pub reason: String,
}

impl fmt::Display for LoadAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}`: {}", self.candidate, self.reason)
    }
}

/// Why the CUDA driver could not be brought up. Every public entry point returns it (inside
/// [`CudaError::Load`]) when the driver is unusable; it is decided once per process.
///
/// ```no_run
/// use ppnrt::{CudaError, Engine, LoadError};
///
/// match Engine::new(0) {
///     Ok(engine) => println!("device {}", engine.ordinal()),
///     Err(CudaError::Load(LoadError::DriverTooOld { found, required, .. })) => {
///         eprintln!("the driver supports CUDA {found}: install one for CUDA {required} or newer")
///     }
///     Err(CudaError::Load(e)) => eprintln!("no usable CUDA driver: {e}"),
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate library could be opened.
    #[error(
        "no CUDA driver library could be loaded (install the NVIDIA driver, which provides \
         libcuda.so.1, or set PPNRT_LIBCUDA_PATH to the library's path); tried {}",
        list(.tried)
    )]
    LibraryNotFound {
        /// Every candidate tried, in order, with the loader's reason.
        tried: Vec<LoadAttempt>,
    },
    /// The library opened but lacks an entry point that loading itself needs.
    #[error("the CUDA driver library `{library}` has no entry point `{symbol}`")]
    EntryPointMissing {
        /// The library that was opened.
        library: String,
        /// The missing symbol.
        symbol: &'static str,
    },
    /// `cuInit` or `cuDriverGetVersion` failed.
    #[error("the CUDA driver `{library}` failed to initialise")]
    InitFailed {
        /// The library that was opened.
        library: String,
        /// The failing call.
        source: DriverError,
    },
    /// The driver is older than [`DriverVersion::MINIMUM`].
    #[error("the CUDA driver `{library}` supports CUDA {found}; ppnrt needs CUDA {required} or newer")]
    DriverTooOld {
        /// The library that was opened.
        library: String,
        /// The version the driver reported.
        found: DriverVersion,
        /// The oldest version accepted.
        required: DriverVersion,
    },
}

fn list(tried: &[LoadAttempt]) -> String {
    if tried.is_empty() {
        return "nothing".to_string();
    }
    tried.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

/// A driver call that returned something other than `CUDA_SUCCESS`.
///
/// ```no_run
/// use ppnrt::CudaError;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// match engine.alloc::<f32>(1 << 40) {
///     Ok(x) => drop(x),
///     Err(CudaError::Driver(e)) => {
///         eprintln!("{} returned {}: {}", e.call, e.name, e.description);
///         assert!(!e.is_sticky(), "out of memory leaves the context usable");
///     }
///     Err(e) => return Err(e.into()),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call} failed with {name} ({}): {description}", .code.0)]
pub struct DriverError {
    /// The driver entry point, as exported (`cuMemcpyAsync`, `cuMemAlloc_v2`).
    pub call: &'static str,
    /// The result code.
    pub code: CUresult,
    /// The driver's name for the code (`cuGetErrorName`), e.g. `CUDA_ERROR_INVALID_VALUE`.
    pub name: String,
    /// The driver's text for the code (`cuGetErrorString`).
    pub description: String,
}

impl DriverError {
    /// True for the codes after which the context is unusable until the process ends: a kernel
    /// trapped, faulted or hit an illegal instruction or address, or the hardware failed.
    pub fn is_sticky(&self) -> bool {
        is_sticky_code(self.code)
    }

    /// True for the codes with which a module load says that this driver or device cannot run
    /// the code given (PTX of a newer ISA than the driver knows, no usable image, JIT
    /// unavailable): the context stays usable, only that module is missing.
    pub fn is_unrunnable_code(&self) -> bool {
        matches!(
            self.code,
            CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
                | CUresult::CUDA_ERROR_INVALID_PTX
                | CUresult::CUDA_ERROR_INVALID_IMAGE
                | CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
                | CUresult::CUDA_ERROR_JIT_COMPILER_NOT_FOUND
                | CUresult::CUDA_ERROR_JIT_COMPILATION_DISABLED
        )
    }
}

pub(crate) fn is_sticky_code(code: CUresult) -> bool {
    matches!(
        code,
        CUresult::CUDA_ERROR_ILLEGAL_ADDRESS
            | CUresult::CUDA_ERROR_LAUNCH_FAILED
            | CUresult::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUresult::CUDA_ERROR_MISALIGNED_ADDRESS
            | CUresult::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUresult::CUDA_ERROR_INVALID_PC
            | CUresult::CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUresult::CUDA_ERROR_ASSERT
            | CUresult::CUDA_ERROR_ECC_UNCORRECTABLE
            | CUresult::CUDA_ERROR_LAUNCH_TIMEOUT
            | CUresult::CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// What can go wrong below the pipeline: loading the driver, a driver call, or a misuse of the
/// safe wrappers caught before anything is enqueued. The pipeline's calls return the crate's
/// [`Error`](crate::Error), which holds this one as `Error::Cuda`.
///
/// ```no_run
/// use ppnrt::CudaError;
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let x = engine.htod(&[1u32, 2, 3])?;
/// let mut y = engine.alloc::<u32>(4)?;
/// // Misuse is refused on the host, naming the bad values; nothing was enqueued.
/// match engine.dtod(&x, &mut y) {
///     Err(e @ CudaError::LengthMismatch { .. }) => eprintln!("{e}"),
///     // A lost context (a kernel trapped): only a new process gets the device back.
///     Err(CudaError::ContextUnusable { device, .. }) => eprintln!("device {device} is lost"),
///     other => other?,
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// The driver could not be loaded or initialised.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// A driver call failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A driver call failed with a sticky code: the context of `device` is unusable for the rest
    /// of the process. Work on other devices may go on.
    #[error("the CUDA context of device {device} is unusable: {source}")]
    ContextUnusable {
        /// The device whose context is lost (-1 when unknown).
        device: i32,
        /// The call that reported it.
        source: DriverError,
    },
    /// The loaded driver lacks an entry point this call needs (it is older than the API used).
    #[error("the CUDA driver (CUDA {driver}) has no entry point `{symbol}`")]
    MissingEntryPoint {
        /// The missing symbol.
        symbol: &'static str,
        /// The loaded driver's version.
        driver: DriverVersion,
    },
    /// A device ordinal past the devices present.
    #[error("device ordinal {ordinal} is out of range: {count} device(s) present")]
    DeviceOutOfRange {
        /// The ordinal asked for.
        ordinal: i32,
        /// How many devices the driver reports.
        count: i32,
    },
    /// Two lengths that must agree differ (copies, kernel arguments).
    #[error("{what}: length mismatch, expected {expected} element(s), got {found}")]
    LengthMismatch {
        /// The operation.
        what: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A range outside a buffer.
    #[error("{what}: range {start}..{end} is out of bounds for a buffer of {len} element(s)")]
    OutOfBounds {
        /// The operation.
        what: &'static str,
        /// Start of the range.
        start: usize,
        /// End of the range (exclusive).
        end: usize,
        /// The buffer's length.
        len: usize,
    },
    /// An object of one device used where another device is required.
    #[error("{what}: expected device {expected}, found device {found}")]
    WrongDevice {
        /// The operation and the object concerned.
        what: &'static str,
        /// The device required.
        expected: i32,
        /// The device of the object given.
        found: i32,
    },
    /// A handle of another context where this crate's context of the device (its primary
    /// context) is required.
    #[error("{what} (device {device})")]
    WrongContext {
        /// The operation and the handle concerned.
        what: &'static str,
        /// The device.
        device: i32,
    },
    /// A device address without the alignment an operation needs.
    #[error("{what}: address {address:#x} is not {align}-byte aligned")]
    Misaligned {
        /// The operation.
        what: &'static str,
        /// The address given.
        address: u64,
        /// The alignment required, in bytes.
        align: usize,
    },
    /// A byte size that overflows `usize`.
    #[error("{what}: {count} element(s) of {elem_size} byte(s) overflow the address space")]
    SizeOverflow {
        /// The operation.
        what: &'static str,
        /// Element count.
        count: usize,
        /// Element size in bytes.
        elem_size: usize,
    },
    /// A string passed to the driver holds a NUL byte before its end.
    #[error("{what} holds a NUL byte at offset {position}")]
    InteriorNul {
        /// The string's role.
        what: &'static str,
        /// Offset of the first NUL.
        position: usize,
    },
    /// Bytes given as a module image that are no whole PTX text, cubin or fatbin (checked before
    /// the driver reads them: it reads an image without a length).
    #[error("module `{module}`: {reason}")]
    InvalidModuleImage {
        /// The module's name.
        module: String,
        /// What is wrong with the bytes.
        reason: String,
    },
    /// A kernel name that the module does not define.
    #[error("module `{module}` has no kernel `{kernel}`")]
    KernelNotFound {
        /// The module's name.
        module: String,
        /// The kernel asked for.
        kernel: String,
    },
    /// Device memory that the SMs of the device running a kernel cannot reach: memory of another
    /// device that came from a stream-ordered pool (pools are not peer-mapped).
    #[error(
        "{what}: memory of device {memory_device} at {address:#x} is pool memory, which device {device}'s kernels cannot reach"
    )]
    NotPeerReachable {
        /// The operation.
        what: &'static str,
        /// The device whose kernel would touch the memory.
        device: i32,
        /// The device the memory lives on.
        memory_device: i32,
        /// The address.
        address: u64,
    },
    /// The calling thread's ambient-stream state is gone: the call came from another
    /// thread-local's destructor during thread exit.
    #[error("{what}: the thread's ambient stream state has already been destroyed (thread exit)")]
    ThreadExiting {
        /// The operation.
        what: &'static str,
    },
    /// Elapsed time asked of an event created without timing.
    #[error("elapsed time needs two events created with timing")]
    EventWithoutTiming,
    /// Peer access between two devices is not possible.
    #[error("device {from} cannot access device {to} as a peer")]
    PeerAccessUnsupported {
        /// The accessing device.
        from: i32,
        /// The accessed device.
        to: i32,
    },
    /// Misuse of stream capture or of a graph: see [`CaptureError`].
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// The operation needs the only handle to a device allocation, but a graph that captured
    /// work on it still holds it (the graph frees it last, after its runs).
    #[error("{what}: the memory is held by a graph that captured work on it")]
    HeldByGraph {
        /// The operation.
        what: &'static str,
    },
    /// An export or import of memory or an event between processes was refused: see
    /// [`IpcError`].
    #[error(transparent)]
    Ipc(#[from] IpcError),
}

/// A refused export or import of device memory or of an event between processes
/// ([`ExportedMemory`](crate::ExportedMemory), [`ImportedMemory`](crate::ImportedMemory), the
/// legacy handles, [`IpcEvent`](crate::IpcEvent)). Each names the value that was refused; nothing
/// was mapped, allocated or exported by the call that returns one.
///
/// ```no_run
/// use std::os::fd::OwnedFd;
/// use ppnrt::{CudaError, Engine, ImportedMemory, IpcError};
///
/// # fn import(engine: &Engine, fd: OwnedFd) -> ppnrt::Result<()> {
/// // The exporter announced 1,024 `u32`s; the descriptor came over a local channel.
/// let stream = engine.stream()?;
/// match ImportedMemory::<u32>::import(&stream, fd, 1024) {
///     Ok(slots) => println!("mapped {} bytes", slots.mapped_bytes()),
///     Err(CudaError::Ipc(IpcError::SizeMismatch { bytes, exported, .. })) => {
///         eprintln!("asked for {bytes} bytes, the export holds {exported:?}")
///     }
///     Err(other) => return Err(other.into()),
/// }
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum IpcError {
    /// A size of zero bytes: nothing can be exported or imported.
    #[error("{what}: a size of 0 bytes ({len} element(s) of {elem_size} byte(s)) cannot be shared")]
    ZeroSize {
        /// The call.
        what: &'static str,
        /// The element count asked for.
        len: usize,
        /// The element type's size.
        elem_size: usize,
    },
    /// The size asked for is larger than the exported allocation.
    #[error(
        "{what}: {bytes} byte(s) asked for (mapped as {mapped}) but the exported allocation ({}) has {}",
        shared_name(*fd),
        exported.map_or_else(|| "fewer".to_string(), |n| n.to_string())
    )]
    SizeMismatch {
        /// The call.
        what: &'static str,
        /// The file descriptor imported; `None` for a legacy handle.
        fd: Option<i32>,
        /// The bytes asked for (element count times element size).
        bytes: usize,
        /// `bytes` rounded up to the allocation granularity: what would be mapped.
        mapped: usize,
        /// The exported allocation's size where the driver tells it (`None`: smaller than `mapped`).
        exported: Option<usize>,
    },
    /// The device cannot take part: the named capability is missing.
    #[error("{what}: device {device} does not support {missing}")]
    Unsupported {
        /// The call.
        what: &'static str,
        /// The device ordinal.
        device: i32,
        /// The capability (`CU_DEVICE_ATTRIBUTE_...`).
        missing: &'static str,
    },
    /// The file descriptor (or legacy handle) is no exported CUDA allocation the driver can open.
    #[error("{what}: {} is not an exported CUDA allocation: {source}", shared_name(*fd))]
    NotAnExport {
        /// The call.
        what: &'static str,
        /// The file descriptor; `None` for a legacy handle.
        fd: Option<i32>,
        /// The driver's refusal.
        source: Box<DriverError>,
    },
    /// The memory cannot be shared this way (a legacy handle needs a `cuMemAlloc` allocation of
    /// its own, not pool memory, a view or another library's memory).
    #[error("{what}: {reason}")]
    NotShareable {
        /// The call.
        what: &'static str,
        /// Why.
        reason: &'static str,
    },
}

/// Misuse of stream capture ([`StreamCapture`](crate::StreamCapture)) or of a graph
/// ([`GraphExec`](crate::GraphExec)). Nothing is enqueued by the call that returns one.
///
/// ```no_run
/// use ppnrt::{CaptureError, CaptureMode, CudaError, CudaStream};
/// # fn main() -> ppnrt::Result<()> {
/// let engine = ppnrt::Engine::new(0)?;
/// let stream = CudaStream::new(engine.context())?;
/// let capture = stream.begin_capture(CaptureMode::ThreadLocal)?;
/// // A synchronisation cannot be part of a graph: refused, and the capture is invalidated.
/// assert!(matches!(stream.synchronize(), Err(CudaError::Capture(CaptureError::IllegalCall { .. }))));
/// assert!(matches!(capture.end(), Err(CudaError::Capture(CaptureError::Invalidated { .. }))));
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptureError {
    /// A call that cannot be part of a graph (it would run or wait now: a synchronisation, a
    /// query, a host copy or host wait, an allocation with `cuMemAlloc`, a peer copy through the
    /// driver's staging) was made on a capturing stream, or on the capturing thread. The capture
    /// is invalidated: ending it returns [`CaptureError::Invalidated`]; streams, buffers and
    /// contexts stay usable.
    #[error("{call} cannot be captured into a graph; the capture in progress is invalidated")]
    IllegalCall {
        /// The call.
        call: &'static str,
    },
    /// The capture was invalidated by an illegal call (or by the driver) and produced no graph.
    #[error("the stream capture was invalidated by {call}; no graph was made")]
    Invalidated {
        /// The first illegal call, or the driver's error.
        call: String,
    },
    /// A capture was begun on a stream that is already capturing, or on a stream that cannot be
    /// captured (the legacy default stream).
    #[error("cannot begin a capture on this stream: {reason}")]
    CannotBegin {
        /// Why.
        reason: &'static str,
    },
    /// `cuGraphExecUpdate` refused the new graph (its topology or node types differ); the
    /// executable graph is unchanged. Instantiate the new graph instead.
    #[error("the executable graph cannot take the new graph's parameters: {reason}")]
    UpdateRefused {
        /// The driver's reason (`CU_GRAPH_EXEC_UPDATE_ERROR_*`).
        reason: String,
    },
}

/// How an [`IpcError`] names what was imported.
fn shared_name(fd: Option<i32>) -> String {
    fd.map_or_else(|| "legacy handle".to_string(), |fd| format!("fd {fd}"))
}

/// `Result` with [`CudaError`], the error of the CUDA layers: what the driver calls, the safe
/// wrappers and [`Engine`](crate::Engine) return. It converts
/// into the crate's [`Error`](crate::Error) with `?`.
///
/// ```no_run
/// use ppnrt::{CudaResult, CudaSlice, Engine};
///
/// /// A helper of an engine's own, below the pipeline: `?` on the safe layer's calls.
/// fn upload(engine: &Engine, x: &[f32]) -> CudaResult<CudaSlice<f32>> {
///     let mut y = engine.alloc::<f32>(x.len())?;
///     engine.htod_into(x, &mut y)?;
///     Ok(y)
/// }
///
/// # fn main() -> ppnrt::Result<()> {
/// let engine = Engine::new(0)?;
/// let y = upload(&engine, &[1.0, 2.0])?; // a CudaError converts into ppnrt::Error
/// # drop(y);
/// # Ok(()) }
/// ```
pub type CudaResult<T, E = CudaError> = std::result::Result<T, E>;

/// The CUDA layers' own name for [`CudaResult`].
pub(crate) type Result<T, E = CudaError> = CudaResult<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_version_decodes_the_raw_integer() {
        assert_eq!(DriverVersion::from_raw(13000), DriverVersion { major: 13, minor: 0 });
        assert_eq!(DriverVersion::from_raw(12080), DriverVersion { major: 12, minor: 8 });
        assert_eq!(DriverVersion::from_raw(11040), DriverVersion { major: 11, minor: 4 });
        assert_eq!(DriverVersion::from_raw(-1), DriverVersion { major: 0, minor: 0 });
        assert_eq!(DriverVersion::from_raw(12090).to_string(), "12.9");
        assert!(DriverVersion::from_raw(11080) < DriverVersion::MINIMUM);
        assert!(DriverVersion::from_raw(12000) >= DriverVersion::MINIMUM);
    }

    #[test]
    fn load_errors_list_every_attempt() {
        let err = LoadError::LibraryNotFound {
            tried: vec![
                LoadAttempt { candidate: "libcuda.so.1".into(), reason: "not found".into() },
                LoadAttempt { candidate: "libcuda.so".into(), reason: "no such file".into() },
            ],
        };
        let text = err.to_string();
        assert!(text.contains("`libcuda.so.1`: not found"), "{text}");
        assert!(text.contains("`libcuda.so`: no such file"), "{text}");
        assert!(text.contains("install the NVIDIA driver") && text.contains("PPNRT_LIBCUDA_PATH"), "{text}");
    }

    #[test]
    fn driver_errors_carry_call_code_name_and_text() {
        let err = DriverError {
            call: "cuMemAlloc_v2",
            code: CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into(),
            description: "out of memory".into(),
        };
        assert_eq!(err.to_string(), "cuMemAlloc_v2 failed with CUDA_ERROR_OUT_OF_MEMORY (2): out of memory");
        assert!(!err.is_sticky());
        assert!(!err.is_unrunnable_code(), "running out of memory is no reason to do without a module");
        let sticky = DriverError { code: CUresult::CUDA_ERROR_ILLEGAL_ADDRESS, ..err.clone() };
        assert!(sticky.is_sticky());
        assert!(!sticky.is_unrunnable_code(), "a sticky error must fail the build, not be worked around");
        for code in [CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION, CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU] {
            let unrunnable = DriverError { code, ..err.clone() };
            assert!(unrunnable.is_unrunnable_code() && !unrunnable.is_sticky(), "{code:?}");
        }
    }

    #[test]
    fn ipc_errors_name_the_value_refused() {
        let size =
            IpcError::SizeMismatch { what: "import", fd: Some(7), bytes: 80_000, mapped: 131_072, exported: None };
        let text = size.to_string();
        assert!(
            text.contains("80000") && text.contains("131072") && text.contains("fd 7") && text.contains("fewer"),
            "{text}"
        );
        let legacy = IpcError::SizeMismatch { what: "open", fd: None, bytes: 8, mapped: 8, exported: Some(4) };
        assert!(legacy.to_string().contains("legacy handle") && legacy.to_string().contains("has 4"), "{legacy}");
        let zero = IpcError::ZeroSize { what: "alloc", len: 0, elem_size: 4 };
        assert!(zero.to_string().contains("0 bytes"), "{zero}");
        let cuda: CudaError = zero.clone().into();
        assert_eq!(cuda, CudaError::Ipc(zero));
    }

    #[test]
    fn too_old_names_both_versions() {
        let err = LoadError::DriverTooOld {
            library: "libcuda.so.1".into(),
            found: DriverVersion::from_raw(11080),
            required: DriverVersion::MINIMUM,
        };
        let text = err.to_string();
        assert!(text.contains("11.8") && text.contains("12.0"), "{text}");
    }
}
