//! Content hashes and the typed ids built on them.
//!
//! Every object in the store is named by the blake3 hash of its canonical bytes.
//! The same 32 bytes mean different things in different places, so each use has
//! its own type: a [`TreeId`] can never be passed where a [`FileId`] is meant.

use std::fmt;
use std::str::FromStr;

/// Length of a blake3 hash in bytes.
pub const HASH_LEN: usize = 32;

/// A blake3 hash, shown as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Hash(pub [u8; HASH_LEN]);

impl Hash {
    /// Hashes `data` with blake3.
    pub fn of(data: &[u8]) -> Hash {
        Hash(*blake3::hash(data).as_bytes())
    }

    pub fn as_bytes(&self) -> &[u8; HASH_LEN] {
        &self.0
    }

    pub fn from_slice(bytes: &[u8]) -> Option<Hash> {
        <[u8; HASH_LEN]>::try_from(bytes).ok().map(Hash)
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses exactly 64 hex digits (either case).
    pub fn from_hex(s: &str) -> Option<Hash> {
        if s.len() != HASH_LEN * 2 {
            return None;
        }
        Hash::from_slice(&decode_hex(s)?)
    }

    /// The first `n` hex digits, for display.
    pub fn short(&self, n: usize) -> String {
        let mut hex = self.to_hex();
        hex.truncate(n);
        hex
    }
}

/// Decodes a string of hex digits (either case) of even length.
pub fn decode_hex(s: &str) -> Option<Vec<u8>> {
    hex::decode(s).ok()
}

impl fmt::Display for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Hash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hash({})", self.short(16))
    }
}

/// Defines a typed id: a newtype around [`Hash`] with hex display, parsing and serde.
#[macro_export]
macro_rules! typed_id {
    ($(#[$meta:meta])* $name:ident, $what:literal) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub $crate::cas::Hash);

        impl $name {
            /// What this id names, for error messages.
            pub const WHAT: &'static str = $what;

            pub fn hash(&self) -> &$crate::cas::Hash {
                &self.0
            }

            pub fn to_hex(&self) -> String {
                self.0.to_hex()
            }

            pub fn short(&self) -> String {
                self.0.short(12)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                ::std::fmt::Display::fmt(&self.0, f)
            }
        }

        impl ::std::fmt::Debug for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0.short(16))
            }
        }

        impl ::std::str::FromStr for $name {
            type Err = $crate::cas::ParseIdError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $crate::cas::Hash::from_hex(s)
                    .map($name)
                    .ok_or_else(|| $crate::cas::ParseIdError { what: $what, input: s.to_string() })
            }
        }

        impl ::serde::Serialize for $name {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0.to_hex())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $name {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = <String as ::serde::Deserialize>::deserialize(d)?;
                s.parse().map_err(::serde::de::Error::custom)
            }
        }
    };
}

/// A hex string that is not a valid id.
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid {what} id {input:?}: expected 64 hex digits")]
pub struct ParseIdError {
    pub what: &'static str,
    pub input: String,
}

impl FromStr for Hash {
    type Err = ParseIdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Hash::from_hex(s).ok_or_else(|| ParseIdError {
            what: "hash",
            input: s.to_string(),
        })
    }
}

typed_id!(
    /// Any stored object, whatever its type: the key in the object store.
    ObjectId,
    "object"
);
typed_id!(
    /// One chunk of a file's content (a raw blob).
    ChunkId,
    "chunk"
);
typed_id!(
    /// A file's content: the hash of its single chunk, or of its chunk list.
    FileId,
    "file"
);
typed_id!(
    /// A directory: the hash of its encoded tree object.
    TreeId,
    "tree"
);

macro_rules! as_object_id {
    ($($t:ident),*) => {$(
        impl From<$t> for ObjectId {
            fn from(id: $t) -> ObjectId {
                ObjectId(id.0)
            }
        }
    )*};
}
as_object_id!(ChunkId, FileId, TreeId);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let h = Hash::of(b"hello");
        assert_eq!(Hash::from_hex(&h.to_hex()), Some(h));
        assert_eq!(
            h.to_hex(),
            "ea8f163db38682925e4491c5e58d4bb3506ef8c14eb78a86e908c5624a67200f"
        );
        assert_eq!(Hash::from_hex(&h.to_hex().to_uppercase()), Some(h));
        assert!(Hash::from_hex("zz").is_none());
        assert!(Hash::from_hex(&"g".repeat(64)).is_none());
    }

    #[test]
    fn typed_ids_parse_and_name_themselves() {
        let h = Hash::of(b"x");
        let t: TreeId = h.to_hex().parse().unwrap();
        assert_eq!(t.0, h);
        let err = "abc".parse::<TreeId>().unwrap_err();
        assert!(err.to_string().contains("tree"));
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(serde_json::from_str::<TreeId>(&json).unwrap(), t);
    }
}
