//! Newtypes for the opaque device identifiers an engine hands to the
//! server: a GPU's UUID and a CUDA IPC event handle.

use std::fmt;

fn hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for b in bytes {
        write!(f, "{b:02x}")?;
    }
    Ok(())
}

/// A GPU's UUID (`cuDeviceGetUuid`), as registrations name the device whose
/// copy lane serves them. Debug and Display print it in hex.
///
/// # Examples
///
/// ```
/// use kvring::DeviceUuid;
///
/// let uuid = DeviceUuid::from_bytes([0xab; 16]);
/// assert_eq!(uuid.to_bytes(), [0xab; 16]);
/// assert_eq!(format!("{uuid:?}"), format!("DeviceUuid({})", "ab".repeat(16)));
/// assert!(DeviceUuid::default().is_nil());
/// ```
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DeviceUuid([u8; 16]);

impl DeviceUuid {
    pub const fn from_bytes(bytes: [u8; 16]) -> DeviceUuid {
        DeviceUuid(bytes)
    }

    pub const fn to_bytes(self) -> [u8; 16] {
        self.0
    }

    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// All zero: no device (host memory served by the host lane).
    pub fn is_nil(&self) -> bool {
        self.0 == [0; 16]
    }
}

impl From<[u8; 16]> for DeviceUuid {
    fn from(bytes: [u8; 16]) -> DeviceUuid {
        DeviceUuid(bytes)
    }
}

impl From<DeviceUuid> for [u8; 16] {
    fn from(u: DeviceUuid) -> [u8; 16] {
        u.0
    }
}

impl fmt::Debug for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DeviceUuid(")?;
        hex(f, &self.0)?;
        f.write_str(")")
    }
}

impl fmt::Display for DeviceUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        hex(f, &self.0)
    }
}

/// A CUDA IPC event handle (`cuIpcGetEventHandle`): 64 opaque bytes that
/// another process opens to query or wait on the event. A STORE or
/// RETRIEVE built with `.after(handle)` is copied once the server sees the
/// engine's event complete (it polls it from the host); the server's job
/// events arrive as handles too. Debug prints hex.
///
/// # Examples
///
/// ```
/// use kvring::IpcEventHandle;
///
/// let mut bytes = [0u8; 64];
/// bytes[0] = 0x12;
/// let h = IpcEventHandle::from_bytes(bytes);
/// assert_eq!(h.to_bytes(), bytes);
/// assert!(format!("{h:?}").starts_with("IpcEventHandle(1200"));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle([u8; 64]);

impl IpcEventHandle {
    pub const fn from_bytes(bytes: [u8; 64]) -> IpcEventHandle {
        IpcEventHandle(bytes)
    }

    pub const fn to_bytes(self) -> [u8; 64] {
        self.0
    }

    pub const fn as_bytes(&self) -> &[u8; 64] {
        &self.0
    }
}

impl From<[u8; 64]> for IpcEventHandle {
    fn from(bytes: [u8; 64]) -> IpcEventHandle {
        IpcEventHandle(bytes)
    }
}

impl From<IpcEventHandle> for [u8; 64] {
    fn from(h: IpcEventHandle) -> [u8; 64] {
        h.0
    }
}

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IpcEventHandle(")?;
        hex(f, &self.0)?;
        f.write_str(")")
    }
}
