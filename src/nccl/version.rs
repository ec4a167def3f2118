//! NCCL's versions: [`NcclVersion`], decoded from `ncclGetVersion`'s integer, and the versions
//! the crate's features need (the oldest it loads, the first whose calls graphs may capture, the
//! first that joins communicators without blocking).

use std::fmt;

/// The oldest NCCL this crate uses: 2.7.0, the first with point-to-point send/recv and groups.
pub const MINIMUM_VERSION: NcclVersion = NcclVersion { major: 2, minor: 7, patch: 0 };

/// The oldest NCCL whose operations boundaries from other ranks capture into CUDA graphs
/// ([`PpConfig::nccl_recv_graphs`](crate::PpConfig::nccl_recv_graphs)): 2.13.0, the first that
/// documents mixing graph launches with ordinary calls on one communicator
/// (`NCCL_GRAPH_MIXING_SUPPORT`). With an older NCCL every receive is NCCL's call.
pub const GRAPH_MIXING_VERSION: NcclVersion = NcclVersion { major: 2, minor: 13, patch: 0 };

/// The oldest NCCL whose communicators can be joined without blocking (`ncclCommInitRankConfig`
/// with `blocking = 0`, and `ncclCommGetAsyncError` reporting `ncclInProgress` until the join
/// completed): 2.14.0. With an older one [`NcclComm::init_rank_watched`](super::NcclComm::init_rank_watched) joins blocking.
pub const NONBLOCKING_VERSION: NcclVersion = NcclVersion { major: 2, minor: 14, patch: 0 };

/// An NCCL version, decoded from `ncclGetVersion`'s integer.
///
/// ```
/// use ppnrt::nccl::NcclVersion;
///
/// let version = NcclVersion::from_code(22_005); // NCCL 2.20.5
/// assert_eq!((version.major, version.minor, version.patch), (2, 20, 5));
/// assert!(version >= NcclVersion { major: 2, minor: 13, patch: 0 });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer: `major*1000 + minor*100 + patch` up to 2.8,
    /// `major*10000 + minor*100 + patch` from 2.9 on.
    pub fn from_code(code: i32) -> NcclVersion {
        let code = code.max(0) as u32;
        if code >= 10_000 {
            NcclVersion { major: code / 10_000, minor: (code % 10_000) / 100, patch: code % 100 }
        } else {
            NcclVersion { major: code / 1000, minor: (code % 1000) / 100, patch: code % 100 }
        }
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(NcclVersion::from_code(2708), NcclVersion { major: 2, minor: 7, patch: 8 });
        assert_eq!(NcclVersion::from_code(23203), NcclVersion { major: 2, minor: 32, patch: 3 });
        assert_eq!(NcclVersion::from_code(21805).to_string(), "2.18.5");
        assert!(NcclVersion::from_code(2608) < MINIMUM_VERSION);
        assert!(NcclVersion::from_code(2700) >= MINIMUM_VERSION);
    }
}
