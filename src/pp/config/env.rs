//! The environment front end of [`PpConfig`]: the `PPNRT_*` variables, read by
//! [`PpConfig::from_env`] and parsed by [`PpConfig::parse`] and
//! [`PpConfig::parse_processes`].
//!
//! A value read here is the environment's: an error about it names its variable.

use std::time::Duration;

use super::{MAX_STAGES, PpConfig, Sources};
use crate::auth::JobAccess;
use crate::error::ConfigError;
use crate::pp::plan::TransportPolicy;
use crate::pp::process_transport::ProcessTransport;

/// Variable holding the stage count.
pub const STAGES_VAR: &str = "PPNRT_STAGES";
/// Variable holding the stage→device map.
pub const DEVICES_VAR: &str = "PPNRT_DEVICES";
/// Variable holding the slot count.
pub const SLOTS_VAR: &str = "PPNRT_SLOTS";
/// Variable holding the transport policy.
pub const TRANSPORT_VAR: &str = "PPNRT_TRANSPORT";
/// Variable holding the transport of boundaries between ranks (`auto`, `ipc` or `nccl`).
pub const PROCESS_TRANSPORT_VAR: &str = "PPNRT_PROCESS_TRANSPORT";
/// Bytes reserved per slot at build ([`PpConfig::with_reserve_bytes`]); the capacity of an IPC
/// boundary's slots.
pub const RESERVE_BYTES_VAR: &str = "PPNRT_RESERVE_BYTES";
/// Variable holding the stage→process map of a pipeline that spans processes (`0,0,1,1`).
pub const RANKS_VAR: &str = "PPNRT_RANKS";
/// Variable holding this process's rank.
pub const RANK_VAR: &str = "PPNRT_RANK";
pub use crate::rendezvous::RENDEZVOUS_VAR;
/// Variable holding the bound, in milliseconds, on waits for another process (the rendezvous, a
/// receive from a peer that has not sent yet, a clean shutdown's handshake).
pub const PEER_TIMEOUT_VAR: &str = "PPNRT_PEER_TIMEOUT_MS";

impl Sources {
    /// Every setting read from the environment: errors name the variables.
    const ENV: Sources = Sources {
        stages: STAGES_VAR,
        devices: DEVICES_VAR,
        slots: SLOTS_VAR,
        ranks: RANKS_VAR,
        transport: TRANSPORT_VAR,
        process_transport: PROCESS_TRANSPORT_VAR,
        rank: RANK_VAR,
        rendezvous: RENDEZVOUS_VAR,
        peer_timeout: PEER_TIMEOUT_VAR,
    };
}

