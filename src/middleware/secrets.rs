//! Secret values a workspace resolves (tokens, keys): never stored. Captured content
//! has each value replaced by a placeholder naming its secret, and a restore puts the
//! current value back.

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, MatchKind};

use super::{MiddlewareError, MiddlewareResult};

/// Placeholders are `{{casfs-secret:NAME}}`.
pub const PLACEHOLDER_PREFIX: &str = "{{casfs-secret:";
const PLACEHOLDER_SUFFIX: &str = "}}";

/// The shortest value looked for: a shorter one would match all over ordinary files.
const MIN_SECRET_LEN: usize = 6;

/// The resolved secrets of a workspace, by name.
#[derive(Clone, Default)]
pub struct Secrets {
    names: Vec<String>,
    values: Vec<String>,
    find: Option<AhoCorasick>,
    put_back: Option<AhoCorasick>,
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
            if value.contains(PLACEHOLDER_PREFIX) {
                return Err(MiddlewareError::Config(format!(
                    "secret {name}: its value contains a placeholder"
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
        let holders: Vec<String> = names.iter().map(|n| placeholder(n)).collect();
        let put_back = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&holders)
            .map_err(|e| MiddlewareError::Config(format!("secrets: {e}")))?;
        Ok(Secrets {
            names,
            values,
            find: Some(find),
            put_back: Some(put_back),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// `data` with every secret value replaced by its placeholder, and the names of the
    /// secrets found; `None` if it holds none.
    pub fn scrub(&self, data: &[u8]) -> Option<(Vec<u8>, Vec<String>)> {
        let find = self.find.as_ref()?;
        let mut found: Vec<usize> = find
            .find_iter(data)
            .map(|m| m.pattern().as_usize())
            .collect();
        if found.is_empty() {
            return None;
        }
        found.sort_unstable();
        found.dedup();
        let holders: Vec<String> = self.names.iter().map(|n| placeholder(n)).collect();
        let out = find.replace_all_bytes(data, &holders);
        Some((
            out,
            found.into_iter().map(|i| self.names[i].clone()).collect(),
        ))
    }

    /// `data` with the placeholders of defined secrets replaced by their values (those
    /// of secrets no longer defined stay), or `None` if it has none.
    pub fn fill(&self, data: &[u8]) -> Option<Vec<u8>> {
        let put_back = self.put_back.as_ref()?;
        if !put_back.is_match(data) {
            return None;
        }
        Some(put_back.replace_all_bytes(data, &self.values))
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

    /// `v` with every secret value in its strings and object keys replaced by its
    /// placeholder. Values are scrubbed before they are encoded: in the encoded form a
    /// value next to `"` or `\` is escaped and would no longer be found.
    pub fn scrub_json(&self, v: &serde_json::Value) -> serde_json::Value {
        self.map_json(v, &|s| self.scrub_str(s))
    }

    /// `v` with the placeholders in its strings and keys replaced by the values.
    pub fn fill_json(&self, v: &serde_json::Value) -> serde_json::Value {
        self.map_json(v, &|s| self.fill_str(s))
    }

    fn map_json(&self, v: &serde_json::Value, f: &dyn Fn(&str) -> String) -> serde_json::Value {
        use serde_json::Value;
        if self.is_empty() {
            return v.clone();
        }
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

    #[test]
    fn bad_secrets_are_named() {
        let e = secrets(&[("K", "abc")]).unwrap_err().to_string();
        assert!(e.contains("secret K") && e.contains("shorter"), "{e}");
        let e = secrets(&[("a b", "abcdefgh")]).unwrap_err().to_string();
        assert!(e.contains("\"a b\""), "{e}");
        assert!(!format!("{:?}", secrets(&[("K", "abcdefgh")]).unwrap()).contains("abcdefgh"));
    }
}
