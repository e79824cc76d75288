//! A request body's JSON, bounded before any value is made of it: [`JsonBounds`] reads
//! the bytes as they arrive (no allocation, one pass) and refuses a body that nests
//! arrays and objects deeper than a limit or holds more elements (array items and
//! object members) than a limit, so that a body of `[0,0,...]` or `[[[[...` is refused
//! after the bytes that cross the limit, never turned into a tree of values many times
//! its size. It also estimates what serde_json's `Value` tree of the body takes, which
//! the server charges against its memory for requests (`serve::budget`).
//!
//! It does not check the JSON: serde_json does, after it. What it counts is exact for
//! any valid prefix of a body (strings, escapes and nesting are told apart as a JSON
//! parser does), and a parser builds values only from a valid prefix, so the values a
//! parser makes of a body that passed are within the bounds, valid JSON or not.

/// The bounds on one body's JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JsonLimits {
    /// Arrays and objects nested in one another, at most (1 to [`MAX_DEPTH`]).
    pub max_depth: usize,
    /// Array items and object members in the whole body, at most.
    pub max_elements: u64,
}

/// The deepest nesting a limit may allow: serde_json's own recursion limit.
pub const MAX_DEPTH: usize = 128;

impl Default for JsonLimits {
    fn default() -> JsonLimits {
        JsonLimits {
            max_depth: 64,
            max_elements: 1_000_000,
        }
    }
}

/// A body over a bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooMuch {
    /// Nested deeper than this limit.
    Depth(usize),
    /// More elements than this limit.
    Elements(u64),
}

/// Bytes a `serde_json::Value` tree takes at most, by what it holds: the value in its
/// parent (an array's vector doubles as it grows; an object's B-tree nodes are at
/// least half full), and the first allocation of a non-empty array (four slots) or
/// object (a B-tree leaf of eleven). Measured against a counting allocator: 42 to 64
/// bytes an array item, 110 a member of a large object, 690 an object of one member,
/// 880 an object of five strings. Strings take about their length in the body.
const ITEM_BYTES: u64 = 64;
const MEMBER_BYTES: u64 = 128;
const ARRAY_BYTES: u64 = 128;
const OBJECT_BYTES: u64 = 640;

/// Reads a body's JSON as it arrives: see the module's notes.
#[derive(Debug, Clone)]
pub struct JsonBounds {
    limits: JsonLimits,
    /// Open arrays and objects.
    depth: usize,
    /// Bit `i` set: the container at depth `i + 1` is an object.
    objects_open: u128,
    in_string: bool,
    escaped: bool,
    /// A container was just opened: its first non-blank byte says whether it is empty.
    opened: bool,
    items: u64,
    members: u64,
    arrays: u64,
    objects: u64,
}

impl JsonBounds {
    pub fn new(limits: JsonLimits) -> JsonBounds {
        JsonBounds {
            limits: JsonLimits {
                max_depth: limits.max_depth.clamp(1, MAX_DEPTH),
                ..limits
            },
            depth: 0,
            objects_open: 0,
            in_string: false,
            escaped: false,
            opened: false,
            items: 0,
            members: 0,
            arrays: 0,
            objects: 0,
        }
    }

