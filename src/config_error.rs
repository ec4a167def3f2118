//! The settings' error: a value the pipeline's configuration ([`PpConfig`](crate::PpConfig)) or
//! the job's access ([`JobAccess`](crate::JobAccess), the job secret) refuses, named with its
//! setting, the value given and the reason.
//!
//! It has a file of its own below both of them: the job secret (`auth`) and the pipeline's
//! settings (`pp`) report with it, and the crate-wide [`Error`](crate::Error) holds it as
//! `Error::Config`, so it can live neither with one of its users nor with the umbrella.

/// A pipeline configuration that cannot be built; names the setting, the value and the reason.
///
/// ```
/// use ppnrt::{ConfigError, PpConfig};
///
/// // A value set in code is named by the builder call that set it.
/// let err: ConfigError = PpConfig::with_devices(&[]).validate().unwrap_err();
/// assert_eq!(err.setting, "PpConfig::with_devices");
/// eprintln!("{err}"); // invalid pipeline configuration: PpConfig::with_devices="0": ...
/// // In the crate-wide error it is `Error::Config`.
/// assert!(matches!(ppnrt::Error::from(err), ppnrt::Error::Config(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pipeline configuration: {setting}={value:?}: {reason}")]
pub struct ConfigError {
    /// The setting (`PPNRT_STAGES`, or the builder method's name).
    pub setting: &'static str,
    /// The value given, as text.
    pub value: String,
    /// Why it was refused.
    pub reason: String,
}
