//! What a rank tells the others at the rendezvous about where it runs ([`RankIdentity`]): its
//! host, its user and its devices, so that every rank can tell, from the same table, which of
//! its neighbours share its host and can reach its devices.
//!
//! A host is named by two things, both required to match ([`HostIdentity::same_host`]):
//! - the kernel's boot id (`/proc/sys/kernel/random/boot_id`), 128 random bits drawn at each
//!   boot: two machines never share it by chance, and a restarted machine gets a new one, but
//!   containers on one kernel share it (and may not share the sockets' directory, `/dev/shm` or
//!   the GPUs), and clones of one running virtual machine's snapshot keep it;
//! - the host name, which differs between containers of their own network name and between
//!   such clones once renamed, but alone is not unique (`localhost`, reused node names).
//!
//! A rank whose boot id cannot be read reports none and is on no other rank's host.
//!
//! Encoding (inside the sealed hello and member table): the boot id, the host name, the user id
//! and per device its ordinal, its UUID and the ordinals it has peer access to, every string and
//! list length-prefixed.

use std::fmt;

/// The host a rank runs on.
///
/// ```
/// use ppnrt::rendezvous::HostIdentity;
///
/// let here = HostIdentity::of_this_host();
/// let clone = HostIdentity { boot_id: here.boot_id.clone(), hostname: "elsewhere".into() };
/// // The boot id and the name must both match: a cloned machine keeps the one, not the other.
/// assert!(!here.same_host(&clone));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct HostIdentity {
    /// The kernel's boot id (empty when it could not be read).
    pub boot_id: String,
    /// The host name.
    pub hostname: String,
}

impl HostIdentity {
    /// This host's identity: the boot id from `/proc/sys/kernel/random/boot_id` (empty when it
    /// cannot be read) and the host name (`uname`).
    pub fn of_this_host() -> HostIdentity {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|id| id.trim().to_string())
            .unwrap_or_default();
        let hostname = rustix::system::uname().nodename().to_string_lossy().into_owned();
        HostIdentity { boot_id, hostname }
    }

    /// Whether `other` is this host: the same boot id (known) and the same host name.
    pub fn same_host(&self, other: &HostIdentity) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id && self.hostname == other.hostname
    }
}

/// One device of a rank: its ordinal in that rank, its UUID (`cuDeviceGetUuid`), and the
/// ordinals (in that rank) of the devices whose memory it can access (peer access).
///
/// ```
/// use ppnrt::rendezvous::{DeviceIdentity, RankIdentity};
///
/// let zero = DeviceIdentity { ordinal: 0, uuid: [1; 16], peer_access: vec![1] };
/// let one = DeviceIdentity { ordinal: 1, uuid: [2; 16], peer_access: vec![0] };
/// let rank = RankIdentity::of_this_process(vec![zero, one]);
/// assert_eq!(rank.device(1).map(|d| d.uuid), Some([2; 16]));
/// assert!(rank.peer_access(&[1; 16], &[2; 16]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct DeviceIdentity {
    /// The ordinal in the rank's process.
    pub ordinal: i32,
    /// The device's UUID.
    pub uuid: [u8; 16],
    /// The rank's ordinals of the devices this one has peer access to.
    pub peer_access: Vec<i32>,
}

/// Where a rank runs: its host, its user, its devices.
///
/// ```
/// use ppnrt::rendezvous::{HostIdentity, RankIdentity};
///
/// let me = RankIdentity::of_this_process(Vec::new());
/// assert_eq!(me.host, HostIdentity::of_this_host());
/// assert!(me.host.same_host(&HostIdentity::of_this_host()) || me.host.boot_id.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct RankIdentity {
    /// The host.
    pub host: HostIdentity,
    /// The process's user id.
    pub uid: u32,
    /// The devices the rank reports (those of its stages).
    pub devices: Vec<DeviceIdentity>,
}

/// The most devices a rank reports.
pub const MAX_DEVICES: usize = 64;
/// The longest boot id or host name.
const MAX_NAME: usize = 256;
/// The longest encoded identity.
pub(super) const MAX_IDENTITY: usize = 8 + 2 * MAX_NAME + 4 + 4 + MAX_DEVICES * (4 + 16 + 4 + 4 * MAX_DEVICES);

impl RankIdentity {
    /// This process: this host, this user, and `devices`.
    pub fn of_this_process(devices: Vec<DeviceIdentity>) -> RankIdentity {
        RankIdentity { host: HostIdentity::of_this_host(), uid: rustix::process::getuid().as_raw(), devices }
    }

    /// The device of ordinal `ordinal`, if reported.
    pub fn device(&self, ordinal: i32) -> Option<&DeviceIdentity> {
        self.devices.iter().find(|d| d.ordinal == ordinal)
    }

    /// Whether this rank reports peer access from the device of UUID `from` to that of UUID
    /// `to` (both its own).
    pub fn peer_access(&self, from: &[u8; 16], to: &[u8; 16]) -> bool {
        let Some(from) = self.devices.iter().find(|d| &d.uuid == from) else { return false };
        self.devices.iter().any(|d| &d.uuid == to && from.peer_access.contains(&d.ordinal))
    }

