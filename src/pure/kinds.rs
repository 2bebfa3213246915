//! `error_kinds!`: the `Copy` enum of kinds every boundary's error type names through its `kind()`.
//!
//! A kind is a stable snake_case name (`geometry_mismatch`) that scenarios and tests match on, so the wording of a
//! message can change without breaking them.

/// Declares a kind enum: each variant with its snake_case name and a one-line doc; the enum gets `ALL`, `name()`,
/// `parse()` (the inverse of `name()`), `names()` (every name, comma-separated, for error messages) and `Display`.
macro_rules! error_kinds {
    (
        $(#[$meta:meta])*
        $vis:vis enum $kind:ident {
            $( $(#[doc = $doc:literal])* $variant:ident = $name:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        $vis enum $kind {
            $( $(#[doc = $doc])* $variant, )+
        }

        impl $kind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [$kind] = &[$($kind::$variant),+];

            /// The kind's snake_case name, as scenarios and reports spell it.
            pub fn name(&self) -> &'static str {
                match self {
                    $($kind::$variant => $name,)+
                }
            }

            /// The kind named `name` (the inverse of [`Self::name`]).
            pub fn parse(name: &str) -> Option<$kind> {
                Self::ALL.iter().copied().find(|kind| kind.name() == name)
            }

            /// Every kind's name, comma-separated (for "fix: one of ..." messages).
            pub fn names() -> String {
                Self::ALL.iter().map(|kind| kind.name()).collect::<Vec<_>>().join(", ")
            }
        }

        impl std::fmt::Display for $kind {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}
