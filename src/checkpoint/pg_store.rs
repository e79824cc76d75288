//! [`CheckpointStore`] on PostgreSQL, for fleets: many hosts share checkpoints, heads
//! and writer leases.
//!
//! Tables (in the schema the URL's `schema=` parameter names, default `public`):
//! `casfs_checkpoints` (id, thread, body: the canonical record), `casfs_heads` (thread ->
//! id), `casfs_leases` (thread -> holder, token, acquired_at, expires_at, ttl_ms,
//! owner_digest: the hash of the lease's owner secret),
//! `casfs_fencing` (thread -> last token handed out), `casfs_pruned` (checkpoints
//! retention removed: id, thread, when), `casfs_pins` (holder, id: the checkpoints
//! each host's mounts read from, which retention keeps), `casfs_portable` (the portable
//! checkpoint stores' keys and values, `middleware::portable`), `casfs_meta` (schema
//! version).
//! casfs creates them on first use (under an advisory lock, so hosts starting together
//! do not race).
//!
//! Every operation that checks and changes is one transaction that locks the thread's
//! fencing row first (`SELECT ... FOR UPDATE`), so operations on one thread are
//! serialized across hosts. Lease expiry is measured by the database's clock (`now()`),
//! which every host shares: a host whose clock is off cannot keep a lease alive, nor
//! cut another's short.
//!
//! Pins and retention meet under one advisory lock: a pin takes it shared, a removal
//! exclusively, and the removal's delete (a statement that starts once the lock is
//! held) sees every pin committed before. A mount reads a checkpoint only after its
//! pin committed, so it reads a record retention keeps or finds it gone.
//!
//! The password comes from `PGPASSWORD` (or a `.pgpass` file), never from the URL.

use crate::sys::Locked;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use postgres::{Client, NoTls, Transaction};

use super::checkpoint_store::CheckpointStore;
use super::checkpoint_store::{check_leases, Bookkeeping};
use super::ids::{CheckpointError, CheckpointId, CheckpointResult, ThreadId};
use super::lease::{LeaseRecord, OwnerToken, WriterLease};
use super::portable_kv::{KvTx, PortableKv};
use super::record::{Checkpoint, NewCheckpoint};
use crate::cas::Hash;

/// Version 2 added `casfs_leases.owner_digest`: a casfs that checks no owner secret
/// (version 1) must not share the tables with one that does. Version 3 added
/// `casfs_pruned`: a casfs without it would take a pruned parent for a lost one.
/// Version 4 added `casfs_pins`: a casfs that writes none must not share the tables
/// with one whose retention trusts them.
const SCHEMA_VERSION: i32 = 4;

/// The advisory lock pins (shared) and the removal of records (exclusive) take.
const PIN_LOCK: i64 = 727236;

pub struct PgCheckpointStore {
    client: Mutex<Client>,
    /// The URL without credentials or query, for messages.
    name: String,
}