impl PpConfig {
    /// Reads the `PPNRT_*` variables (see [`PpConfig`]).
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn from_env() -> Result<PpConfig, ConfigError> {
        let read = |name: &'static str| -> Result<Option<String>, ConfigError> {
            match std::env::var(name) {
                Ok(value) => Ok(Some(value)),
                Err(std::env::VarError::NotPresent) => Ok(None),
                Err(std::env::VarError::NotUnicode(raw)) => Err(ConfigError {
                    setting: name,
                    value: raw.to_string_lossy().into_owned(),
                    reason: "not valid UTF-8".into(),
                }),
            }
        };
        PpConfig::parse(
            read(STAGES_VAR)?.as_deref(),
            read(DEVICES_VAR)?.as_deref(),
            read(SLOTS_VAR)?.as_deref(),
            read(TRANSPORT_VAR)?.as_deref(),
        )?
        .parse_processes(
            read(RANKS_VAR)?.as_deref(),
            read(RANK_VAR)?.as_deref(),
            read(RENDEZVOUS_VAR)?.as_deref(),
            read(PEER_TIMEOUT_VAR)?.as_deref(),
        )?
        .parse_process_transport(read(PROCESS_TRANSPORT_VAR)?.as_deref())?
        .parse_reserve_bytes(read(RESERVE_BYTES_VAR)?.as_deref())
        .and_then(|config| Ok(config.with_job_access(JobAccess::from_env()?)))
    }

    /// Adds the settings of a pipeline that spans processes, as [`from_env`](Self::from_env) reads
    /// them (`None` = unset): `PPNRT_RANKS`, `PPNRT_RANK`, `PPNRT_RENDEZVOUS`,
    /// `PPNRT_PEER_TIMEOUT_MS`.
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn parse_processes(
        mut self,
        ranks: Option<&str>,
        rank: Option<&str>,
        rendezvous: Option<&str>,
        peer_timeout_ms: Option<&str>,
    ) -> Result<PpConfig, ConfigError> {
        if let Some(text) = ranks {
            let bad = |reason: String| ConfigError { setting: RANKS_VAR, value: text.to_string(), reason };
            let parsed = text
                .split(',')
                .map(|item| {
                    item.trim().parse::<usize>().map_err(|e| bad(format!("`{}` is not a rank: {e}", item.trim())))
                })
                .collect::<Result<Vec<_>, _>>()?;
            if parsed.iter().any(|&r| r >= MAX_STAGES) {
                return Err(bad(format!("ranks must be below {MAX_STAGES}")));
            }
            self.ranks = Some(parsed);
            self.sources.ranks = Sources::ENV.ranks;
        }
        if let Some(text) = rank {
            self.rank = parse_count(RANK_VAR, text)?;
            self.sources.rank = Sources::ENV.rank;
        }
        if let Some(text) = rendezvous {
            self.rendezvous = Some(text.trim().to_string());
            self.sources.rendezvous = Sources::ENV.rendezvous;
        }
        if let Some(text) = peer_timeout_ms {
            let ms = parse_count(PEER_TIMEOUT_VAR, text)?;
            self.peer_timeout = Duration::from_millis(ms as u64);
            self.sources.peer_timeout = Sources::ENV.peer_timeout;
        }
        self.validate()?;
        Ok(self)
    }

    /// Adds the transport of boundaries between ranks as [`from_env`](Self::from_env) reads it
    /// (`PPNRT_PROCESS_TRANSPORT`; `None` = unset): `auto`, `ipc` or `nccl`.
    ///
    /// # Errors
    /// A [`ConfigError`] on `PPNRT_PROCESS_TRANSPORT` for another value.
    pub fn parse_process_transport(mut self, text: Option<&str>) -> Result<PpConfig, ConfigError> {
        if let Some(text) = text {
            self.process_transport = match text.trim().to_ascii_lowercase().as_str() {
                "auto" | "" => ProcessTransport::Auto,
                "ipc" => ProcessTransport::Ipc,
                "nccl" => ProcessTransport::Nccl,
                _ => {
                    return Err(ConfigError {
                        setting: PROCESS_TRANSPORT_VAR,
                        value: text.to_string(),
                        reason: "unknown transport between ranks: expected auto, ipc or nccl".into(),
                    });
                }
            };
            self.sources.process_transport = Sources::ENV.process_transport;
        }
        Ok(self)
    }

    /// Adds the bytes reserved per slot as [`from_env`](Self::from_env) reads them
    /// (`PPNRT_RESERVE_BYTES`; `None` = unset): a whole number of bytes.
    ///
    /// # Errors
    /// A [`ConfigError`] on `PPNRT_RESERVE_BYTES` for a value that is not a whole number.
    pub fn parse_reserve_bytes(self, text: Option<&str>) -> Result<PpConfig, ConfigError> {
        match text {
            Some(text) => Ok(self.with_reserve_bytes(parse_count(RESERVE_BYTES_VAR, text)?)),
            None => Ok(self),
        }
    }

    /// Parses the four settings as [`from_env`](Self::from_env) reads them (`None` = unset).
    ///
    /// # Errors
    /// A [`ConfigError`] for a malformed or inconsistent value.
    pub fn parse(
        stages: Option<&str>,
        devices: Option<&str>,
        slots: Option<&str>,
        transport: Option<&str>,
    ) -> Result<PpConfig, ConfigError> {
        let devices = devices.map(parse_devices).transpose()?;
        let n_stages = match stages {
            Some(text) => parse_count(STAGES_VAR, text)?,
            None => devices.as_ref().map_or(1, Vec::len),
        };
        let config = PpConfig {
            devices,
            n_stages,
            slots: slots.map(|t| parse_count(SLOTS_VAR, t)).transpose()?.unwrap_or(2),
            transport: transport.map(parse_transport).transpose()?.unwrap_or_default(),
            sources: Sources::ENV,
            ..PpConfig::default()
        };
        config.validate()?;
        Ok(config)
    }
}

fn parse_transport(text: &str) -> Result<TransportPolicy, ConfigError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "auto" | "" => Ok(TransportPolicy::Auto),
        "peer" => Ok(TransportPolicy::Peer),
        "staged" | "host" | "host_staged" | "hoststaged" => Ok(TransportPolicy::Staged),
        _ => Err(ConfigError {
            setting: TRANSPORT_VAR,
            value: text.to_string(),
            reason: "unknown transport: expected auto, peer or staged".into(),
        }),
    }
}

fn parse_count(setting: &'static str, text: &str) -> Result<usize, ConfigError> {
    text.trim().parse::<usize>().map_err(|e| ConfigError {
        setting,
        value: text.to_string(),
        reason: format!("not a whole number: {e}"),
    })
}

fn parse_devices(text: &str) -> Result<Vec<i32>, ConfigError> {
    let bad = |reason: String| ConfigError { setting: DEVICES_VAR, value: text.to_string(), reason };
    if text.trim().is_empty() {
        return Err(bad("empty device list".into()));
    }
    text.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse::<i32>().map_err(|e| bad(format!("`{item}` is not a device ordinal: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()
        .and_then(|devices| match devices.iter().find(|&&d| d < 0) {
            Some(d) => Err(bad(format!("device ordinal {d} is negative"))),
            None => Ok(devices),
        })
}
