//! Devices: count, handles, attributes, peer queries. Stateless and thread-safe like the driver
//! calls they make.

use std::os::raw::{c_char, c_int};

use super::driver_call;
use crate::cuda_error::Result;
use crate::sys::{CUdevice, CUdevice_P2PAttribute, CUdevice_attribute};

/// `cuDeviceGetCount`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetCount")]
pub fn get_count() -> Result<i32> {
    let mut count: c_int = 0;
    driver_call!(cuDeviceGetCount(&mut count))?;
    Ok(count)
}

/// `cuDeviceGet`: the handle of device `ordinal`.
///
/// # Errors
/// The driver's error (`CUDA_ERROR_INVALID_DEVICE` for a bad ordinal).
#[doc(alias = "cuDeviceGet")]
pub fn get(ordinal: i32) -> Result<CUdevice> {
    let mut device: CUdevice = 0;
    driver_call!(cuDeviceGet(&mut device, ordinal))?;
    Ok(device)
}

/// `cuDeviceGetName`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetName")]
pub fn name(device: CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 256];
    driver_call!(cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device))?;
    Ok(c_buf_to_string(&buf))
}

/// `cuDeviceGetUuid_v2`: the device's UUID (the same in every process that sees the device,
/// whatever its ordinal there).
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetUuid")]
#[doc(alias = "cuDeviceGetUuid_v2")]
pub fn uuid(device: CUdevice) -> Result<[u8; 16]> {
    let mut uuid = crate::sys::CUuuid { bytes: [0; 16] };
    driver_call!(cuDeviceGetUuid_v2(&mut uuid, device))?;
    Ok(uuid.bytes.map(|b| b as u8))
}

/// `cuDeviceGetAttribute`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetAttribute")]
pub fn attribute(device: CUdevice, attribute: CUdevice_attribute) -> Result<i32> {
    let mut value: c_int = 0;
    driver_call!(cuDeviceGetAttribute(&mut value, attribute, device))?;
    Ok(value)
}

/// `cuDeviceTotalMem_v2`: bytes of device memory.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceTotalMem")]
pub fn total_mem(device: CUdevice) -> Result<usize> {
    let mut bytes: usize = 0;
    driver_call!(cuDeviceTotalMem_v2(&mut bytes, device))?;
    Ok(bytes)
}

/// `cuDeviceGetPCIBusId`: `domain:bus:device.function`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetPCIBusId")]
pub fn pci_bus_id(device: CUdevice) -> Result<String> {
    let mut buf = [0 as c_char; 64];
    driver_call!(cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, device))?;
    Ok(c_buf_to_string(&buf))
}

/// `cuDeviceCanAccessPeer`: whether `device` can map `peer`'s memory.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceCanAccessPeer")]
pub fn can_access_peer(device: CUdevice, peer: CUdevice) -> Result<bool> {
    let mut can: c_int = 0;
    driver_call!(cuDeviceCanAccessPeer(&mut can, device, peer))?;
    Ok(can != 0)
}

/// `cuDeviceGetP2PAttribute` for the link from `src` to `dst`.
///
/// # Errors
/// The driver's error.
#[doc(alias = "cuDeviceGetP2PAttribute")]
pub fn p2p_attribute(attribute: CUdevice_P2PAttribute, src: CUdevice, dst: CUdevice) -> Result<i32> {
    let mut value: c_int = 0;
    driver_call!(cuDeviceGetP2PAttribute(&mut value, attribute, src, dst))?;
    Ok(value)
}

fn c_buf_to_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
