//! The protocol: ring opcodes, completion status codes, and the bootstrap
//! socket's messages. Every struct that crosses a process boundary is
//! `repr(C)` + `Pod` with compile-time size and offset assertions; its table
//! is in `shm_layout.md`.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

/// Protocol version spoken over the bootstrap socket and the rings.
pub const PROTOCOL_VERSION: u32 = 1;
/// `"KVRBOOT1"`: first word of every bootstrap message.
pub const BOOT_MAGIC: u64 = u64::from_le_bytes(*b"KVRBOOT1");

/// Ring opcodes.
#[repr(u16)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Opcode {
    /// Echo: the completion carries the request's payload back unchanged.
    Ping = 1,
}

impl Opcode {
    pub fn from_u16(v: u16) -> Option<Opcode> {
        Some(match v {
            1 => Opcode::Ping,
            _ => return None,
        })
    }

    /// Bytes (whole frame) the completion of a request with this opcode and
    /// payload length may take in the completion ring. Both sides compute it:
    /// the client reserves this much credit before submitting, the server
    /// serves a request only when this much completion space is free, so a
    /// completion is never dropped.
    pub fn completion_bound(self, request_len: usize) -> usize {
        match self {
            Opcode::Ping => crate::ring::frame_bytes(request_len),
        }
    }
}

/// Completion status codes (`FrameHeader::status`, and bootstrap replies).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Status {
    #[error("ok")]
    Ok = 0,
    #[error("unknown opcode")]
    UnknownOpcode = -1,
    #[error("bad request length")]
    BadLength = -2,
    #[error("bad session tag")]
    BadSession = -3,
    #[error("no free client slot")]
    NoFreeSlot = -4,
    #[error("permission denied (different user)")]
    PermissionDenied = -5,
    #[error("protocol version mismatch")]
    VersionMismatch = -6,
    #[error("malformed message")]
    Malformed = -7,
    #[error("server shutting down")]
    ShuttingDown = -8,
}

impl Status {
    pub fn from_i32(v: i32) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            -1 => Status::UnknownOpcode,
            -2 => Status::BadLength,
            -3 => Status::BadSession,
            -4 => Status::NoFreeSlot,
            -5 => Status::PermissionDenied,
            -6 => Status::VersionMismatch,
            -7 => Status::Malformed,
            -8 => Status::ShuttingDown,
            _ => return None,
        })
    }
}

/// Bootstrap message kinds.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BootKind {
    Hello = 1,
    Welcome = 2,
    Goodbye = 3,
}

/// Client -> server, first message on the bootstrap socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Hello {
    pub magic: u64,
    /// [`BootKind::Hello`].
    pub kind: u32,
    pub protocol: u32,
    /// Layout version the client understands.
    pub layout_version: u32,
    pub _reserved: u32,
}

const _: () = {
    assert!(size_of::<Hello>() == 24);
    assert!(offset_of!(Hello, kind) == 8);
    assert!(offset_of!(Hello, protocol) == 12);
    assert!(offset_of!(Hello, layout_version) == 16);
};

/// Server -> client, answer to [`Hello`]. On success it carries the segment's
/// descriptor (SCM_RIGHTS).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Welcome {
    pub magic: u64,
    /// [`BootKind::Welcome`].
    pub kind: u32,
    /// [`Status`]; anything but Ok means refused (no descriptor attached).
    pub status: i32,
    pub protocol: u32,
    pub layout_version: u32,
    /// Assigned client slot.
    pub slot: u32,
    /// Session tag to put in every request frame.
    pub session: u32,
    /// Server epoch (also in the segment header).
    pub epoch: u64,
    pub segment_bytes: u64,
    pub server_pid: u32,
    pub _reserved: u32,
}

const _: () = {
    assert!(size_of::<Welcome>() == 56);
    assert!(offset_of!(Welcome, kind) == 8);
    assert!(offset_of!(Welcome, status) == 12);
    assert!(offset_of!(Welcome, protocol) == 16);
    assert!(offset_of!(Welcome, layout_version) == 20);
    assert!(offset_of!(Welcome, slot) == 24);
    assert!(offset_of!(Welcome, session) == 28);
    assert!(offset_of!(Welcome, epoch) == 32);
    assert!(offset_of!(Welcome, segment_bytes) == 40);
    assert!(offset_of!(Welcome, server_pid) == 48);
};

/// Client -> server: clean disconnect. The client has unmapped its rings.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct Goodbye {
    pub magic: u64,
    /// [`BootKind::Goodbye`].
    pub kind: u32,
    pub _reserved: u32,
}

const _: () = assert!(size_of::<Goodbye>() == 16);
