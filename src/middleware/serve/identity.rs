//! Who is asking: every request of `casfs serve` has a [`Caller`], and every object it
//! reaches belongs to one principal.
//!
//! - On the Unix socket the caller is the peer's Unix user, as the kernel gave it when
//!   the connection was made (`SO_PEERCRED`, [`Peer`]): root, the server's own user and
//!   the members of `--admin-group` (the peer's groups, `SO_PEERGROUPS`) are
//!   administrators; any other user is the tenant named after them (their user name, or
//!   their uid where the name is not a tenant name).
//! - On loopback TCP the caller is the holder of the token sent: the administrators'
//!   token (`--token-file`, `CASFS_TOKEN`), or one of the tenants' (`--tenant-tokens`).
//!
//! A tenant's threads are its own (`ThreadId::in_tenant`): every thread name a tenant
//! sends is put in its space, so runs, sandboxes, checkpoints, leases, messages and
//! artifacts of other tenants are never named at all; so are its portable stores
//! ([`Caller::store`]) and run ids ([`Caller::run_key`]). What is named by id (a
//! checkpoint, a sandbox key) is checked to be the caller's, and one that is not is
//! "not found", as one that does not exist. Administrators name every thread as
//! stored (`alice/main`) and may maintain the store; a tenant may not.

use axum::http::StatusCode;

use super::error::ApiError;
use super::peer::Peer;
use crate::checkpoint::{check_tenant_name, Checkpoint, ThreadId};
use crate::fs::Owner;

/// Whose objects a request reaches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Principal {
    /// Root, the server's own user, a member of `--admin-group`, or the holder of the
    /// administrators' token: every object, and maintenance.
    Admin,
    /// A tenant (a Unix user, or a TCP token's tenant): only its own objects.
    Tenant(String),
}

/// The caller of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub principal: Principal,
    /// Whose files a sandbox this caller makes are: a Unix peer that is not the
    /// server's own user (None: the server's user).
    pub owner: Option<Owner>,
}

/// How callers are told apart: the administrators' group and the tokens.
#[derive(Clone, Default)]
pub struct Identities {
    /// Members of this group (on the socket) are administrators.
    pub admin_group: Option<u32>,
    /// The administrators' token (TCP; on the socket it only gates).
    pub admin_token: Option<String>,
    /// Tokens of tenants: (tenant, token).
    pub tenant_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for Identities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tokens.
        f.debug_struct("Identities")
            .field("admin_group", &self.admin_group)
            .field("admin_token", &self.admin_token.is_some())
            .field(
                "tenants",
                &self
                    .tenant_tokens
                    .iter()
                    .map(|(t, _)| t.as_str())
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// The shortest token taken.
pub const MIN_TOKEN_LEN: usize = 16;

impl Identities {
    /// Whether any token is set (then every request must send one).
    pub fn tokens(&self) -> bool {
        self.admin_token.is_some() || !self.tenant_tokens.is_empty()
    }

    /// The tenants' tokens from the text of a `--tenant-tokens` file: one `TENANT TOKEN`
    /// a line, `#` comments and blank lines ignored; every token at least 16
    /// characters and used once.
    pub fn parse_tenant_tokens(text: &str) -> Result<Vec<(String, String)>, String> {
        let mut out: Vec<(String, String)> = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let n = i + 1;
            let mut parts = line.split_whitespace();
            let (Some(tenant), Some(token), None) = (parts.next(), parts.next(), parts.next())
            else {
                return Err(format!("line {n}: give TENANT TOKEN"));
            };
            check_tenant_name(tenant).map_err(|e| format!("line {n}: {e}"))?;
            if token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "line {n}: the token of tenant {tenant} is shorter than {MIN_TOKEN_LEN} \
                     characters"
                ));
            }
            if out.iter().any(|(_, t)| t == token) {
                return Err(format!("line {n}: a token given twice"));
            }
            out.push((tenant.to_string(), token.to_string()));
        }
        Ok(out)
    }

    /// Who holds `token` (compared in constant time with each), if anyone.
    pub(super) fn holder(&self, token: &str) -> Option<Principal> {
        let mut found = None;
        if let Some(a) = &self.admin_token {
            if crate::checkpoint::same_secret(a.as_bytes(), token.as_bytes()) {
                found = Some(Principal::Admin);
            }
        }
        for (tenant, t) in &self.tenant_tokens {
            if crate::checkpoint::same_secret(t.as_bytes(), token.as_bytes()) && found.is_none() {
                found = Some(Principal::Tenant(tenant.clone()));
            }
        }
        found
    }

    /// The caller on the Unix socket whose peer is `peer`.
    pub(super) fn of_peer(&self, peer: &Peer) -> Result<Caller, ApiError> {
        let Some(uid) = peer.uid() else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "the kernel did not say who is at the other end of this connection",
            ));
        };
        let admin = uid == 0
            || uid == crate::mount::namespace::euid()
            || self
                .admin_group
                .is_some_and(|g| peer.gid() == Some(g) || peer.in_group(g));
        let principal = if admin {
            Principal::Admin
        } else {
            // A user database that cannot answer now must not make the caller someone
            // else (a tenant named by the uid): they are asked to come back.
            Principal::Tenant(tenant_of_uid(uid).map_err(|e| {
                ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "busy",
                    format!("telling who user {uid} is: the user database answered {e}; try again"),
                )
            })?)
        };
        Ok(Caller {
            principal,
            owner: peer.owner(),
        })
    }
}

/// The tenant of Unix user `uid`: their user name, or the uid in decimal where the
/// name is no tenant name (or the user has no entry); an error when the user database
/// cannot say.
pub fn tenant_of_uid(uid: u32) -> std::io::Result<String> {
    Ok(match user_name(uid)? {
        Some(n) if check_tenant_name(&n).is_ok() => n,
        _ => uid.to_string(),
    })
}