    /// Reads the next bytes of the body.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), TooMuch> {
        for &b in bytes {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            if self.opened {
                match b {
                    b' ' | b'\t' | b'\n' | b'\r' => continue,
                    b']' | b'}' => {}
                    _ => {
                        if self.in_object() {
                            self.objects += 1;
                        } else {
                            self.arrays += 1;
                        }
                        self.element()?;
                    }
                }
                self.opened = false;
            }
            match b {
                b'"' => self.in_string = true,
                b'[' | b'{' => {
                    if self.depth >= self.limits.max_depth {
                        return Err(TooMuch::Depth(self.limits.max_depth));
                    }
                    let bit = 1u128 << self.depth;
                    if b == b'{' {
                        self.objects_open |= bit;
                    } else {
                        self.objects_open &= !bit;
                    }
                    self.depth += 1;
                    self.opened = true;
                }
                b']' | b'}' => self.depth = self.depth.saturating_sub(1),
                b',' if self.depth > 0 => self.element()?,
                _ => {}
            }
        }
        Ok(())
    }

    fn in_object(&self) -> bool {
        self.depth > 0 && self.objects_open & (1u128 << (self.depth - 1)) != 0
    }

    /// One more element of the innermost open container.
    fn element(&mut self) -> Result<(), TooMuch> {
        if self.in_object() {
            self.members += 1;
        } else {
            self.items += 1;
        }
        if self.elements() > self.limits.max_elements {
            return Err(TooMuch::Elements(self.limits.max_elements));
        }
        Ok(())
    }

    /// Array items and object members read so far.
    pub fn elements(&self) -> u64 {
        self.items + self.members
    }

    /// What serde_json's `Value` tree of the bytes read so far takes at most, besides
    /// the strings' bytes.
    pub fn tree_bytes(&self) -> u64 {
        self.items * ITEM_BYTES
            + self.members * MEMBER_BYTES
            + self.arrays * ARRAY_BYTES
            + self.objects * OBJECT_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn bounds(text: &str, limits: JsonLimits) -> Result<JsonBounds, TooMuch> {
        let mut b = JsonBounds::new(limits);
        b.feed(text.as_bytes())?;
        Ok(b)
    }

    fn open() -> JsonLimits {
        JsonLimits {
            max_depth: MAX_DEPTH,
            max_elements: u64::MAX,
        }
    }

    /// Array items and object members of a parsed value, and its nesting.
    fn counted(v: &Value) -> (u64, usize) {
        match v {
            Value::Array(a) => a.iter().map(counted).fold((a.len() as u64, 1), |acc, c| {
                (acc.0 + c.0, acc.1.max(c.1 + 1))
            }),
            Value::Object(o) => o.values().map(counted).fold((o.len() as u64, 1), |acc, c| {
                (acc.0 + c.0, acc.1.max(c.1 + 1))
            }),
            _ => (0, 0),
        }
    }

    #[test]
    fn counts_what_a_parser_makes() {
        for text in [
            "0",
            "[]",
            "{}",
            "[0]",
            "[0, 1, [2, 3], {}]",
            r#"{"a": [1, {"b": "x,y]}{["}], "c\"": "\\", "d": [[], [[]]]}"#,
            r#"  [ "\u005d", "\"[", {"k,": {"": []}} ]  "#,
            r#"{"files": [{"path": "a", "kind": "file"}, {"path": "b/c", "size": 3}]}"#,
        ] {
            let v: Value = serde_json::from_str(text).unwrap();
            let b = bounds(text, open()).unwrap();
            assert_eq!((b.elements(), b.depth), (counted(&v).0, 0), "{text}");
        }
    }

    #[test]
    fn refuses_a_body_past_a_bound_at_the_byte_that_crosses_it() {
        let limits = JsonLimits {
            max_depth: 3,
            max_elements: 4,
        };
        assert!(bounds("[[[0]]]", limits).is_ok());
        assert_eq!(bounds("[[[[0]]]]", limits).unwrap_err(), TooMuch::Depth(3));
        assert_eq!(
            bounds(r#"{"a":{"b":{"c":{}}}}"#, limits).unwrap_err(),
            TooMuch::Depth(3)
        );
        assert!(bounds("[0,1,2,3]", limits).is_ok());
        assert_eq!(
            bounds("[0,1,2,3,4]", limits).unwrap_err(),
            TooMuch::Elements(4)
        );
        assert_eq!(
            bounds("[[],[],[],[],[]]", limits).unwrap_err(),
            TooMuch::Elements(4)
        );
        // Brackets and commas inside strings are text.
        assert!(bounds(r#"["[[[[,,,,,,", "\"[[[[,,,,"]"#, limits).is_ok());
        // Fed a byte at a time, the same.
        let mut b = JsonBounds::new(open());
        let text = b"[0, [1, \"a\\\",\"], 2, 3]";
        assert!(text.iter().all(|c| b.feed(std::slice::from_ref(c)).is_ok()));
        assert_eq!((b.elements(), b.depth), (6, 0));
        let mut b = JsonBounds::new(limits);
        let err = b"[0,1,2,3,4]"
            .iter()
            .map(|c| b.feed(std::slice::from_ref(c)))
            .position(|r| r.is_err());
        assert_eq!(
            err,
            Some(8),
            "refused at the comma before the fifth element"
        );
    }

    #[test]
    fn the_estimate_covers_the_tree_a_parser_makes() {
        // Per element, what a counting allocator measured of serde_json's tree.
        let n = 1000;
        for (text, measured_per_unit, units) in [
            (format!("[{}0]", "0,".repeat(n - 1)), 42, n),
            (format!("[{}[0]]", "[0],".repeat(n - 1)), 170, n),
            (
                format!("[{}{{\"a\":0}}]", "{\"a\":0},".repeat(n - 1)),
                690,
                n,
            ),
        ] {
            let b = bounds(&text, open()).unwrap();
            assert!(
                b.tree_bytes() >= (measured_per_unit * units) as u64,
                "{}: {}",
                &text[..20],
                b.tree_bytes()
            );
        }
    }

    proptest::proptest! {
        #[test]
        fn any_value_is_counted_as_parsed(v in json_value()) {
            let text = serde_json::to_string_pretty(&v).unwrap();
            let b = bounds(&text, open()).unwrap();
            let (elements, depth) = counted(&v);
            proptest::prop_assert_eq!(b.elements(), elements);
            // Limits at the value's own depth and count pass; one less refuses.
            let exact = JsonLimits { max_depth: depth.max(1), max_elements: elements };
            proptest::prop_assert!(bounds(&text, exact).is_ok());
            if depth > 1 {
                let shallow = JsonLimits { max_depth: depth - 1, ..exact };
                proptest::prop_assert!(bounds(&text, shallow).is_err());
            }
            if elements > 0 {
                let fewer = JsonLimits { max_elements: elements - 1, ..exact };
                proptest::prop_assert!(bounds(&text, fewer).is_err());
            }
        }
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[\\[\\]{},:\"\\\\a-z ]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(6, 64, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map("[\\[\\]{},:\"a-z]{0,4}", inner, 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
