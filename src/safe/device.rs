//! Devices and the peer matrix.
//!
//! A [`Device`] is a plain value (ordinal and handle): no lifetime to manage, `Copy`, usable from
//! any thread.

use crate::cuda_error::{CudaError, Result};
use crate::result::device as raw;
use crate::sys::{CUdevice, CUdevice_P2PAttribute, CUdevice_attribute};

/// A CUDA device, by ordinal.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// for device in ppnrt::Device::all()? {
///     let (major, minor) = device.compute_capability()?;
///     println!(
///         "{}: {} (sm_{major}{minor}, {} SMs, {} bytes)",
///         device.ordinal(),
///         device.name()?,
///         device.multiprocessor_count()?,
///         device.total_memory()?
///     );
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Device {
    ordinal: i32,
    raw: CUdevice,
}

/// What the driver says about the link from one device to another.
///
/// ```no_run
/// # fn main() -> ppnrt::Result<()> {
/// let matrix = ppnrt::Device::peer_matrix()?; // matrix[from][to]
/// for (from, row) in matrix.iter().enumerate() {
///     for (to, link) in row.iter().enumerate() {
///         if from != to && link.access_supported {
///             println!("{from} -> {to}: peer access, rank {}", link.performance_rank);
///         }
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerInfo {
    /// The source device can map the destination's memory (`cuDeviceCanAccessPeer`).
    pub access_supported: bool,
    /// The driver's relative performance rank of the link (lower is faster, 0 when unknown).
    pub performance_rank: i32,
    /// Native atomics over the link.
    pub native_atomics: bool,
}

impl Device {
    /// Number of devices the driver sees.
    ///
    /// # Errors
    /// The loader's or the driver's error.
    #[doc(alias = "cuDeviceGetCount")]
    pub fn count() -> Result<i32> {
        raw::get_count()
    }

    /// Device `ordinal`.
    ///
    /// # Errors
    /// [`CudaError::DeviceOutOfRange`] for an ordinal that is negative or past the last device.
    #[doc(alias = "cuDeviceGet")]
    pub fn get(ordinal: i32) -> Result<Device> {
        let count = Device::count()?;
        if ordinal < 0 || ordinal >= count {
            return Err(CudaError::DeviceOutOfRange { ordinal, count });
        }
        Ok(Device { ordinal, raw: raw::get(ordinal)? })
    }

    /// Every device, in ordinal order.
    ///
    /// # Errors
    /// The loader's or the driver's error.
    pub fn all() -> Result<Vec<Device>> {
        (0..Device::count()?).map(Device::get).collect()
    }

    /// The ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The raw handle.
    pub fn raw(&self) -> CUdevice {
        self.raw
    }

    /// The marketing name (`NVIDIA H200`).
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetName")]
    pub fn name(&self) -> Result<String> {
        raw::name(self.raw)
    }

    /// A device attribute.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetAttribute")]
    pub fn attribute(&self, attribute: CUdevice_attribute) -> Result<i32> {
        raw::attribute(self.raw, attribute)
    }

    /// Compute capability `(major, minor)`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        Ok((
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }

    /// Number of streaming multiprocessors.
    ///
    /// # Errors
    /// The driver's error.
    pub fn multiprocessor_count(&self) -> Result<i32> {
        self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
    }

    /// Total device memory in bytes.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceTotalMem")]
    pub fn total_memory(&self) -> Result<usize> {
        raw::total_mem(self.raw)
    }

    /// PCI bus id, `domain:bus:device.function`.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetPCIBusId")]
    pub fn pci_bus_id(&self) -> Result<String> {
        raw::pci_bus_id(self.raw)
    }

    /// The device's UUID: the same in every process that sees the device, whatever its ordinal
    /// there (`CUDA_VISIBLE_DEVICES` renumbers devices per process).
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceGetUuid")]
    pub fn uuid(&self) -> Result<[u8; 16]> {
        raw::uuid(self.raw)
    }

    /// Whether the device shares one virtual address space with the host and other devices.
    ///
    /// # Errors
    /// The driver's error.
    pub fn unified_addressing(&self) -> Result<bool> {
        Ok(self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0)
    }

    /// Whether the device supports stream-ordered allocation (`cuMemAllocAsync`).
    ///
    /// # Errors
    /// The driver's error.
    pub fn memory_pools_supported(&self) -> Result<bool> {
        Ok(self.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0)
    }

    /// The link from this device to `peer`. A device's link to itself reports no peer access.
    ///
    /// # Errors
    /// The driver's error.
    #[doc(alias = "cuDeviceCanAccessPeer")]
    #[doc(alias = "cuDeviceGetP2PAttribute")]
    pub fn peer_info(&self, peer: &Device) -> Result<PeerInfo> {
        if self.ordinal == peer.ordinal {
            return Ok(PeerInfo { access_supported: false, performance_rank: 0, native_atomics: false });
        }
        let access_supported = raw::can_access_peer(self.raw, peer.raw)?;
        let attr = |a| raw::p2p_attribute(a, self.raw, peer.raw);
        Ok(PeerInfo {
            access_supported,
            performance_rank: attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?,
            native_atomics: attr(CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0,
        })
    }

    /// `matrix[i][j]` is [`peer_info`](Self::peer_info) from device `i` to device `j`.
    ///
    /// # Errors
    /// The driver's error.
    pub fn peer_matrix() -> Result<Vec<Vec<PeerInfo>>> {
        let devices = Device::all()?;
        devices.iter().map(|a| devices.iter().map(|b| a.peer_info(b)).collect()).collect()
    }
}
