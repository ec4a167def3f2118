//! The control connection's records: encoding, reading (whole, however the bytes arrive) and
//! the element type names they carry.

use super::*;

pub(super) enum Record {
    Data(Announced),
    Close { steps: u64 },
    Alive,
}

pub(super) fn encode_record(kind: u8, step: u64, n: u64, elem_size: u64, elem: &str) -> Vec<u8> {
    let mut record = Vec::with_capacity(RECORD_HEAD + elem.len());
    record.extend_from_slice(&[kind, 0, 0, 0]);
    record.extend_from_slice(&(elem.len() as u32).to_le_bytes());
    record.extend_from_slice(&step.to_le_bytes());
    record.extend_from_slice(&n.to_le_bytes());
    record.extend_from_slice(&elem_size.to_le_bytes());
    record.extend_from_slice(elem.as_bytes());
    record
}

/// Reads what the connection has into `pending` and returns the first whole record, if any
/// (`Ok(None)` after a quiet poll interval). A closed connection or a malformed record is the
/// reason the link fails.
pub(super) fn read_record(
    socket: &mut TcpStream,
    pending: &mut Vec<u8>,
) -> std::result::Result<Option<Record>, String> {
    loop {
        if pending.len() >= RECORD_HEAD {
            let word = |at: usize, len: usize| {
                let mut bytes = [0u8; 8];
                bytes[..len].copy_from_slice(&pending[at..at + len]);
                u64::from_le_bytes(bytes)
            };
            let name_len = word(4, 4) as usize;
            if name_len > MAX_TYPE_NAME {
                return Err(format!("a record with a type name of {name_len} bytes"));
            }
            if pending.len() >= RECORD_HEAD + name_len {
                let (kind, step, n, elem_size) = (pending[0], word(8, 8), word(16, 8), word(24, 8));
                let name = std::str::from_utf8(&pending[RECORD_HEAD..RECORD_HEAD + name_len])
                    .map_err(|_| "a record whose type name is not UTF-8".to_string())?;
                let record = match kind {
                    DATA => {
                        let elem = intern(name)
                            .ok_or_else(|| format!("more than {MAX_TYPE_NAMES} element type names crossed the wire"))?;
                        let bytes = n
                            .checked_mul(elem_size)
                            .and_then(|bytes| usize::try_from(bytes).ok())
                            .filter(|&bytes| bytes > 0)
                            .ok_or_else(|| format!("step {step}: {n} element(s) of {elem_size} byte(s) ({name})"))?;
                        Record::Data(Announced { step, n: n as usize, elem, bytes })
                    }
                    CLOSE => Record::Close { steps: step },
                    ALIVE => Record::Alive,
                    other => return Err(format!("a record of unknown kind {other}")),
                };
                pending.drain(..RECORD_HEAD + name_len);
                return Ok(Some(record));
            }
        }
        let mut chunk = [0u8; 512];
        match socket.read(&mut chunk) {
            Ok(0) => return Err(PEER_CLOSED.into()),
            Ok(read) => pending.extend_from_slice(&chunk[..read]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the boundary's connection failed: {e}")),
        }
    }
}

/// Refuses, at boundary `boundary`, an element type whose name is longer than a record carries
/// (the receiver would fail the link on it).
pub(super) fn check_type_name(boundary: usize, name: &'static str) -> Result<()> {
    if name.len() > MAX_TYPE_NAME {
        return Err(Error::Pipeline(PpError::TypeNameTooLong { boundary, name, max: MAX_TYPE_NAME }));
    }
    Ok(())
}

/// Element type names met on the wire, each kept once (`SlotState` names a type by a
/// `&'static str`).
pub(super) static TYPE_NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// The most distinct element type names kept (each at most [`MAX_TYPE_NAME`] bytes).
pub(super) const MAX_TYPE_NAMES: usize = 1024;

/// The name kept once for the process, or `None` when [`MAX_TYPE_NAMES`] are kept already.
pub(super) fn intern(name: &str) -> Option<&'static str> {
    let mut known = TYPE_NAMES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&found) = known.iter().find(|&&known| known == name) {
        return Some(found);
    }
    if known.len() >= MAX_TYPE_NAMES {
        return None;
    }
    let leaked: &'static str = Box::leak(name.to_string().into_boxed_str());
    known.push(leaked);
    Some(leaked)
}
