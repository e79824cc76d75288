//! Secret values a workspace resolves (tokens, keys): never stored. Captured content
//! has each value replaced by a placeholder naming its secret, and a restore puts the
//! current value back.
//!
//! A placeholder expands only where casfs put it. Text that merely looks like one (a
//! client may write `{{casfs-secret:API_KEY}}` into a message, a record or a file) is
//! data: everything casfs stores has each `{{casfs-` of its own escaped as
//! `{{casfs-~` (and `{{casfs-~` as `{{casfs-~~`), in the same pass that puts the
//! placeholders in, so the only unescaped markers in what is stored are casfs's
//! placeholders, and [`Secrets::fill`] gives the text back exactly as it was written.

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, MatchKind};

use super::error::{MiddlewareError, MiddlewareResult};

/// Placeholders are `{{casfs-secret:NAME}}`.
pub const PLACEHOLDER_PREFIX: &str = "{{casfs-secret:";
const PLACEHOLDER_SUFFIX: &str = "}}";

/// What every marker casfs puts into stored text starts with.
const MARK: &[u8] = b"{{casfs-";
/// The character after [`MARK`] that says the text itself held it.
const ESCAPED: u8 = b'~';

/// The shortest value looked for: a shorter one would match all over ordinary files.
const MIN_SECRET_LEN: usize = 6;

/// The resolved secrets of a workspace, by name.
#[derive(Clone, Default)]
pub struct Secrets {
    names: Vec<String>,
    values: Vec<String>,
    find: Option<AhoCorasick>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the values.
        f.debug_struct("Secrets")
            .field("names", &self.names)
            .finish()
    }
}