    /// The identity as the rendezvous sends it; `None` when it is past the bounds (a name longer
    /// than 256 bytes, more than [`MAX_DEVICES`] devices or peers).
    pub(super) fn encode(&self) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        for name in [&self.host.boot_id, &self.host.hostname] {
            if name.len() > MAX_NAME {
                return None;
            }
            out.extend_from_slice(&(name.len() as u32).to_le_bytes());
            out.extend_from_slice(name.as_bytes());
        }
        out.extend_from_slice(&self.uid.to_le_bytes());
        if self.devices.len() > MAX_DEVICES {
            return None;
        }
        out.extend_from_slice(&(self.devices.len() as u32).to_le_bytes());
        for device in &self.devices {
            if device.peer_access.len() > MAX_DEVICES {
                return None;
            }
            out.extend_from_slice(&device.ordinal.to_le_bytes());
            out.extend_from_slice(&device.uuid);
            out.extend_from_slice(&(device.peer_access.len() as u32).to_le_bytes());
            for peer in &device.peer_access {
                out.extend_from_slice(&peer.to_le_bytes());
            }
        }
        Some(out)
    }

    /// The identity `bytes` encode, whole; `None` for bytes that are none.
    pub(super) fn decode(bytes: &[u8]) -> Option<RankIdentity> {
        let mut reader = Reader { bytes, at: 0 };
        let boot_id = reader.name()?;
        let hostname = reader.name()?;
        let uid = reader.word()?;
        let count = reader.count()?;
        let mut devices = Vec::with_capacity(count);
        for _ in 0..count {
            let ordinal = reader.word()? as i32;
            let uuid: [u8; 16] = reader.take(16)?.try_into().ok()?;
            let peers = reader.count()?;
            let peer_access = (0..peers).map(|_| reader.word().map(|w| w as i32)).collect::<Option<Vec<_>>>()?;
            devices.push(DeviceIdentity { ordinal, uuid, peer_access });
        }
        (reader.at == bytes.len()).then_some(RankIdentity { host: HostIdentity { boot_id, hostname }, uid, devices })
    }
}

/// Reads an encoded identity, every step bounded by the bytes there.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let slice = self.bytes.get(self.at..self.at.checked_add(n)?)?;
        self.at += n;
        Some(slice)
    }

    fn word(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }

    /// A count of devices or peers, at most [`MAX_DEVICES`].
    fn count(&mut self) -> Option<usize> {
        let count = self.word()? as usize;
        (count <= MAX_DEVICES).then_some(count)
    }

    fn name(&mut self) -> Option<String> {
        let len = self.word()? as usize;
        if len > MAX_NAME {
            return None;
        }
        String::from_utf8(self.take(len)?.to_vec()).ok()
    }
}

impl fmt::Display for RankIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "host {} (boot {}) uid {} with {} device(s)",
            self.host.hostname,
            self.host.boot_id,
            self.uid,
            self.devices.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RankIdentity {
        RankIdentity {
            host: HostIdentity { boot_id: "5e0c0b7a-boot".into(), hostname: "node-7".into() },
            uid: 1000,
            devices: vec![
                DeviceIdentity { ordinal: 0, uuid: [1; 16], peer_access: vec![1] },
                DeviceIdentity { ordinal: 1, uuid: [2; 16], peer_access: vec![] },
            ],
        }
    }

    #[test]
    fn an_identity_survives_its_encoding_and_malformed_bytes_are_none() {
        let bytes = sample().encode().unwrap();
        assert_eq!(RankIdentity::decode(&bytes), Some(sample()));
        for cut in 0..bytes.len() {
            assert_eq!(RankIdentity::decode(&bytes[..cut]), None, "cut at {cut}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(RankIdentity::decode(&longer), None, "a byte past the identity");
        let mut too_many = sample();
        too_many.devices = vec![DeviceIdentity::default(); MAX_DEVICES + 1];
        assert_eq!(too_many.encode(), None);
        assert!(sample().encode().unwrap().len() <= MAX_IDENTITY);
    }

    #[test]
    fn the_largest_identity_fits_its_bound_and_one_past_any_bound_is_none() {
        let name = "n".repeat(MAX_NAME);
        let peers: Vec<i32> = (0..MAX_DEVICES as i32).collect();
        let device = |ordinal: i32| DeviceIdentity { ordinal, uuid: [ordinal as u8; 16], peer_access: peers.clone() };
        let largest = RankIdentity {
            host: HostIdentity { boot_id: name.clone(), hostname: name.clone() },
            uid: u32::MAX,
            devices: (0..MAX_DEVICES as i32).map(device).collect(),
        };
        let bytes = largest.encode().expect("within the bounds");
        assert_eq!(bytes.len(), MAX_IDENTITY, "the bound is the largest identity's size");
        assert_eq!(RankIdentity::decode(&bytes), Some(largest.clone()));
        let mut long_name = largest.clone();
        long_name.host.hostname.push('n');
        assert_eq!(long_name.encode(), None, "a host name of {} bytes", MAX_NAME + 1);
        let mut many_peers = largest.clone();
        many_peers.devices[0].peer_access.push(0);
        assert_eq!(many_peers.encode(), None, "{} peers", MAX_DEVICES + 1);
        // Bytes that announce past a bound are none, whatever follows.
        let mut over = bytes.clone();
        over[..4].copy_from_slice(&(MAX_NAME as u32 + 1).to_le_bytes());
        assert_eq!(RankIdentity::decode(&over), None);
    }

    #[test]
    fn one_host_needs_the_boot_id_and_the_name() {
        let here = sample().host;
        assert!(here.same_host(&here.clone()));
        assert!(!here.same_host(&HostIdentity { hostname: "node-8".into(), ..here.clone() }));
        assert!(!here.same_host(&HostIdentity { boot_id: "other".into(), ..here.clone() }));
        let unknown = HostIdentity { boot_id: String::new(), hostname: "node-7".into() };
        assert!(!unknown.same_host(&unknown.clone()), "no boot id: no other rank's host");
        let this = HostIdentity::of_this_host();
        assert!(!this.hostname.is_empty());
        assert!(this.boot_id.is_empty() || this.same_host(&HostIdentity::of_this_host()));
    }
}
