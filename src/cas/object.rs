//! How an object's bytes are kept on disk: one header byte (raw or zstd), then the
//! payload. Compression is used only when it saves space. Every read decodes and
//! checks that the bytes hash to the object's key, so damage is an error, never data.

use std::cell::RefCell;

use super::encoding::{put_varint, Reader};
use super::error::{CasError, CasResult};
use super::hash::Hash;

const RAW: u8 = 0;
const ZSTD: u8 = 1;

/// Objects smaller than this are stored raw: compression cannot pay for its frame.
const MIN_COMPRESS_LEN: usize = 64;

/// The largest object the store accepts (a chunk, a chunk list or a tree).
pub const MAX_OBJECT_LEN: usize = 256 << 20;

/// zstd level for stored objects.
pub const ZSTD_LEVEL: i32 = 1;

thread_local! {
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// Whether `data` starts like a compressed format (gzip, zlib, zstd, xz, bzip2, zip,
/// PNG, JPEG, GIF, WebP): compressing it again costs time and saves nothing.
pub fn looks_compressed(data: &[u8]) -> bool {
    const MAGIC: &[&[u8]] = &[
        b"\x1f\x8b",
        b"\x28\xb5\x2f\xfd",
        b"\xfd7zXZ\x00",
        b"BZh",
        b"PK\x03\x04",
        b"\x89PNG\r\n\x1a\n",
        b"\xff\xd8\xff",
        b"GIF8",
        b"7z\xbc\xaf\x27\x1c",
    ];
    if MAGIC.iter().any(|m| data.starts_with(m)) {
        return true;
    }
    if data.len() >= 12 && &data[..4] == b"RIFF" && &data[8..12] == b"WEBP" {
        return true;
    }
    // zlib (git objects): CMF 0x78 and a header checksum that divides by 31.
    data.len() >= 2 && data[0] == 0x78 && (u16::from(data[0]) << 8 | u16::from(data[1])) % 31 == 0
}

/// Encodes `data` for storage: zstd when that is smaller, raw otherwise.
pub fn encode_stored(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    encode_stored_into(data, &mut out);
    out
}

/// Encodes `data` for storage into `out` (cleared first), reusing its allocation.
pub fn encode_stored_into(data: &[u8], out: &mut Vec<u8>) {
    out.clear();
    if data.len() >= MIN_COMPRESS_LEN && !looks_compressed(data) {
        out.push(ZSTD);
        put_varint(out, data.len() as u64);
        let start = out.len();
        out.resize(start + zstd::zstd_safe::compress_bound(data.len()), 0);
        let written = COMPRESSOR.with(|c| {
            let mut c = c.borrow_mut();
            if c.is_none() {
                *c = zstd::bulk::Compressor::new(ZSTD_LEVEL).ok();
            }
            c.as_mut()
                .and_then(|c| c.compress_to_buffer(data, &mut out[start..]).ok())
        });
        if let Some(n) = written {
            if start + n + 8 < data.len() {
                out.truncate(start + n);
                return;
            }
        }
        out.clear();
    }
    out.reserve(data.len() + 1);
    out.push(RAW);
    out.extend_from_slice(data);
}

/// Decodes stored bytes and verifies them against `id`.
pub fn decode_stored(id: &Hash, stored: &[u8]) -> CasResult<Vec<u8>> {
    let corrupt = |detail: String| CasError::Corrupt { id: *id, detail };
    let (&header, rest) = stored
        .split_first()
        .ok_or_else(|| corrupt("empty stored value".into()))?;
    let data = match header {
        RAW => rest.to_vec(),
        ZSTD => {
            let mut r = Reader::new(rest);
            let len = r
                .len(MAX_OBJECT_LEN, "object length")
                .map_err(|e| corrupt(format!("bad length header: {e}")))?;
            let frame = &rest[r.position()..];
            // The frame says how much it holds: a damaged header is found before a
            // buffer of its claimed size is allocated.
            match zstd::zstd_safe::get_frame_content_size(frame) {
                Ok(Some(n)) if n == len as u64 => {}
                Ok(None) => {}
                Ok(Some(n)) => {
                    return Err(corrupt(format!(
                        "zstd frame holds {n} bytes, header says {len}"
                    )))
                }
                Err(_) => return Err(corrupt("not a zstd frame".into())),
            }
            let out = DECOMPRESSOR.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = zstd::bulk::Decompressor::new().ok();
                }
                match d.as_mut() {
                    Some(d) => d.decompress(frame, len),
                    None => zstd::bulk::decompress(frame, len),
                }
            });
            let out = out.map_err(|e| corrupt(format!("zstd: {e}")))?;
            if out.len() != len {
                return Err(corrupt(format!(
                    "decompressed to {} bytes, header says {len}",
                    out.len()
                )));
            }
            out
        }
        other => return Err(corrupt(format!("unknown header byte {other}"))),
    };
    let actual = Hash::of(&data);
    if actual != *id {
        return Err(corrupt(format!("content hashes to {actual}")));
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_length_header_the_frame_does_not_match_is_refused_before_allocating() {
        let frame = zstd::bulk::compress(&b"hello world".repeat(10), 1).unwrap();
        let mut stored = vec![ZSTD];
        // LEB128 of 256 MiB: the largest length the header may claim.
        stored.extend_from_slice(&[0x80, 0x80, 0x80, 0x80, 0x01]);
        stored.extend_from_slice(&frame);
        let err = decode_stored(&Hash::of(b"x"), &stored).unwrap_err();
        assert!(err.to_string().contains("frame holds 110 bytes"), "{err}");
    }

    use super::*;

    #[test]
    fn round_trip_raw_and_compressed() {
        for data in [
            b"tiny".to_vec(),
            vec![7u8; 100_000],
            (0..100_000u32)
                .map(|i| i.wrapping_mul(2654435761) as u8)
                .collect(),
        ] {
            let id = Hash::of(&data);
            let stored = encode_stored(&data);
            assert_eq!(decode_stored(&id, &stored).unwrap(), data);
        }
        assert_eq!(encode_stored(&[7u8; 100_000])[0], ZSTD);
        assert!(encode_stored(&[7u8; 100_000]).len() < 1000);
    }

    #[test]
    fn compressed_formats_are_stored_raw() {
        let mut gz = vec![0x1f, 0x8b];
        gz.extend(std::iter::repeat_n(b'a', 1000));
        assert_eq!(encode_stored(&gz)[0], RAW);
        let zlib = [0x78, 0x9c, 1, 2, 3];
        assert!(looks_compressed(&zlib));
        assert!(!looks_compressed(b"xyz plain text"));
    }

    #[test]
    fn any_flipped_byte_is_an_integrity_error() {
        let data: Vec<u8> = b"hello world, hello casfs. ".repeat(50);
        let id = Hash::of(&data);
        let stored = encode_stored(&data);
        for i in 0..stored.len() {
            let mut bad = stored.clone();
            bad[i] ^= 0x5a;
            let err = decode_stored(&id, &bad).unwrap_err();
            assert!(err.is_integrity(), "byte {i}: {err}");
            assert!(err.to_string().contains(&id.to_hex()));
        }
        assert!(decode_stored(&id, &[]).is_err());
    }
}
