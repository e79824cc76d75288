//! The portable stores' operations: each one transaction of the store's backend,
//! checked in the framework's order and applied at once.

use super::*;

impl PortableStores {
    pub fn new(kv: Arc<dyn PortableKv>) -> PortableStores {
        PortableStores { kv }
    }

    /// The portable stores of an open casfs store, on its one backend.
    pub fn of(store: &Store) -> PortableStores {
        PortableStores::new(store.portable_kv())
    }

    fn run<T>(
        &self,
        name: &str,
        mut f: impl FnMut(&mut Tx<'_>) -> PortableResult<T>,
    ) -> PortableResult<T> {
        check_store_name(name)?;
        let mut out = None;
        self.kv.transact(name, &mut |kv| {
            let r = f(&mut Tx { kv, name });
            let commit = r.is_ok();
            out = Some(r);
            Ok(commit)
        })?;
        out.expect("set by the transaction")
    }

    /// Makes store `name` with `options` (`None`: the defaults), or opens it if it
    /// exists with the same ones; made with other options, it is refused. A client
    /// clock is refused unless `allow_client_clock`.
    pub fn open(
        &self,
        name: &str,
        options: Option<StoreOptions>,
        allow_client_clock: bool,
    ) -> PortableResult<StoreOptions> {
        if let Some(o) = &options {
            o.check()?;
            if o.clock == Clock::Client && !allow_client_clock {
                return Err(PortableError::Invalid(
                    "a store on its clients' clock is for tests: the server was not started \
                     with --allow-client-clocks"
                        .into(),
                ));
            }
        }
        self.run(name, |tx| {
            let k = key(META, &[name]);
            match (tx.get_json::<StoreOptions>(&k)?, options) {
                (Some(have), Some(want)) if have != want => {
                    Err(PortableError::StoreExists(format!(
                        "store {name:?} exists with other options ({have:?}): give the same, or \
                     another name"
                    )))
                }
                (Some(have), _) => Ok(have),
                (None, want) => {
                    let o = want.unwrap_or_default();
                    tx.put_json(&k, &o);
                    Ok(o)
                }
            }
        })
    }

    /// Takes `thread`'s writer lease (never waits: a live one is `WriterConflict`).
    pub fn acquire(&self, name: &str, thread: &str, now: Option<f64>) -> PortableResult<Grant> {
        valid_id(thread, "Thread id")?;
        self.run(name, |tx| {
            let opts = tx.options()?;
            let now = tx.now(now)?;
            if tx.lease(thread)?.is_some_and(|l| l.expires_at > now) {
                return Err(PortableError::WriterConflict(format!(
                    "Thread '{thread}' already has an active checkpoint writer"
                )));
            }
            let fk = key(FENCE, &[name, thread]);
            let fence = tx.get_json::<u64>(&fk)?.unwrap_or(0) + 1;
            tx.put_json(&fk, &fence);
            let owner = OwnerToken::generate();
            let expires_at = now + opts.lease_duration_ms;
            tx.put_json(
                &key(LEASE, &[name, thread]),
                &LeaseRow {
                    fence,
                    owner_digest: owner.digest(),
                    expires_at,
                },
            );
            Ok(Grant {
                thread_id: thread.to_string(),
                owner_token: owner.expose().to_string(),
                fence,
                expires_at,
                renew_after_ms: opts.renew_after_ms,
            })
        })
    }

    /// Extends the writer's live lease by the store's lease duration from `now`.
    pub fn renew(&self, name: &str, writer: &Writer, now: Option<f64>) -> PortableResult<f64> {
        valid_id(&writer.thread_id, "Writer thread id")?;
        self.run(name, |tx| {
            let opts = tx.options()?;
            let now = tx.now(now)?;
            tx.check_writer(writer, &writer.thread_id, now)?;
            let mut l = tx.lease(&writer.thread_id)?.expect("checked");
            l.expires_at = now + opts.lease_duration_ms;
            tx.put_json(&key(LEASE, &[name, &writer.thread_id]), &l);
            Ok(l.expires_at)
        })
    }

    /// Gives the lease up if it is still the writer's; otherwise nothing happens.
    pub fn release(&self, name: &str, writer: &Writer) -> PortableResult<()> {
        valid_id(&writer.thread_id, "Writer thread id")?;
        self.run(name, |tx| {
            tx.options()?;
            let digest = OwnerToken::from_client(writer.owner_token.clone()).digest();
            if tx
                .lease(&writer.thread_id)?
                .is_some_and(|l| l.owner_digest == digest && l.fence == writer.fence)
            {
                tx.kv.delete(&key(LEASE, &[name, &writer.thread_id]));
            }
            Ok(())
        })
    }

    pub fn get(&self, name: &str, id: &str) -> PortableResult<Option<Value>> {
        valid_id(id, "Checkpoint id")?;
        self.run(name, |tx| {
            tx.options()?;
            tx.record(id)
        })
    }

    /// The thread's checkpoints by `createdAt`, then by id (as UTF-8 bytes).
    pub fn list(&self, name: &str, thread: &str) -> PortableResult<Vec<Value>> {
        valid_id(thread, "Thread id")?;
        self.run(name, |tx| {
            tx.options()?;
            // Only this thread's ids: its part carries its length.
            let prefix = key(BY_THREAD, &[name, thread]);
            let ids: Vec<String> = tx
                .kv
                .scan(&prefix)?
                .into_iter()
                .filter_map(|(k, _)| {
                    let p = parts(&k);
                    (p.len() == 3 && p[1] == thread).then(|| p[2].clone())
                })
                .collect();
            let mut out = Vec::new();
            for id in ids {
                if let Some(cp) = tx.record(&id)? {
                    out.push(cp);
                }
            }
            out.sort_by(|a, b| {
                let (ta, ia) = order_key(a);
                let (tb, ib) = order_key(b);
                ta.total_cmp(&tb).then(ia.cmp(&ib))
            });
            Ok(out)
        })
    }

    pub fn head(&self, name: &str, thread: &str) -> PortableResult<Option<String>> {
        valid_id(thread, "Thread id")?;
        self.run(name, |tx| {
            tx.options()?;
            tx.head(thread)
        })
    }

    /// Appends `cp` (the framework's record) as the new head of its thread, if the head
    /// is `expected` and the writer's lease is live. Checked in the framework's order.
    pub fn append(
        &self,
        name: &str,
        cp: &Value,
        expected: Option<&str>,
        writer: &Writer,
        now: Option<f64>,
    ) -> PortableResult<String> {
        if !cp.is_object() {
            return Err(PortableError::InvalidEntry(
                "a checkpoint is an object".into(),
            ));
        }
        let thread = str_field(cp, "threadId").unwrap_or("");
        valid_id(thread, "Checkpoint thread id")?;
        valid_id(&writer.thread_id, "Writer thread id")?;
        let id = str_field(cp, "id").unwrap_or("");
        valid_id(id, "Checkpoint id")?;
        if let Some(e) = expected {
            valid_id(e, "Expected head id")?;
        }
        let parent = match cp.get("parentCheckpointId") {
            None | Some(Value::Null) => None,
            Some(Value::String(p)) => {
                valid_id(p, "Parent checkpoint id")?;
                Some(p.as_str())
            }
            Some(_) => {
                return Err(PortableError::InvalidId(
                    "Parent checkpoint id must be null or a string".into(),
                ))
            }
        };
        if writer.thread_id != thread {
            return Err(PortableError::WriterLost(
                "Checkpoint writer thread does not match checkpoint thread".into(),
            ));
        }
        created_at_finite(cp.get("createdAt"), "Checkpoint")?;
        check_entries(cp)?;
        check_artifacts(cp)?;
        if !cp.get("conversation").is_some_and(Value::is_array) {
            return Err(PortableError::InvalidEntry(
                "Checkpoint conversation must be an array".into(),
            ));
        }
        let mut stored = cp.clone();
        stored["parentCheckpointId"] = parent.map_or(Value::Null, |p| json!(p));
        self.run(name, |tx| {
            let now = tx.now(now)?;
            tx.check_writer(writer, thread, now)?;
            if tx.record(id)?.is_some() {
                return Err(PortableError::DuplicateId(format!(
                    "Checkpoint '{id}' already exists"
                )));
            }
            let actual = tx.head(thread)?;
            if actual.as_deref() != expected {
                return Err(PortableError::StaleHead(format!(
                    "Expected head '{}', but thread '{thread}' is at '{}'",
                    expected.unwrap_or("null"),
                    actual.as_deref().unwrap_or("null")
                )));
            }
            if parent != expected {
                return Err(PortableError::ParentMismatch(format!(
                    "Checkpoint '{id}' parent does not match expected head"
                )));
            }
            tx.publish(&stored)?;
            Ok(id.to_string())
        })
    }

    /// Removes the thread's head checkpoint; the head moves to its parent.
    pub fn delete_head(
        &self,
        name: &str,
        thread: &str,
        id: &str,
        writer: &Writer,
        now: Option<f64>,
    ) -> PortableResult<()> {
        valid_id(thread, "Thread id")?;
        valid_id(id, "Checkpoint id")?;
        valid_id(&writer.thread_id, "Writer thread id")?;
        if writer.thread_id != thread {
            return Err(PortableError::WriterLost(
                "Checkpoint writer thread does not match operation thread".into(),
            ));
        }
        self.run(name, |tx| {
            let now = tx.now(now)?;
            tx.check_writer(writer, thread, now)?;
            if tx.head(thread)?.as_deref() != Some(id) {
                return Err(PortableError::NotHead(format!(
                    "Checkpoint '{id}' is not the current head of thread '{thread}'"
                )));
            }
            let Some(cp) = tx.record(id)? else {
                return Err(PortableError::NotHead(format!(
                    "Checkpoint '{id}' does not exist"
                )));
            };
            tx.kv.delete(&key(RECORD, &[name, id]));
            tx.kv.delete(&key(BY_THREAD, &[name, thread, id]));
            match str_field(&cp, "parentCheckpointId") {
                Some(p) => tx.kv.put(&key(HEAD, &[name, thread]), p.as_bytes()),
                None => tx.kv.delete(&key(HEAD, &[name, thread])),
            }
            tx.add_refs(&blob_keys(&cp), -1)
        })
    }

    /// Every blob key the store's checkpoints refer to, with how many do, by key bytes.
    pub fn blob_references(&self, name: &str) -> PortableResult<Vec<(String, u64)>> {
        self.run(name, |tx| {
            tx.options()?;
            let mut out: Vec<(String, u64)> = tx
                .kv
                .scan(&key(REFS, &[name]))?
                .into_iter()
                .filter_map(|(k, v)| {
                    let p = parts(&k);
                    let n: u64 = serde_json::from_slice(&v).ok()?;
                    (p.len() == 2).then(|| (p[1].clone(), n))
                })
                .collect();
            out.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            Ok(out)
        })
    }

    /// Starts the destination thread with a copy of a source checkpoint (its files,
    /// conversation and artifacts) as its root, and the checkpoint's conversation as
    /// the destination's transcript, in one step. Checked in the framework's order.
    pub fn fork(&self, name: &str, f: &ForkInput, now: Option<f64>) -> PortableResult<Value> {
        valid_id(&f.source_thread_id, "Source thread id")?;
        valid_id(&f.source_checkpoint_id, "Source checkpoint id")?;
        valid_id(&f.destination_thread_id, "Destination thread id")?;
        valid_id(&f.destination_checkpoint_id, "Destination checkpoint id")?;
        valid_id(&f.writer.thread_id, "Writer thread id")?;
        created_at_finite(Some(&f.created_at), "Fork checkpoint")?;
        if f.source_thread_id == f.destination_thread_id {
            return Err(PortableError::ForkSourceThreadMismatch(
                "Source and destination threads must differ".into(),
            ));
        }
        let dest = f.destination_thread_id.as_str();
        self.run(name, |tx| {
            let now = tx.now(now)?;
            let Some(source) = tx.record(&f.source_checkpoint_id)? else {
                return Err(PortableError::ForkSourceNotFound(
                    "Source checkpoint was not found".into(),
                ));
            };
            if str_field(&source, "threadId") != Some(f.source_thread_id.as_str()) {
                return Err(PortableError::ForkSourceThreadMismatch(
                    "Source checkpoint belongs to another thread".into(),
                ));
            }
            if f.writer.thread_id != dest {
                return Err(PortableError::WriterLost(
                    "Checkpoint writer thread does not match destination thread".into(),
                ));
            }
            tx.check_writer(&f.writer, dest, now)?;
            let used = tx.kv.get(&key(MESSAGES, &[name, dest]))?.is_some()
                || tx.head(dest)?.is_some()
                || !tx.kv.scan(&key(BY_THREAD, &[name, dest]))?.is_empty()
                || tx.record(&f.destination_checkpoint_id)?.is_some();
            if used {
                return Err(PortableError::ForkDestinationNotEmpty(
                    "Destination thread is not empty".into(),
                ));
            }
            let root = json!({
                "id": f.destination_checkpoint_id,
                "threadId": dest,
                "parentCheckpointId": null,
                "createdAt": f.created_at,
                "reason": "fork-root",
                "files": source.get("files").cloned().unwrap_or(json!([])),
                "conversation": source.get("conversation").cloned().unwrap_or(json!([])),
                "artifacts": source.get("artifacts").cloned().unwrap_or(json!([])),
            });
            tx.put_json(&key(MESSAGES, &[name, dest]), &root["conversation"]);
            tx.publish(&root)?;
            Ok(root)
        })
    }

    /// A thread's transcript (the messages store a fork writes): `None` if it has none.
    pub fn messages(&self, name: &str, thread: &str) -> PortableResult<Option<Value>> {
        valid_id(thread, "Thread id")?;
        self.run(name, |tx| {
            tx.options()?;
            tx.get_json(&key(MESSAGES, &[name, thread]))
        })
    }

    pub fn save_messages(&self, name: &str, thread: &str, messages: &Value) -> PortableResult<()> {
        valid_id(thread, "Thread id")?;
        if !messages.is_array() {
            return Err(PortableError::Invalid("messages: an array".into()));
        }
        self.run(name, |tx| {
            tx.options()?;
            tx.put_json(&key(MESSAGES, &[name, thread]), messages);
            Ok(())
        })
    }

    /// A sandbox instance record of the framework (any JSON object), by key.
    pub fn instance(&self, name: &str, k: &str) -> PortableResult<Option<Value>> {
        valid_id(k, "Instance key")?;
        self.run(name, |tx| {
            tx.options()?;
            tx.get_json(&key(INSTANCE, &[name, k]))
        })
    }

    /// Replaces the instance record of key `k` whole.
    pub fn put_instance(&self, name: &str, k: &str, record: &Value) -> PortableResult<()> {
        valid_id(k, "Instance key")?;
        if !record.is_object() {
            return Err(PortableError::Invalid(
                "an instance record is an object".into(),
            ));
        }
        self.run(name, |tx| {
            tx.options()?;
            tx.put_json(&key(INSTANCE, &[name, k]), record);
            Ok(())
        })
    }

    pub fn delete_instance(&self, name: &str, k: &str) -> PortableResult<()> {
        valid_id(k, "Instance key")?;
        self.run(name, |tx| {
            tx.options()?;
            tx.kv.delete(&key(INSTANCE, &[name, k]));
            Ok(())
        })
    }
}
