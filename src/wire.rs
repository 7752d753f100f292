//! `wire_enum!`: a wire enum declared once.
//!
//! Every integer code that crosses a process boundary (an opcode, a status, a
//! job or slot state, a registration kind, ...) is declared with this macro:
//! one line per variant with its code and its stable name. The macro emits
//! the enum (explicit discriminants, the variant docs), its decoding from the
//! raw integer, `name()`, `ALL` (in declaration order) and `index()` (the
//! variant's position in `ALL`, a dense index for per-variant tables).
//!
//! Decoding never guesses: an unknown code is `Err(Unknown(raw))`, so a
//! caller decides what a code from a newer peer means. An enum declared with
//! an `other` variant (`FailReason`) keeps unknown codes in that variant
//! instead, and decodes totally.
//!
//! The stable name is what the documentation and the inspector's JSON say;
//! the enum serializes as it.

/// A code this build does not know (a newer peer, or a corrupt word).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, thiserror::Error)]
#[error("unknown code {0}")]
pub struct Unknown<T: std::fmt::Display + std::fmt::Debug>(pub T);

/// What every wire enum declared with `wire_enum!` has, for code generic
/// over them (the inspector's fields).
pub trait WireEnum: Copy + std::fmt::Debug + serde::Serialize + 'static {
    /// The stable name (documentation, JSON).
    fn wire_name(self) -> &'static str;
}

/// Declares a wire enum. See the module documentation.
///
/// ```text
/// wire_enum! {
///     /// Docs.
///     pub enum Name: u32 {
///         /// Variant docs.
///         Variant = 1 => "variant",
///         ...
///     }
/// }
/// ```
///
/// With `other Variant;` after the repr type, the enum gains `Variant(repr)`
/// holding any unknown code, `code()` and a total `from_code()` instead of
/// the discriminants and `decode()`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            other $other:ident;
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $code:literal => $label:literal
            ),+ $(,)?
        }
    ) => {
        $crate::wire::wire_enum!(@other
            $(#[$meta])* $vis enum $name: $repr { other $other; $($(#[$vmeta])* $variant = $code => $label),+ }
        );
    };

    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident as $spec_ty:ty {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $code:literal => $label:literal, $spec:expr;
            )+
        }
    ) => {
        $crate::wire::wire_enum! {
            $(#[$meta])* $vis enum $name: $repr { $($(#[$vmeta])* $variant = $code => $label),+ }
        }

        impl $name {
            /// What this variant's declaration says about it.
            pub const fn spec(self) -> $spec_ty {
                match self {
                    $($name::$variant => $spec,)+
                }
            }
        }
    };

    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $code:literal => $label:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr($repr)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
        $vis enum $name {
            $(
                $(#[$vmeta])*
                #[serde(rename = $label)]
                $variant = $code,
            )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The variant of a raw code; `Err(Unknown(raw))` for a code this
            /// build does not know.
            pub const fn decode(raw: $repr) -> Result<Self, $crate::wire::Unknown<$repr>> {
                match raw {
                    $($code => Ok($name::$variant),)+
                    _ => Err($crate::wire::Unknown(raw)),
                }
            }

            /// The raw code.
            pub const fn raw(self) -> $repr {
                self as $repr
            }

            /// The stable name (documentation, JSON).
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }

            /// Position in [`Self::ALL`]: a dense index for per-variant
            /// tables.
            pub const fn index(self) -> usize {
                let mut i = 0;
                while i < Self::ALL.len() {
                    if Self::ALL[i] as $repr == self as $repr {
                        return i;
                    }
                    i += 1;
                }
                unreachable!()
            }
        }

        impl $crate::wire::WireEnum for $name {
            fn wire_name(self) -> &'static str {
                self.name()
            }
        }

        impl TryFrom<$repr> for $name {
            type Error = $crate::wire::Unknown<$repr>;
            fn try_from(raw: $repr) -> Result<Self, Self::Error> {
                Self::decode(raw)
            }
        }

        impl From<$name> for $repr {
            fn from(v: $name) -> $repr {
                v as $repr
            }
        }
    };

    (@other
        $(#[$meta:meta])*
        $vis:vis enum $name:ident: $repr:ident {
            other $other:ident;
            $(
                $(#[$vmeta:meta])*
                $variant:ident = $code:literal => $label:literal
            ),+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $(
                $(#[$vmeta])*
                $variant,
            )+
            /// A code this build does not know (a newer peer).
            $other($repr),
        }

        impl $name {
            /// Every known variant, in declaration order.
            pub const ALL: [$name; [$($label),+].len()] = [$($name::$variant),+];

            /// The variant of a code; unknown codes are kept in
            /// `Self::$other`.
            pub const fn from_code(raw: $repr) -> Self {
                match raw {
                    $($code => $name::$variant,)+
                    c => $name::$other(c),
                }
            }

            /// The raw code.
            pub const fn code(self) -> $repr {
                match self {
                    $($name::$variant => $code,)+
                    $name::$other(c) => c,
                }
            }

            /// The stable name (documentation, JSON); `"other"` for an
            /// unknown code.
            pub const fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                    $name::$other(_) => "other",
                }
            }
        }

        impl From<$repr> for $name {
            fn from(raw: $repr) -> Self {
                Self::from_code(raw)
            }
        }

        impl From<$name> for $repr {
            fn from(v: $name) -> $repr {
                v.code()
            }
        }
    };
}

pub(crate) use wire_enum;

#[cfg(test)]
mod tests {
    wire_enum! {
        /// A test enum.
        enum Colour: u16 {
            /// Red.
            Red = 3 => "red",
            Green = 7 => "green",
        }
    }

    wire_enum! {
        enum Why: u32 {
            other Other;
            Gone = 1 => "gone",
            Asked = 2 => "asked",
        }
    }

    #[test]
    fn decodes_names_and_lists() {
        assert_eq!(Colour::decode(7), Ok(Colour::Green));
        assert_eq!(Colour::try_from(4), Err(super::Unknown(4)));
        assert_eq!(Colour::Red.name(), "red");
        assert_eq!(Colour::ALL, [Colour::Red, Colour::Green]);
        assert_eq!(Colour::Green.index(), 1);
        assert_eq!(u16::from(Colour::Green), 7);
        for c in Colour::ALL {
            assert_eq!(Colour::decode(c.raw()), Ok(c));
        }
        assert_eq!(Why::from_code(2), Why::Asked);
        assert_eq!(Why::from_code(9), Why::Other(9));
        assert_eq!(Why::Other(9).code(), 9);
        assert_eq!(Why::Gone.name(), "gone");
        assert_eq!(Why::ALL, [Why::Gone, Why::Asked]);
    }
}