impl Secrets {
    /// Secrets from `name -> value`. Names are 1 to 100 characters of `[A-Za-z0-9_.-]`;
    /// values are at least 6 bytes and may not contain a placeholder.
    pub fn new(map: BTreeMap<String, String>) -> MiddlewareResult<Secrets> {
        let mut names = Vec::new();
        let mut values = Vec::new();
        for (name, value) in map {
            let ok_name = !name.is_empty()
                && name.len() <= 100
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
            if !ok_name {
                return Err(MiddlewareError::Config(format!(
                    "secret name {name:?}: use 1 to 100 of A-Z a-z 0-9 _ . -"
                )));
            }
            if value.len() < MIN_SECRET_LEN {
                return Err(MiddlewareError::Config(format!(
                    "secret {name}: its value is shorter than {MIN_SECRET_LEN} bytes, too short \
                     to keep out of stored content reliably"
                )));
            }
            if value.as_bytes().windows(MARK.len()).any(|w| w == MARK) {
                return Err(MiddlewareError::Config(format!(
                    "secret {name}: its value contains `{{{{casfs-`, which casfs's placeholders \
                     begin with"
                )));
            }
            names.push(name);
            values.push(value);
        }
        if names.is_empty() {
            return Ok(Secrets::default());
        }
        let find = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&values)
            .map_err(|e| MiddlewareError::Config(format!("secrets: {e}")))?;
        Ok(Secrets {
            names,
            values,
            find: Some(find),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// `data` as it is stored: every secret value replaced by its placeholder and every
    /// `{{casfs-` of the data's own escaped, and the names of the secrets found; `None`
    /// if it holds neither (then it is stored as it is).
    pub fn scrub(&self, data: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
        let found: Vec<(usize, usize, usize)> = match &self.find {
            Some(f) => f
                .find_iter(data)
                .map(|m| (m.start(), m.end(), m.pattern().as_usize()))
                .collect(),
            None => Vec::new(),
        };
        if found.is_empty() && memchr::memmem::find(data, MARK).is_none() {
            return None;
        }
        let mut out = Vec::with_capacity(data.len() + 16);
        let mut at = 0;
        let mut names: Vec<usize> = Vec::new();
        for (start, end, i) in found {
            escape_into(&data[at..start], &mut out);
            out.extend_from_slice(placeholder(&self.names[i]).as_bytes());
            names.push(i);
            at = end;
        }
        escape_into(&data[at..], &mut out);
        names.sort_unstable();
        names.dedup();
        Some((
            out,
            names.into_iter().map(|i| self.names[i].clone()).collect(),
        ))
    }

    /// Stored `data` as it was written: the placeholders casfs put in replaced by the
    /// values of the secrets still defined (those of secrets no longer defined stay),
    /// and what [`Secrets::scrub`] escaped given back; `None` if it has neither.
    pub fn fill(&self, data: &[u8]) -> Option<Vec<u8>> {
        let mut next = memchr::memmem::find(data, MARK)?;
        let mut out = Vec::with_capacity(data.len());
        let mut at = 0;
        loop {
            out.extend_from_slice(&data[at..next]);
            let rest = &data[next + MARK.len()..];
            at = next + MARK.len();
            out.extend_from_slice(MARK);
            if rest.first() == Some(&ESCAPED) {
                // The data's own: the mark without its escape.
                at += 1;
            } else if let Some((i, len)) = self.placeholder_at(rest) {
                out.truncate(out.len() - MARK.len());
                out.extend_from_slice(self.values[i].as_bytes());
                at += len;
            }
            match memchr::memmem::find(&data[at..], MARK) {
                Some(n) => next = at + n,
                None => break,
            }
        }
        out.extend_from_slice(&data[at..]);
        Some(out)
    }

    /// The secret whose placeholder `rest` (what follows a mark) begins with, and the
    /// placeholder's length after the mark.
    fn placeholder_at(&self, rest: &[u8]) -> Option<(usize, usize)> {
        let tail = &PLACEHOLDER_PREFIX.as_bytes()[MARK.len()..];
        let name_etc = rest.strip_prefix(tail)?;
        let end = memchr::memmem::find(&name_etc[..name_etc.len().min(102)], b"}}")?;
        let name = &name_etc[..end];
        let i = self.names.iter().position(|n| n.as_bytes() == name)?;
        Some((i, tail.len() + end + PLACEHOLDER_SUFFIX.len()))
    }

    /// The name of the first secret whose value `data` holds.
    pub fn found_in(&self, data: &[u8]) -> Option<&str> {
        let m = self.find.as_ref()?.find(data)?;
        Some(&self.names[m.pattern().as_usize()])
    }

    /// `s` with every secret value replaced by its placeholder.
    pub fn scrub_str(&self, s: &str) -> String {
        match self.scrub(s.as_bytes()) {
            // Values and placeholders are whole strings: UTF-8 in, UTF-8 out.
            Some((out, _)) => String::from_utf8(out).expect("UTF-8 in, UTF-8 out"),
            None => s.to_string(),
        }
    }

    /// `s` with the placeholders of defined secrets replaced by their values.
    pub fn fill_str(&self, s: &str) -> String {
        match self.fill(s.as_bytes()) {
            Some(out) => String::from_utf8(out).expect("UTF-8 in, UTF-8 out"),
            None => s.to_string(),
        }
    }

    /// `v` as it is stored: every secret value in its strings and object keys replaced
    /// by its placeholder, and every `{{casfs-` of their own escaped. Values are
    /// scrubbed before they are encoded: in the encoded form a value next to `"` or
    /// `\` is escaped and would no longer be found.
    pub fn scrub_json(&self, v: &serde_json::Value) -> serde_json::Value {
        self.map_json(v, &|s| self.scrub_str(s))
    }

    /// Stored `v` as it was written: the placeholders in its strings and keys replaced
    /// by the values, and what was escaped given back.
    pub fn fill_json(&self, v: &serde_json::Value) -> serde_json::Value {
        self.map_json(v, &|s| self.fill_str(s))
    }

    fn map_json(&self, v: &serde_json::Value, f: &dyn Fn(&str) -> String) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => Value::String(f(s)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.map_json(x, f)).collect()),
            Value::Object(m) => {
                Value::Object(m.iter().map(|(k, x)| (f(k), self.map_json(x, f))).collect())
            }
            other => other.clone(),
        }
    }
}

fn placeholder(name: &str) -> String {
    format!("{PLACEHOLDER_PREFIX}{name}{PLACEHOLDER_SUFFIX}")
}

