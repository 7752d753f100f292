//! `shm_struct!`: a struct that crosses a process boundary, declared once.
//!
//! Each field is written with its byte offset, `[OFFSET] name: Type`. The
//! macro emits the `repr(C)` struct, a compile-time assertion of every
//! field's offset, and the struct's rows for `tests/layout_doc.rs` (via
//! [`ShmStruct`]), which checks them against the tables of `shm_layout.md`.
//! So the struct, its asserts and its documented table cannot drift apart.
//!
//! A shared struct of atomics may also name a **values** struct, `struct
//! Name => NameValues { .. }`: the same fields as plain values, filled by
//! [`Load::load_value`] (one load per word). Read-only views of a segment
//! hand those out, never the atomics: memory mapped `PROT_READ` is loaded,
//! never stored to, from safe code.
//!
//! Under loom the atomics are loom's (other sizes): the asserts, the rows and
//! the values are left out there.

/// A field's row: name, offset, size in bytes.
pub type FieldRow = (&'static str, usize, usize);

/// A struct declared with `shm_struct!`.
pub trait ShmStruct {
    /// The struct's name (the `### Name` of its table in `shm_layout.md`).
    const NAME: &'static str;
    /// Every field, in declaration order.
    const FIELDS: &'static [FieldRow];
}

/// Shared words that can be loaded as plain values.
pub trait Load {
    type Value: Copy;
    /// Every word, each loaded with `order` (not one snapshot of them all).
    fn load_value(&self, order: std::sync::atomic::Ordering) -> Self::Value;
}

#[cfg(not(kvring_loom))]
impl Load for std::sync::atomic::AtomicU32 {
    type Value = u32;
    #[inline]
    fn load_value(&self, order: std::sync::atomic::Ordering) -> u32 {
        self.load(order)
    }
}

#[cfg(not(kvring_loom))]
impl Load for std::sync::atomic::AtomicU64 {
    type Value = u64;
    #[inline]
    fn load_value(&self, order: std::sync::atomic::Ordering) -> u64 {
        self.load(order)
    }
}

#[cfg(not(kvring_loom))]
impl<A: Load> Load for crossbeam_utils::CachePadded<A> {
    type Value = A::Value;
    #[inline]
    fn load_value(&self, order: std::sync::atomic::Ordering) -> A::Value {
        (**self).load_value(order)
    }
}

#[cfg(not(kvring_loom))]
impl<A: Load, const N: usize> Load for [A; N] {
    type Value = [A::Value; N];
    fn load_value(&self, order: std::sync::atomic::Ordering) -> [A::Value; N] {
        std::array::from_fn(|i| self[i].load_value(order))
    }
}

/// Declares a shared struct. See the module documentation.
macro_rules! shm_struct {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident => $values:ident {
            $(
                $(#[$fmeta:meta])*
                [$off:literal] $fvis:vis $field:ident: $ty:ty
            ),+ $(,)?
        }
    ) => {
        $crate::shm_struct::shm_struct! {
            $(#[$meta])*
            $vis struct $name {
                $(
                    $(#[$fmeta])*
                    [$off] $fvis $field: $ty
                ),+
            }
        }

        /// The plain values of
        #[doc = concat!("[`", stringify!($name), "`]")]
        /// (see `shm_struct`): what a read-only view hands out.
        #[cfg(not(kvring_loom))]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        $vis struct $values {
            $(
                $(#[$fmeta])*
                pub $field: <$ty as $crate::shm_struct::Load>::Value,
            )+
        }

        #[cfg(not(kvring_loom))]
        impl $crate::shm_struct::Load for $name {
            type Value = $values;
            fn load_value(&self, order: ::std::sync::atomic::Ordering) -> $values {
                $values {
                    $($field: $crate::shm_struct::Load::load_value(&self.$field, order),)+
                }
            }
        }
    };
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

        #[cfg(not(kvring_loom))]
        const _: () = {
            $(assert!(::std::mem::offset_of!($name, $field) == $off);)+
        };

        #[cfg(not(kvring_loom))]
        impl $crate::shm_struct::ShmStruct for $name {
            const NAME: &'static str = stringify!($name);
            const FIELDS: &'static [$crate::shm_struct::FieldRow] = &[
                $((stringify!($field), $off, ::std::mem::size_of::<$ty>()),)+
            ];
        }
    };
}

pub(crate) use shm_struct;
