//! Sandbox keys: the directory name of a run's sandbox, made from its tenant and
//! thread so that two different pairs never share one ([`sandbox_key`]), and the checks
//! of a tenant and of a key a provider made.

use crate::checkpoint::ThreadId;
use crate::middleware::error::{MiddlewareError, MiddlewareResult};

/// The longest sandbox key; longer ones end in a hash of the whole.
const MAX_KEY_LEN: usize = 200;

/// The sandbox key of a run on `thread` for `tenant`: a directory name that two
/// different pairs never share. Letters, digits, `_` and `-` stay, as does `.` but
/// first; every other byte is `%XX`. The thread's owner (a tenant's thread,
/// `alice/main`) comes first, joined by `@`, then the run's tenant label, joined by `+`
/// (the escaping never leaves either in a part), then the thread's name. A key that
/// would be longer than 200 bytes is cut and ends in `~` and a hash of the whole (`~`
/// never appears otherwise).
pub fn sandbox_key(tenant: Option<&str>, thread: &ThreadId) -> String {
    fn escape(part: &str, out: &mut String) {
        for (i, b) in part.bytes().enumerate() {
            let keep = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
            if keep {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
    }
    let mut key = String::new();
    if let Some(owner) = thread.tenant() {
        escape(owner, &mut key);
        key.push('@');
    }
    if let Some(t) = tenant {
        escape(t, &mut key);
        key.push('+');
    }
    escape(thread.name(), &mut key);
    if key.len() <= MAX_KEY_LEN {
        return key;
    }
    let mut h = blake3::Hasher::new();
    if let Some(t) = tenant {
        h.update(&(t.len() as u64).to_le_bytes());
        h.update(t.as_bytes());
    }
    h.update(thread.as_str().as_bytes());
    let hash = h.finalize().to_hex();
    // Escaped keys are ASCII: any byte index is a character boundary.
    format!("{}~{}", &key[..MAX_KEY_LEN - 33], &hash[..32])
}

/// Checks a run's tenant: 1 to 200 bytes (any characters: the sandbox key escapes them).
pub fn check_tenant(tenant: &str) -> Result<(), String> {
    if tenant.is_empty() || tenant.len() > 200 {
        return Err(format!("tenant {tenant:?}: use 1 to 200 bytes"));
    }
    Ok(())
}

/// Checks a sandbox key a provider made: it names one directory under the provider's.
pub(super) fn check_key(key: &str) -> MiddlewareResult<()> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY_LEN
        && !key.starts_with('.')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-:@%+~".contains(c));
    if ok {
        Ok(())
    } else {
        Err(MiddlewareError::Sandbox {
            key: key.to_string(),
            detail: "a sandbox key is 1 to 200 of A-Z a-z 0-9 _ . - : @ % + ~, not starting \
                     with '.' (it names a directory)"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> ThreadId {
        ThreadId::new(s).unwrap()
    }

    #[test]
    fn sandbox_keys_never_collide_and_name_one_directory() {
        let pairs: Vec<(Option<&str>, &str)> = vec![
            (None, "t"),
            (Some("a"), "b.c"),
            (Some("a.b"), "c"),
            (Some("a+b"), "c"),
            (Some("a"), "b+c"),
            (None, "a+b"),
            (None, "a%2Bb"),
            (Some("../.."), "x"),
            (Some("/etc"), "passwd"),
            (None, ".."),
            (None, ".hidden"),
            (None, "üñï"),
            (None, "alice/main"),
            (Some("alice"), "main"),
            (None, "alice/b.c"),
            (Some("x"), "alice/main"),
            (None, "alice@main"),
        ];
        let mut seen = std::collections::HashMap::new();
        for (tenant, thread) in &pairs {
            let k = sandbox_key(*tenant, &t(thread));
            check_key(&k).unwrap();
            assert!(!k.contains('/') && k != "." && k != "..", "{k}");
            if let Some(prev) = seen.insert(k.clone(), (tenant, thread)) {
                panic!("{k} for both {prev:?} and {:?}", (tenant, thread));
            }
        }
        assert_eq!(sandbox_key(None, &t("t")), "t");
        assert_eq!(sandbox_key(Some("acme"), &t("t-1")), "acme+t-1");
        assert_eq!(sandbox_key(None, &t("alice/main")), "alice@main");
        assert_eq!(
            sandbox_key(Some("tanstack"), &t("alice/t-1")),
            "alice@tanstack+t-1"
        );
        let long = "x".repeat(200);
        let a = sandbox_key(Some(&long), &t(&long));
        let b = sandbox_key(Some(&long), &t(&format!("{}y", &long[..199])));
        assert!(a.len() <= MAX_KEY_LEN && a.contains('~'), "{a}");
        assert_ne!(a, b);
        check_key(&a).unwrap();
    }
}
