//! `shm_struct!`: a struct that crosses a process boundary, declared once.
//!
//! Each field is written with its byte offset, `[OFFSET] name: Type`. The
//! macro emits the `repr(C)` struct, a compile-time assertion of every
//! field's offset, and the struct's rows for `tests/layout_doc.rs` (via
//! [`ShmStruct`]), which checks them against the tables of `shm_layout.md`.
//! So the struct, its asserts and its documented table cannot drift apart.
//!
//! Under loom the atomics are loom's (other sizes): the asserts and the rows
//! are left out there.

/// A field's row: name, offset, size in bytes.
pub type FieldRow = (&'static str, usize, usize);

/// A struct declared with `shm_struct!`.
pub trait ShmStruct {
    /// The struct's name (the `### Name` of its table in `shm_layout.md`).
    const NAME: &'static str;
    /// Every field, in declaration order.
    const FIELDS: &'static [FieldRow];
}

/// Declares a shared struct. See the module documentation.
macro_rules! shm_struct {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident {
            $(
                $(#[$fmeta:meta])*
                [$off:literal] $fvis:vis $field:ident: $ty:ty
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        $vis struct $name {
            $(
                $(#[$fmeta])*
                $fvis $field: $ty,
            )+
        }

        #[cfg(not(loom))]
        const _: () = {
            $(assert!(::std::mem::offset_of!($name, $field) == $off);)+
        };

        #[cfg(not(loom))]
        impl $crate::shm_struct::ShmStruct for $name {
            const NAME: &'static str = stringify!($name);
            const FIELDS: &'static [$crate::shm_struct::FieldRow] = &[
                $((stringify!($field), $off, ::std::mem::size_of::<$ty>()),)+
            ];
        }
    };
}

pub(crate) use shm_struct;