fn user_name(uid: u32) -> std::io::Result<Option<String>> {
    Ok(crate::sys::users::user_name(uid)?.and_then(|n| n.into_string().ok()))
}

/// What the token layer found a TCP request's token to be.
#[derive(Debug, Clone)]
pub(super) struct TokenHolder(pub Principal);

impl Caller {
    /// The server's own user.
    pub fn admin() -> Caller {
        Caller {
            principal: Principal::Admin,
            owner: None,
        }
    }

    pub fn is_admin(&self) -> bool {
        self.principal == Principal::Admin
    }

    /// The caller's tenant (None: an administrator).
    pub fn tenant(&self) -> Option<&str> {
        match &self.principal {
            Principal::Admin => None,
            Principal::Tenant(t) => Some(t),
        }
    }

    /// Refuses a tenant what only administrators may do.
    pub fn require_admin(&self, what: &str) -> Result<(), ApiError> {
        match &self.principal {
            Principal::Admin => Ok(()),
            Principal::Tenant(t) => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("{what} is for the server's administrators; tenant {t} may not"),
            )),
        }
    }

    /// The thread a caller names `name`: a tenant's own (`tenant/name`, the name a plain
    /// one); an administrator's as written (`main`, or a tenant's `alice/main`).
    pub fn thread(&self, name: &str) -> Result<ThreadId, ApiError> {
        let t = match &self.principal {
            Principal::Admin => ThreadId::new(name),
            Principal::Tenant(t) => ThreadId::in_tenant(t, name),
        };
        t.map_err(|e| ApiError::bad(e.to_string()))
    }

    /// Whether thread `t` is the caller's to see and change.
    pub fn owns(&self, t: &ThreadId) -> bool {
        match &self.principal {
            Principal::Admin => true,
            Principal::Tenant(me) => t.tenant() == Some(me.as_str()),
        }
    }

    /// Thread `t` as the caller names it.
    pub fn show<'a>(&self, t: &'a ThreadId) -> &'a str {
        match &self.principal {
            Principal::Admin => t.as_str(),
            Principal::Tenant(_) => t.name(),
        }
    }

    /// A checkpoint record as the caller sees it: its thread named as they name it.
    pub fn show_checkpoint(&self, cp: &Checkpoint) -> serde_json::Value {
        let mut v = super::error::to_json(cp);
        self.show_thread_field(&mut v, "thread_id", &cp.body.thread_id);
        v
    }

    /// Renames field `field` of `v` (thread `t`) as the caller names it.
    pub fn show_thread_field(&self, v: &mut serde_json::Value, field: &str, t: &ThreadId) {
        if let Some(x) = v.get_mut(field) {
            *x = serde_json::Value::String(self.show(t).to_string());
        }
    }

    /// The portable store a caller names `name` (a tenant's are its own).
    pub fn store(&self, name: &str) -> String {
        match &self.principal {
            Principal::Admin => name.to_string(),
            Principal::Tenant(t) => format!("{t}/{name}"),
        }
    }

    /// The key of run `id` of this caller among the server's runs: `tenant/id`, or
    /// `/id` for an administrator's (a tenant's name is never empty and holds no '/',
    /// so no two callers' runs share a key, whatever '/' their ids hold).
    pub(super) fn run_key(&self, id: &str) -> String {
        match &self.principal {
            Principal::Admin => format!("/{id}"),
            Principal::Tenant(t) => format!("{t}/{id}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_names_only_its_own_threads() {
        let alice = Caller {
            principal: Principal::Tenant("alice".into()),
            owner: None,
        };
        let t = alice.thread("main").unwrap();
        assert_eq!(t.as_str(), "alice/main");
        assert!(alice.owns(&t));
        assert_eq!(alice.show(&t), "main");
        // Naming another tenant's thread is not possible: no '/' in a name.
        assert!(alice.thread("bob/main").is_err());
        assert!(!alice.owns(&ThreadId::new("bob/main").unwrap()));
        assert!(!alice.owns(&ThreadId::new("main").unwrap()));
        let admin = Caller::admin();
        assert_eq!(admin.thread("bob/main").unwrap().as_str(), "bob/main");
        assert!(admin.owns(&ThreadId::new("bob/main").unwrap()));
        assert_eq!(alice.store("s"), "alice/s");
        assert_eq!(alice.run_key("r"), "alice/r");
        // An administrator's run `alice/r` is not alice's run `r`.
        assert_ne!(admin.run_key("alice/r"), alice.run_key("r"));
        assert!(alice.require_admin("maintenance").is_err());
    }

    #[test]
    fn tenant_tokens_are_checked_and_held() {
        let text = "# tenants\nalice 0123456789abcdef0123\n\n bob  fedcba9876543210fedc \n";
        let t = Identities::parse_tenant_tokens(text).unwrap();
        assert_eq!(t.len(), 2);
        let ids = Identities {
            admin_token: Some("admin-token-0123456789".into()),
            tenant_tokens: t,
            ..Identities::default()
        };
        assert_eq!(
            ids.holder("0123456789abcdef0123"),
            Some(Principal::Tenant("alice".into()))
        );
        assert_eq!(ids.holder("admin-token-0123456789"), Some(Principal::Admin));
        assert_eq!(ids.holder("0123456789abcdef012"), None);
        for bad in [
            "alice short",
            "alice",
            "a b c",
            "-x 0123456789abcdef0123",
            "a 0123456789abcdef0123\nb 0123456789abcdef0123",
        ] {
            assert!(Identities::parse_tenant_tokens(bad).is_err(), "{bad:?}");
        }
        assert!(!format!("{ids:?}").contains("0123456789abcdef"));
    }
}
