//! The crate-wide error: [`Error`], the one error a user matches on, and [`Result`], its
//! `Result`. It sits above every layer it wraps, and each layer keeps its own error at its own
//! level, naming nothing above it:
//!
//! | error | layer | defined in |
//! | --- | --- | --- |
//! | [`CudaError`] ([`LoadError`], [`DriverError`], [`CaptureError`], [`IpcError`]) | the loader, the driver calls, the safe wrappers, [`Engine`](crate::Engine) | `cuda_error.rs` |
//! | [`NcclError`] | NCCL ([`nccl`](crate::nccl)) | `nccl/result.rs` |
//! | [`RendezvousError`] | the meeting of a pipeline's processes ([`rendezvous`](crate::rendezvous)) | `rendezvous.rs` |
//! | [`ConfigError`] | the settings: the pipeline's and the job secret's | `config_error.rs` |
//! | [`PpError`] ([`SlotState`]) | the pipeline runtime's misuse | `error/pipeline.rs` |
//! | [`Error`] | every call of the crate; the pipeline's calls return it | this file |
//!
//! Each of those converts into [`Error`], so `?` works from every layer's call in a function that
//! returns [`Result`] (`ppnrt::Result`), and so does `Err(e.into())` for any of them:
//!
//! ```no_run
//! fn run() -> ppnrt::Result<()> {
//!     let engine = ppnrt::Engine::new(0)?; // a CudaError
//!     let _config = ppnrt::PpConfig::from_env()?; // a ConfigError
//!     let _id = ppnrt::nccl::NcclUniqueId::new()?; // an NcclError
//!     engine.stream()?.synchronize()?; // a CudaError through a shared stream
//!     let cuda_err: ppnrt::CudaError = engine.synchronize().unwrap_err();
//!     Err(cuda_err.into())
//! }
//! ```
//!
//! The layers' own `Result`s are [`CudaResult`] (`Result<T, CudaError>`) and
//! `nccl::Result` (`Result<T, NcclError>`). A conversion with nothing to name its target, such as
//! `.map_err(Into::into)?` or `Err(e.into())?`, has many candidates (every layer's error converts
//! into [`Error`], and [`CudaError`] also into [`NcclError`]), so the compiler cannot choose
//! (E0283): write `?` alone, or `Error::from(e)`.
//!
//! ```compile_fail,E0283
//! fn run() -> ppnrt::Result<()> {
//!     let _engine = ppnrt::Engine::new(0).map_err(|e| e.into())?; // into what? E0283
//!     Ok(())
//! }
//! ```

mod pipeline;

pub use crate::config_error::ConfigError;
pub use crate::cuda_error::{
    CaptureError, CudaError, CudaResult, DriverError, DriverVersion, IpcError, LoadAttempt, LoadError,
};
pub use crate::nccl::NcclError;
pub use crate::rendezvous::RendezvousError;
pub use pipeline::{PpError, SlotState};

/// Everything that can go wrong in this crate: the pipeline's calls return it, and the CUDA
/// layers' [`CudaError`] converts into it (`?` works across the layers).
///
/// ```
/// let cause = ppnrt::ConfigError { setting: "PPNRT_STAGES", value: "x".into(), reason: "not a number".into() };
/// let err = ppnrt::Error::PipelineBuild { config: "PPNRT_STAGES=\"x\"".into(), source: Box::new(cause.into()) };
/// assert_eq!(
///     ppnrt::error::chain(&err),
///     "building the pipeline runtime failed for PPNRT_STAGES=\"x\"\n  caused by: invalid pipeline configuration: PPNRT_STAGES=\"x\": not a number"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The driver could not be loaded, a driver call failed, or a safe wrapper refused its
    /// arguments: see [`CudaError`].
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// A pipeline configuration that cannot be built (see [`ConfigError`]).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The pipeline runtime could not be built; names the configuration and the cause.
    #[error("building the pipeline runtime failed for {config}")]
    PipelineBuild {
        /// The configuration, as given.
        config: String,
        /// Why the build failed.
        source: Box<Error>,
    },
    /// Misuse of the pipeline runtime (a stage, boundary or slot out of range, a slot in the
    /// wrong state, `rx` of another length or type than `tx` sent): see [`PpError`].
    #[error(transparent)]
    Pipeline(#[from] PpError),
    /// NCCL could not be loaded, is too old, or an NCCL call failed: see [`NcclError`]. (A
    /// CUDA error met inside an NCCL call converts to [`Error::Cuda`].)
    #[error(transparent)]
    Nccl(NcclError),
    /// The processes of a pipeline could not meet: see [`RendezvousError`].
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
}

impl From<NcclError> for Error {
    fn from(error: NcclError) -> Error {
        match error {
            NcclError::Cuda(cuda) => Error::Cuda(cuda),
            other => Error::Nccl(other),
        }
    }
}

impl From<DriverError> for Error {
    fn from(error: DriverError) -> Error {
        Error::Cuda(CudaError::Driver(error))
    }
}

