//! Small helpers for the canonical binary encodings: LEB128 varints and a reader
//! that refuses truncated or oversized input instead of panicking.

/// Appends `v` as an unsigned LEB128 varint.
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// Appends a signed value with zigzag encoding.
pub fn put_zigzag(out: &mut Vec<u8>, v: i64) {
    put_varint(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// Appends a length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// A cursor over encoded bytes. Every read checks bounds and returns a message on failure.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

pub type DecodeResult<T> = Result<T, String>;

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub fn position(&self) -> usize {
        self.pos
    }

    pub fn u8(&mut self) -> DecodeResult<u8> {
        let b = *self
            .buf
            .get(self.pos)
            .ok_or_else(|| format!("truncated at byte {}", self.pos))?;
        self.pos += 1;
        Ok(b)
    }

    pub fn varint(&mut self) -> DecodeResult<u64> {
        let start = self.pos;
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let bits = (b & 0x7f) as u64;
            if shift == 63 && bits > 1 {
                return Err(format!("varint overflows at byte {start}"));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                // Canonical form only: no redundant trailing zero groups.
                if b == 0 && shift > 0 {
                    return Err(format!("non-canonical varint at byte {start}"));
                }
                return Ok(v);
            }
        }
        Err(format!("varint too long at byte {start}"))
    }

    /// A varint that must fit in `max` (used for lengths and counts).
    pub fn len(&mut self, max: usize, what: &str) -> DecodeResult<usize> {
        let at = self.pos;
        let v = self.varint()?;
        if v > max as u64 {
            return Err(format!("{what} {v} at byte {at} exceeds the limit {max}"));
        }
        Ok(v as usize)
    }

    pub fn zigzag(&mut self) -> DecodeResult<i64> {
        let v = self.varint()?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    pub fn take(&mut self, n: usize) -> DecodeResult<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(format!(
                "truncated: need {n} bytes at byte {}, have {}",
                self.pos,
                self.buf.len() - self.pos
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn bytes(&mut self, max: usize, what: &str) -> DecodeResult<&'a [u8]> {
        let n = self.len(max, what)?;
        self.take(n)
    }

    pub fn hash(&mut self) -> DecodeResult<super::hash::Hash> {
        let b = self.take(super::hash::HASH_LEN)?;
        Ok(super::hash::Hash::from_slice(b).expect("length checked"))
    }

    pub fn finish(&self) -> DecodeResult<()> {
        if self.pos != self.buf.len() {
            return Err(format!(
                "{} trailing bytes after byte {}",
                self.buf.len() - self.pos,
                self.pos
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_round_trip_and_reject_garbage() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            let mut r = Reader::new(&out);
            assert_eq!(r.varint().unwrap(), v);
            r.finish().unwrap();
        }
        for v in [0i64, -1, 1, i64::MIN, i64::MAX, -1_700_000_000_000_000_000] {
            let mut out = Vec::new();
            put_zigzag(&mut out, v);
            assert_eq!(Reader::new(&out).zigzag().unwrap(), v);
        }
        assert!(Reader::new(&[0x80]).varint().is_err());
        assert!(Reader::new(&[0x80, 0x00]).varint().is_err());
        assert!(Reader::new(&[0xff; 11]).varint().is_err());
        assert!(Reader::new(&[5, 1, 2]).bytes(100, "name").is_err());
        assert!(Reader::new(&[200, 1]).bytes(10, "name").is_err());
    }
}