/// `part` onto `out` with every [`MARK`] in it escaped.
fn escape_into(part: &[u8], out: &mut Vec<u8>) {
    let mut at = 0;
    for i in memchr::memmem::find_iter(part, MARK) {
        out.extend_from_slice(&part[at..i + MARK.len()]);
        out.push(ESCAPED);
        at = i + MARK.len();
    }
    out.extend_from_slice(&part[at..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(pairs: &[(&str, &str)]) -> MiddlewareResult<Secrets> {
        Secrets::new(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn scrub_and_fill_round_trip() {
        let s = secrets(&[("API_KEY", "sk-live-123456"), ("DB", "hunter2hunter2")]).unwrap();
        let text = b"key=sk-live-123456\npw=hunter2hunter2 again sk-live-123456\n";
        let (scrubbed, names) = s.scrub(text).unwrap();
        let scrubbed_text = String::from_utf8(scrubbed.clone()).unwrap();
        assert!(!scrubbed_text.contains("sk-live"), "{scrubbed_text}");
        assert!(!scrubbed_text.contains("hunter2"), "{scrubbed_text}");
        assert!(scrubbed_text.contains("{{casfs-secret:API_KEY}}"));
        assert_eq!(names, vec!["API_KEY".to_string(), "DB".to_string()]);
        assert_eq!(s.fill(&scrubbed).unwrap(), text.to_vec());
        assert!(s.scrub(b"nothing here").is_none());
        assert!(s.fill(b"nothing here").is_none());
    }

    #[test]
    fn a_longer_value_wins_over_its_prefix() {
        let s = secrets(&[("SHORT", "abcdef"), ("LONG", "abcdefghij")]).unwrap();
        let (out, names) = s.scrub(b"x abcdefghij y abcdef").unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "x {{casfs-secret:LONG}} y {{casfs-secret:SHORT}}"
        );
        assert_eq!(names, vec!["LONG".to_string(), "SHORT".to_string()]);
    }

    #[test]
    fn json_is_scrubbed_before_it_is_encoded() {
        let s = secrets(&[("API_KEY", "sk\"live\\123")]).unwrap();
        let v = serde_json::json!([
            {"role": "user", "content": "use sk\"live\\123 please"},
            {"sk\"live\\123": ["x", 1, null, "sk\"live\\123"]}
        ]);
        let scrubbed = s.scrub_json(&v);
        let bytes = serde_json::to_vec(&scrubbed).unwrap();
        assert!(s.found_in(&bytes).is_none());
        // Neither the value nor its escaped form is left.
        let text = String::from_utf8(bytes).unwrap();
        assert!(!text.contains("live"), "{text}");
        assert_eq!(s.fill_json(&scrubbed), v);
        assert_eq!(s.found_in(b"a sk\"live\\123 b"), Some("API_KEY"));
    }

    /// Boundary 4 (secrets): text that looks like a placeholder is data. A client that
    /// writes one gets the same text back, never a value; only casfs's own expand.
    #[test]
    fn a_placeholder_a_client_wrote_comes_back_as_written() {
        let s = secrets(&[("API_KEY", "sk-live-123456")]).unwrap();
        for text in [
            "{{casfs-secret:API_KEY}}",
            "x {{casfs-secret:API_KEY}} and sk-live-123456",
            "{{casfs-~secret:API_KEY}}",
            "{{casfs-~~",
            "{{casfs-",
            "{{casfs-{{casfs-secret:API_KEY}}",
            "{{casfs-secret:NOPE}}",
            "{{cas{{casfs-secret:API_KEY}}",
        ] {
            let (stored, _) = s.scrub(text.as_bytes()).unwrap();
            let stored = String::from_utf8(stored).unwrap();
            assert!(!stored.contains("sk-live"), "{stored}");
            let back = String::from_utf8(s.fill(stored.as_bytes()).unwrap()).unwrap();
            assert_eq!(back, text, "stored as {stored:?}");
        }
        // Without secrets too: what is stored is escaped all the same, so secrets set
        // later never expand a client's text.
        let none = Secrets::default();
        let (stored, names) = none.scrub(b"{{casfs-secret:API_KEY}}").unwrap();
        assert!(names.is_empty());
        assert_eq!(s.fill(&stored).unwrap(), b"{{casfs-secret:API_KEY}}");
        let v = serde_json::json!({"{{casfs-secret:API_KEY}}": ["{{casfs-secret:API_KEY}}"]});
        assert_eq!(s.fill_json(&s.scrub_json(&v)), v);
        assert_eq!(s.fill_json(&none.scrub_json(&v)), v);
    }

    proptest::proptest! {
        /// Whatever the text, stored and read back it is the same, and the stored form
        /// holds no value.
        #[test]
        fn scrub_then_fill_gives_the_text_back(parts in proptest::collection::vec(
            proptest::sample::select(vec![
                "{{", "casfs-", "{{casfs-", "~", "secret:", "API_KEY", "}}", "sk-live-123456",
                "x", "{{casfs-secret:API_KEY}}", "{{casfs-~",
            ]),
            0..12,
        )) {
            let s = secrets(&[("API_KEY", "sk-live-123456")]).unwrap();
            let text = parts.concat();
            let stored = s.scrub(text.as_bytes()).map_or(text.clone().into_bytes(), |(b, _)| b);
            proptest::prop_assert!(s.found_in(&stored).is_none());
            let back = s.fill(&stored).unwrap_or_else(|| stored.clone());
            proptest::prop_assert_eq!(String::from_utf8(back).unwrap(), text);
        }
    }

    #[test]
    fn bad_secrets_are_named() {
        let e = secrets(&[("K", "abc")]).unwrap_err().to_string();
        assert!(e.contains("secret K") && e.contains("shorter"), "{e}");
        let e = secrets(&[("a b", "abcdefgh")]).unwrap_err().to_string();
        assert!(e.contains("\"a b\""), "{e}");
        assert!(!format!("{:?}", secrets(&[("K", "abcdefgh")]).unwrap()).contains("abcdefgh"));
    }
}