impl PgCheckpointStore {
    /// Connects to `url` (`postgres://user@host:port/db?schema=NAME`) and creates the
    /// tables if they are missing.
    pub fn open(url: &str) -> CheckpointResult<PgCheckpointStore> {
        let name = crate::cas::remote_store::redact_url(url);
        let bad = |d: String| CheckpointError::Invalid(format!("checkpoint store {name}: {d}"));
        let mut parsed = url::Url::parse(url).map_err(|e| bad(e.to_string()))?;
        if parsed.password().is_some() {
            return Err(bad(
                "a password does not belong in the URL; give it in PGPASSWORD".into(),
            ));
        }
        let mut schema = "public".to_string();
        let rest: Vec<(String, String)> = parsed
            .query_pairs()
            .filter(|(k, v)| {
                if k == "schema" {
                    schema = v.to_string();
                    false
                } else {
                    true
                }
            })
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        if schema.is_empty()
            || !schema
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            return Err(bad(format!(
                "schema {schema:?}: use letters, digits and '_'"
            )));
        }
        parsed.set_query(None);
        if !rest.is_empty() {
            parsed.query_pairs_mut().extend_pairs(rest);
        }
        let mut config: postgres::Config = parsed
            .as_str()
            .parse()
            .map_err(|e: postgres::Error| bad(e.to_string()))?;
        if let Ok(pw) = std::env::var("PGPASSWORD") {
            config.password(pw);
        }
        config.connect_timeout(Duration::from_secs(10));
        config.application_name("casfs");
        let mut client = config
            .connect(NoTls)
            .map_err(|e| bad(format!("connecting: {e}")))?;
        let migrate = format!(
            "SELECT pg_advisory_lock(727235);
             CREATE SCHEMA IF NOT EXISTS {schema};
             SET search_path TO {schema};
             CREATE TABLE IF NOT EXISTS casfs_meta (key text PRIMARY KEY, value text NOT NULL);
             CREATE TABLE IF NOT EXISTS casfs_checkpoints (
                 id bytea PRIMARY KEY, thread text NOT NULL, body bytea NOT NULL);
             CREATE INDEX IF NOT EXISTS casfs_checkpoints_thread ON casfs_checkpoints (thread);
             CREATE TABLE IF NOT EXISTS casfs_heads (thread text PRIMARY KEY, id bytea NOT NULL);
             CREATE TABLE IF NOT EXISTS casfs_leases (
                 thread text PRIMARY KEY, holder text NOT NULL, token bigint NOT NULL,
                 acquired_at timestamptz NOT NULL, expires_at timestamptz NOT NULL,
                 ttl_ms bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS casfs_fencing (thread text PRIMARY KEY, token bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS casfs_portable (k bytea PRIMARY KEY, v bytea NOT NULL);
             CREATE TABLE IF NOT EXISTS casfs_pruned (
                 id bytea PRIMARY KEY, thread text NOT NULL,
                 pruned_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE IF NOT EXISTS casfs_pins (
                 holder text NOT NULL, id bytea NOT NULL,
                 pinned_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (holder, id));
             ALTER TABLE casfs_leases ADD COLUMN IF NOT EXISTS owner_digest text NOT NULL DEFAULT '';
             INSERT INTO casfs_meta VALUES ('schema_version', '{SCHEMA_VERSION}')
                 ON CONFLICT (key) DO NOTHING;
             UPDATE casfs_meta SET value = '{SCHEMA_VERSION}'
                 WHERE key = 'schema_version' AND value IN ('1', '2', '3');
             SELECT pg_advisory_unlock(727235);"
        );
        client
            .batch_execute(&migrate)
            .map_err(|e| bad(format!("creating tables: {e}")))?;
        let v: String = client
            .query_one(
                "SELECT value FROM casfs_meta WHERE key = 'schema_version'",
                &[],
            )
            .map_err(|e| bad(e.to_string()))?
            .get(0);
        if v != SCHEMA_VERSION.to_string() {
            return Err(bad(format!(
                "schema version {v}; this casfs reads version {SCHEMA_VERSION}"
            )));
        }
        Ok(PgCheckpointStore {
            client: Mutex::new(client),
            name,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn db_err(&self, e: postgres::Error) -> CheckpointError {
        CheckpointError::Invalid(format!("checkpoint store {}: {e}", self.name))
    }

    /// Runs `f` in a transaction (committed when it returns `Ok`).
    fn tx<T>(
        &self,
        f: impl FnOnce(&mut Transaction<'_>) -> CheckpointResult<T>,
    ) -> CheckpointResult<T> {
        let mut c = self.client.locked();
        if c.is_closed() {
            return Err(CheckpointError::Invalid(format!(
                "checkpoint store {}: the connection is closed",
                self.name
            )));
        }
        let mut t = c.transaction().map_err(|e| self.db_err(e))?;
        let r = f(&mut t)?;
        t.commit().map_err(|e| self.db_err(e))?;
        Ok(r)
    }

    /// Locks the thread's fencing row (creating it) and returns the last token.
    fn lock_thread(&self, t: &mut Transaction<'_>, thread: &ThreadId) -> CheckpointResult<u64> {
        t.execute(
            "INSERT INTO casfs_fencing VALUES ($1, 0) ON CONFLICT (thread) DO NOTHING",
            &[&thread.as_str()],
        )
        .map_err(|e| self.db_err(e))?;
        let row = t
            .query_one(
                "SELECT token FROM casfs_fencing WHERE thread = $1 FOR UPDATE",
                &[&thread.as_str()],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// The thread's lease as stored, with whether it is live by the database's clock.
    fn lease_row(
        &self,
        t: &mut Transaction<'_>,
        thread: &ThreadId,
    ) -> CheckpointResult<Option<(LeaseRecord, bool)>> {
        let row = t
            .query_opt(
                "SELECT holder, token,
                        (extract(epoch FROM acquired_at) * 1000)::bigint,
                        (extract(epoch FROM expires_at) * 1000)::bigint,
                        ttl_ms, expires_at > now(), owner_digest
                 FROM casfs_leases WHERE thread = $1",
                &[&thread.as_str()],
            )
            .map_err(|e| self.db_err(e))?;
        Ok(row.map(|r| {
            (
                LeaseRecord {
                    thread: thread.clone(),
                    holder: r.get(0),
                    token: r.get::<_, i64>(1) as u64,
                    acquired_at_ms: r.get::<_, i64>(2) as u64,
                    expires_at_ms: r.get::<_, i64>(3) as u64,
                    ttl_ms: r.get::<_, i64>(4) as u64,
                    owner_digest: r.get(6),
                },
                r.get::<_, bool>(5),
            )
        }))
    }

    /// Checks that `lease` is the thread's live, current lease (the thread locked);
    /// returns its record.
    fn check_lease(
        &self,
        t: &mut Transaction<'_>,
        lease: &WriterLease,
    ) -> CheckpointResult<LeaseRecord> {
        let current = self.lease_row(t, &lease.thread)?;
        super::checkpoint_store::check_current(lease, current.clone())?;
        Ok(current.expect("checked to be there").0)
    }

    fn head_in(
        &self,
        t: &mut Transaction<'_>,
        thread: &ThreadId,
    ) -> CheckpointResult<Option<CheckpointId>> {
        let row = t
            .query_opt(
                "SELECT id FROM casfs_heads WHERE thread = $1",
                &[&thread.as_str()],
            )
            .map_err(|e| self.db_err(e))?;
        row.map(|r| {
            let b: Vec<u8> = r.get(0);
            Hash::from_slice(&b)
                .map(CheckpointId)
                .ok_or_else(|| CheckpointError::Corrupt {
                    id: format!("head of thread {thread:?}"),
                    detail: format!("{} bytes", b.len()),
                })
        })
        .transpose()
    }

    fn get_in(&self, t: &mut Transaction<'_>, id: &CheckpointId) -> CheckpointResult<Checkpoint> {
        let row = t
            .query_opt(
                "SELECT body FROM casfs_checkpoints WHERE id = $1",
                &[&id.0.as_bytes().as_slice()],
            )
            .map_err(|e| self.db_err(e))?
            .ok_or_else(|| CheckpointError::NotFound(id.to_hex()))?;
        let body: Vec<u8> = row.get(0);
        Checkpoint::decode(id, &body)
    }

    fn put_checkpoint(&self, t: &mut Transaction<'_>, cp: &Checkpoint) -> CheckpointResult<()> {
        t.execute(
            "INSERT INTO casfs_checkpoints VALUES ($1, $2, $3) ON CONFLICT (id) DO NOTHING",
            &[
                &cp.id.0.as_bytes().as_slice(),
                &cp.body.thread_id.as_str(),
                &cp.encode(),
            ],
        )
        .map_err(|e| self.db_err(e))?;
        t.execute(
            "INSERT INTO casfs_heads VALUES ($1, $2)
             ON CONFLICT (thread) DO UPDATE SET id = EXCLUDED.id",
            &[&cp.body.thread_id.as_str(), &cp.id.0.as_bytes().as_slice()],
        )
        .map_err(|e| self.db_err(e))?;
        Ok(())
    }
}

impl CheckpointStore for PgCheckpointStore {
    fn acquire_writer(
        &self,
        thread: &ThreadId,
        holder: &str,
        ttl: Duration,
    ) -> CheckpointResult<WriterLease> {
        super::checkpoint_store::check_ttl(ttl)?;
        let ttl_ms = ttl.as_millis().max(1) as i64;
        self.tx(|t| {
            let last = self.lock_thread(t, thread)?;
            let current = self.lease_row(t, thread)?;
            super::checkpoint_store::check_free(thread, current)?;
            let token = last + 1;
            let owner = OwnerToken::generate();
            t.execute(
                "UPDATE casfs_fencing SET token = $2 WHERE thread = $1",
                &[&thread.as_str(), &(token as i64)],
            )
            .map_err(|e| self.db_err(e))?;
            let row = t
                .query_one(
                    "INSERT INTO casfs_leases
                         (thread, holder, token, acquired_at, expires_at, ttl_ms, owner_digest)
                         VALUES ($1, $2, $3, now(), now() + $4::bigint * interval '1 millisecond',
                                 $4::bigint, $5)
                     ON CONFLICT (thread) DO UPDATE SET holder = EXCLUDED.holder,
                         token = EXCLUDED.token, acquired_at = EXCLUDED.acquired_at,
                         expires_at = EXCLUDED.expires_at, ttl_ms = EXCLUDED.ttl_ms,
                         owner_digest = EXCLUDED.owner_digest
                     RETURNING (extract(epoch FROM acquired_at) * 1000)::bigint,
                               (extract(epoch FROM expires_at) * 1000)::bigint",
                    &[
                        &thread.as_str(),
                        &holder,
                        &(token as i64),
                        &ttl_ms,
                        &owner.digest(),
                    ],
                )
                .map_err(|e| self.db_err(e))?;
            Ok(WriterLease {
                thread: thread.clone(),
                holder: holder.to_string(),
                token,
                acquired_at_ms: row.get::<_, i64>(0) as u64,
                expires_at_ms: row.get::<_, i64>(1) as u64,
                ttl_ms: ttl_ms as u64,
                owner_token: owner,
            })
        })
    }

    fn renew(&self, lease: &WriterLease) -> CheckpointResult<WriterLease> {
        self.tx(|t| {
            self.lock_thread(t, &lease.thread)?;
            let mut record = self.check_lease(t, lease)?;
            let row = t
                .query_one(
                    "UPDATE casfs_leases SET expires_at = now() + ttl_ms * interval '1 millisecond'
                     WHERE thread = $1
                     RETURNING (extract(epoch FROM expires_at) * 1000)::bigint",
                    &[&lease.thread.as_str()],
                )
                .map_err(|e| self.db_err(e))?;
            record.expires_at_ms = row.get::<_, i64>(0) as u64;
            Ok(record.to_lease(&lease.owner_token))
        })
    }

    fn release(&self, lease: &WriterLease) -> CheckpointResult<()> {
        self.tx(|t| {
            let last = self.lock_thread(t, &lease.thread)?;
            let current = self.lease_row(t, &lease.thread)?.map(|(l, _)| l);
            if super::checkpoint_store::release_deletes(lease, current.as_ref(), last)? {
                t.execute(
                    "DELETE FROM casfs_leases WHERE thread = $1",
                    &[&lease.thread.as_str()],
                )
                .map_err(|e| self.db_err(e))?;
            }
            Ok(())
        })
    }

    fn head(&self, thread: &ThreadId) -> CheckpointResult<Option<CheckpointId>> {
        self.tx(|t| self.head_in(t, thread))
    }

    fn get(&self, id: &CheckpointId) -> CheckpointResult<Checkpoint> {
        self.tx(|t| self.get_in(t, id))
    }

    fn append(
        &self,
        new: NewCheckpoint,
        expected_head: Option<CheckpointId>,
        lease: &WriterLease,
    ) -> CheckpointResult<Checkpoint> {
        super::checkpoint_store::check_lease_thread(&new, lease)?;
        self.tx(|t| {
            self.lock_thread(t, &new.thread_id)?;
            self.check_lease(t, lease)?;
            let actual = self.head_in(t, &new.thread_id)?;
            if actual != expected_head {
                return Err(CheckpointError::HeadMismatch {
                    thread: new.thread_id.clone(),
                    expected: expected_head,
                    actual,
                });
            }
            if let Some(parent) = expected_head {
                self.get_in(t, &parent)?;
            }
            let cp = Checkpoint::from_new(new, expected_head, SystemTime::now());
            crate::crashpoint("append.before");
            self.put_checkpoint(t, &cp)?;
            Ok(cp)
        })
    }

    fn fork(&self, new_thread: &ThreadId, from: &CheckpointId) -> CheckpointResult<Checkpoint> {
        self.tx(|t| {
            self.lock_thread(t, new_thread)?;
            if self.head_in(t, new_thread)?.is_some() {
                return Err(CheckpointError::ThreadExists(new_thread.clone()));
            }
            if let Some((cur, true)) = self.lease_row(t, new_thread)? {
                return Err(CheckpointError::LeaseHeld {
                    thread: new_thread.clone(),
                    until: cur.expires_at(),
                    holder: cur.holder,
                });
            }
            let src = self.get_in(t, from)?;
            let new = NewCheckpoint::fork_of(new_thread, &src);
            let cp = Checkpoint::from_new(new, Some(*from), SystemTime::now());
            self.put_checkpoint(t, &cp)?;
            Ok(cp)
        })
    }

    fn threads(&self) -> CheckpointResult<Vec<(ThreadId, CheckpointId)>> {
        self.tx(|t| {
            let rows = t
                .query("SELECT thread, id FROM casfs_heads ORDER BY thread", &[])
                .map_err(|e| self.db_err(e))?;
            rows.into_iter()
                .map(|r| {
                    let name: String = r.get(0);
                    let id: Vec<u8> = r.get(1);
                    let h = Hash::from_slice(&id).ok_or_else(|| CheckpointError::Corrupt {
                        id: format!("head of thread {name:?}"),
                        detail: format!("{} bytes", id.len()),
                    })?;
                    Ok((ThreadId::new(&name)?, CheckpointId(h)))
                })
                .collect()
        })
    }

    fn resolve_prefix(&self, prefix: &str) -> CheckpointResult<CheckpointId> {
        let p = super::checkpoint_store::checked_prefix(prefix)?;
        if let Some(h) = Hash::from_hex(&p) {
            let id = CheckpointId(h);
            self.get(&id)?;
            return Ok(id);
        }
        let ids: Vec<CheckpointId> = self.tx(|t| {
            let rows = t
                .query(
                    "SELECT id FROM casfs_checkpoints WHERE encode(id, 'hex') LIKE $1 LIMIT 9",
                    &[&format!("{p}%")],
                )
                .map_err(|e| self.db_err(e))?;
            Ok(rows
                .into_iter()
                .filter_map(|r| Hash::from_slice(&r.get::<_, Vec<u8>>(0)).map(CheckpointId))
                .collect())
        })?;
        match ids.len() {
            0 => Err(CheckpointError::NotFound(prefix.to_string())),
            1 => Ok(ids[0]),
            _ => Err(CheckpointError::Ambiguous {
                prefix: prefix.to_string(),
                candidates: ids,
            }),
        }
    }

    fn all_records(&self) -> CheckpointResult<Vec<(CheckpointId, CheckpointResult<Checkpoint>)>> {
        self.tx(|t| {
            let rows = t
                .query("SELECT id, body FROM casfs_checkpoints", &[])
                .map_err(|e| self.db_err(e))?;
            Ok(rows
                .into_iter()
                .map(|r| {
                    let id: Vec<u8> = r.get(0);
                    let body: Vec<u8> = r.get(1);
                    match Hash::from_slice(&id) {
                        Some(h) => {
                            let id = CheckpointId(h);
                            (id, Checkpoint::decode(&id, &body))
                        }
                        None => (
                            CheckpointId(Hash::of(&id)),
                            Err(CheckpointError::Corrupt {
                                id: format!("key of {} bytes", id.len()),
                                detail: "not a checkpoint id".into(),
                            }),
                        ),
                    }
                })
                .collect())
        })
    }

    fn is_pruned(&self, id: &CheckpointId) -> CheckpointResult<bool> {
        self.tx(|t| {
            let row = t
                .query_opt(
                    "SELECT 1 FROM casfs_pruned WHERE id = $1",
                    &[&id.0.as_bytes().as_slice()],
                )
                .map_err(|e| self.db_err(e))?;
            Ok(row.is_some())
        })
    }

    fn remove_records(&self, doomed: &[(CheckpointId, ThreadId)]) -> CheckpointResult<usize> {
        crate::crashpoint("prune.before");
        self.tx(|t| {
            t.execute("SELECT pg_advisory_xact_lock($1)", &[&PIN_LOCK])
                .map_err(|e| self.db_err(e))?;
            let mut n = 0;
            for (id, _) in doomed {
                // A head is kept: the check and the delete are one statement, and no
                // record that is not a head now can become one. A pinned one is kept:
                // no pin can commit while the lock is held.
                n += t
                    .execute(
                        "WITH gone AS (
                             DELETE FROM casfs_checkpoints
                             WHERE id = $1
                               AND NOT EXISTS (SELECT 1 FROM casfs_heads WHERE id = $1)
                               AND NOT EXISTS (SELECT 1 FROM casfs_pins WHERE id = $1)
                             RETURNING id, thread)
                         INSERT INTO casfs_pruned (id, thread) SELECT id, thread FROM gone
                         ON CONFLICT (id) DO NOTHING",
                        &[&id.0.as_bytes().as_slice()],
                    )
                    .map_err(|e| self.db_err(e))? as usize;
            }
            Ok(n)
        })
    }

    fn pin(&self, holder: &str, ids: &[CheckpointId], replace: bool) -> CheckpointResult<()> {
        self.tx(|t| {
            t.execute("SELECT pg_advisory_xact_lock_shared($1)", &[&PIN_LOCK])
                .map_err(|e| self.db_err(e))?;
            if replace {
                t.execute("DELETE FROM casfs_pins WHERE holder = $1", &[&holder])
                    .map_err(|e| self.db_err(e))?;
            }
            for id in ids {
                t.execute(
                    "INSERT INTO casfs_pins (holder, id) VALUES ($1, $2)
                     ON CONFLICT (holder, id) DO UPDATE SET pinned_at = now()",
                    &[&holder, &id.0.as_bytes().as_slice()],
                )
                .map_err(|e| self.db_err(e))?;
            }
            Ok(())
        })
    }

    fn unpin(&self, holder: &str) -> CheckpointResult<()> {
        self.tx(|t| {
            t.execute("DELETE FROM casfs_pins WHERE holder = $1", &[&holder])
                .map_err(|e| self.db_err(e))?;
            Ok(())
        })
    }

    fn pins(&self) -> CheckpointResult<Vec<(String, CheckpointId)>> {
        self.tx(|t| {
            let rows = t
                .query("SELECT holder, id FROM casfs_pins ORDER BY holder, id", &[])
                .map_err(|e| self.db_err(e))?;
            rows.iter()
                .map(|r| {
                    let holder: String = r.get(0);
                    let id: Vec<u8> = r.get(1);
                    let id = Hash::from_slice(&id).map(CheckpointId).ok_or_else(|| {
                        CheckpointError::Invalid(format!(
                            "checkpoint store {}: a pin of {holder:?} is not a checkpoint id",
                            self.name
                        ))
                    })?;
                    Ok((holder, id))
                })
                .collect()
        })
    }

    fn bookkeeping(&self, repair: bool) -> CheckpointResult<Bookkeeping> {
        self.tx(|t| {
            let mut out = Bookkeeping::default();
            let q =
                |t: &mut Transaction<'_>, sql: &str| t.query(sql, &[]).map_err(|e| self.db_err(e));
            for r in q(t, "SELECT thread, id FROM casfs_heads ORDER BY thread")? {
                let id: Vec<u8> = r.get(1);
                let head = Hash::from_slice(&id)
                    .map(CheckpointId)
                    .ok_or_else(|| format!("{} bytes, not an id", id.len()));
                out.heads.push((r.get(0), head));
            }
            // Each lease with its thread's fencing token, in one statement: one snapshot,
            // so a lease taken meanwhile is seen with its token or not at all.
            let rows = q(
                t,
                "SELECT l.thread, l.token, coalesce(f.token, 0)
                 FROM casfs_leases l LEFT JOIN casfs_fencing f USING (thread)",
            )?;
            let tokens: BTreeMap<String, u64> = rows
                .iter()
                .map(|r| (r.get(0), r.get::<_, i64>(2) as u64))
                .collect();
            let leases = rows
                .iter()
                .map(|r| (r.get(0), Ok(r.get::<_, i64>(1) as u64)))
                .collect();
            let fixes = check_leases(&tokens, leases, repair, &mut out);
            for (thread, token) in &fixes.raise {
                t.execute(
                    "INSERT INTO casfs_fencing VALUES ($1, $2) ON CONFLICT (thread)
                     DO UPDATE SET token = GREATEST(casfs_fencing.token, EXCLUDED.token)",
                    &[thread, &(*token as i64)],
                )
                .map_err(|e| self.db_err(e))?;
            }
            // Every column is typed: no lease record fails to decode here.
            debug_assert!(fixes.drop.is_empty());
            Ok(out)
        })
    }
}

/// The portable stores on PostgreSQL: one transaction per operation, holding an
/// advisory lock on the store's name, so operations on one store are serialized
/// across hosts.
impl PortableKv for PgCheckpointStore {
    fn transact(
        &self,
        name: &str,
        f: &mut dyn FnMut(&mut dyn KvTx) -> CheckpointResult<bool>,
    ) -> CheckpointResult<()> {
        let mut c = self.client.locked();
        let err = |e: postgres::Error| self.db_err(e);
        let mut t = c.transaction().map_err(err)?;
        t.execute(
            "SELECT pg_advisory_xact_lock(727236, hashtext($1))",
            &[&name],
        )
        .map_err(err)?;
        let mut tx = PgTx {
            t: &mut t,
            store: self,
            failed: None,
        };
        let commit = f(&mut tx);
        if let Some(e) = tx.failed.take() {
            return Err(self.db_err(e));
        }
        if !commit? {
            return Ok(());
        }
        t.commit().map_err(err)
    }
}

/// Reads and writes of one portable transaction; a failed write is kept and reported
/// when the transaction ends (the writes themselves return nothing).
struct PgTx<'a, 'b> {
    t: &'a mut Transaction<'b>,
    store: &'a PgCheckpointStore,
    failed: Option<postgres::Error>,
}

impl KvTx for PgTx<'_, '_> {
    fn get(&mut self, key: &[u8]) -> CheckpointResult<Option<Vec<u8>>> {
        let row = self
            .t
            .query_opt("SELECT v FROM casfs_portable WHERE k = $1", &[&key])
            .map_err(|e| self.store.db_err(e))?;
        Ok(row.map(|r| r.get(0)))
    }

    fn put(&mut self, key: &[u8], value: &[u8]) {
        if self.failed.is_none() {
            if let Err(e) = self.t.execute(
                "INSERT INTO casfs_portable VALUES ($1, $2) ON CONFLICT (k) DO UPDATE SET v = EXCLUDED.v",
                &[&key, &value],
            ) {
                self.failed = Some(e);
            }
        }
    }

    fn delete(&mut self, key: &[u8]) {
        if self.failed.is_none() {
            if let Err(e) = self
                .t
                .execute("DELETE FROM casfs_portable WHERE k = $1", &[&key])
            {
                self.failed = Some(e);
            }
        }
    }

    fn scan(&mut self, prefix: &[u8]) -> CheckpointResult<Vec<(Vec<u8>, Vec<u8>)>> {
        // Keys from the prefix up to (not including) the next prefix.
        let mut end = prefix.to_vec();
        while let Some(last) = end.pop() {
            if last < 0xff {
                end.push(last + 1);
                break;
            }
        }
        let rows = if end.is_empty() {
            self.t.query(
                "SELECT k, v FROM casfs_portable WHERE k >= $1 ORDER BY k",
                &[&prefix],
            )
        } else {
            self.t.query(
                "SELECT k, v FROM casfs_portable WHERE k >= $1 AND k < $2 ORDER BY k",
                &[&prefix, &end],
            )
        }
        .map_err(|e| self.store.db_err(e))?;
        Ok(rows.into_iter().map(|r| (r.get(0), r.get(1))).collect())
    }
}