impl From<CaptureError> for Error {
    fn from(error: CaptureError) -> Error {
        Error::Cuda(CudaError::Capture(error))
    }
}

impl From<IpcError> for Error {
    fn from(error: IpcError) -> Error {
        Error::Cuda(CudaError::Ipc(error))
    }
}

impl From<LoadError> for Error {
    fn from(error: LoadError) -> Error {
        Error::Cuda(CudaError::Load(error))
    }
}

impl Error {
    /// The CUDA layers' error this one is, or that caused it: an [`Error::Cuda`], or one inside a
    /// failed build ([`Error::PipelineBuild`], at any depth) or an NCCL call's CUDA error. What a
    /// caller asks to tell "no GPU here" ([`CudaError::Load`]) from any other failure:
    ///
    /// ```
    /// let no_driver = ppnrt::CudaError::Load(ppnrt::LoadError::LibraryNotFound { tried: vec![] });
    /// let err = ppnrt::Error::PipelineBuild { config: "2 stages".into(), source: Box::new(no_driver.into()) };
    /// assert!(matches!(err.as_cuda(), Some(ppnrt::CudaError::Load(_))));
    /// ```
    pub fn as_cuda(&self) -> Option<&CudaError> {
        match self {
            Error::Cuda(cuda) | Error::Nccl(NcclError::Cuda(cuda)) => Some(cuda),
            Error::PipelineBuild { source, .. } => source.as_cuda(),
            _ => None,
        }
    }
}

/// `Result` with the crate's [`Error`]: what the pipeline's calls return, and what an
/// application's own functions can return to use `?` on every call of the crate.
///
/// ```no_run
/// use ppnrt::{Engine, PpNRt};
///
/// /// Stage 0 of one step: each call's own error (PpError, CudaError) converts with `?`.
/// fn first_stage(rt: &PpNRt, primary: &Engine) -> ppnrt::Result<usize> {
///     let _stage = rt.enter(0)?;
///     let x = rt.engine(0, primary)?.htod(&[1.0f32; 64])?;
///     rt.tx(0, &x, 64)
/// }
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error and each of its causes (`source()`), one per line after the first, each printed
/// once: what a `main` that reports errors should print.
///
/// ```
/// let cause = ppnrt::ConfigError { setting: "PPNRT_STAGES", value: "x".into(), reason: "not a number".into() };
/// let err = ppnrt::Error::PipelineBuild { config: "PPNRT_STAGES=\"x\"".into(), source: Box::new(cause.into()) };
/// assert_eq!(
///     ppnrt::error::chain(&err),
///     "building the pipeline runtime failed for PPNRT_STAGES=\"x\"\n  caused by: invalid pipeline configuration: PPNRT_STAGES=\"x\": not a number"
/// );
/// ```
pub fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(e) = cause {
        text.push_str("\n  caused by: ");
        text.push_str(&e.to_string());
        cause = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_driver() -> CudaError {
        CudaError::Load(LoadError::LibraryNotFound { tried: vec![] })
    }

    #[test]
    fn as_cuda_sees_through_a_failed_build() {
        let direct = Error::from(no_driver());
        assert_eq!(direct.as_cuda(), Some(&no_driver()));
        let built = Error::PipelineBuild { config: "2 stages".into(), source: Box::new(direct) };
        assert_eq!(built.as_cuda(), Some(&no_driver()), "a build error's cause is looked at");
        let twice = Error::PipelineBuild { config: "again".into(), source: Box::new(built) };
        assert_eq!(twice.as_cuda(), Some(&no_driver()), "at any depth");
        let config = ConfigError { setting: "PPNRT_STAGES", value: "x".into(), reason: "not a number".into() };
        let not_cuda = Error::PipelineBuild { config: "x".into(), source: Box::new(config.into()) };
        assert_eq!(not_cuda.as_cuda(), None, "a cause that is no CUDA error");
        assert_eq!(Error::Nccl(NcclError::Cuda(no_driver())).as_cuda(), Some(&no_driver()));
    }

    #[test]
    fn every_layers_error_converts_with_a_question_mark() {
        fn lift<E>(error: E) -> Result<()>
        where
            Error: From<E>,
        {
            Err(error)?
        }
        assert!(matches!(lift(no_driver()), Err(Error::Cuda(_))));
        assert!(matches!(lift(LoadError::LibraryNotFound { tried: vec![] }), Err(Error::Cuda(CudaError::Load(_)))));
        assert!(matches!(lift(NcclError::Cuda(no_driver())), Err(Error::Cuda(_))), "NCCL's CUDA error is CUDA's");
        assert!(matches!(lift(NcclError::Aborted { what: "x" }), Err(Error::Nccl(_))));
        assert!(matches!(lift(PpError::ZeroLength { boundary: 0 }), Err(Error::Pipeline(_))));
        let config = ConfigError { setting: "PPNRT_STAGES", value: "x".into(), reason: "r".into() };
        assert!(matches!(lift(config), Err(Error::Config(_))));
    }
}
