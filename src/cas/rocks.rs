//! The embedded RocksDB database that holds a store's column families.
//!
//! One [`Database`] is shared by the object store and the layers above it; each layer
//! names the column families it needs when the database is opened. Objects get their own
//! tuning: no RocksDB compression (objects are compressed already) and large values kept
//! in blob files so compaction does not rewrite file contents.

use std::path::{Path, PathBuf};

use rocksdb::{
    BlockBasedOptions, ColumnFamily, ColumnFamilyDescriptor, DBCompressionType, Options, DB,
};

use super::{CasError, CasResult};

/// The column family holding content-addressed objects.
pub const OBJECTS_CF: &str = "objects";

/// A RocksDB database with its column families created at open.
pub struct Database {
    db: DB,
    path: PathBuf,
    cf_names: Vec<String>,
}

impl Database {
    /// Opens (creating if needed) the database at `path` with the objects column family
    /// and the extra ones named.
    pub fn open(path: &Path, extra_cfs: &[&str]) -> CasResult<Database> {
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        opts.set_max_background_jobs(2);
        opts.set_keep_log_file_num(3);
        opts.set_compression_type(DBCompressionType::None);

        let mut cfs = vec![ColumnFamilyDescriptor::new(OBJECTS_CF, objects_options())];
        for name in extra_cfs {
            let mut o = Options::default();
            o.set_compression_type(DBCompressionType::None);
            cfs.push(ColumnFamilyDescriptor::new(*name, o));
        }
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|source| CasError::Db {
            path: path.to_path_buf(),
            source,
        })?;
        let mut cf_names = vec![OBJECTS_CF.to_string()];
        cf_names.extend(extra_cfs.iter().map(|s| s.to_string()));
        Ok(Database {
            db,
            path: path.to_path_buf(),
            cf_names,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The raw RocksDB handle.
    pub fn raw(&self) -> &DB {
        &self.db
    }

    /// A column family that was named at open.
    pub fn cf(&self, name: &str) -> &ColumnFamily {
        self.db
            .cf_handle(name)
            .unwrap_or_else(|| panic!("column family {name} was not opened"))
    }

    /// Wraps a RocksDB error with the database path.
    pub fn err(&self, source: rocksdb::Error) -> CasError {
        CasError::Db {
            path: self.path.clone(),
            source,
        }
    }

    /// Makes every write so far durable (syncs the write-ahead log).
    pub fn sync(&self) -> CasResult<()> {
        self.db.flush_wal(true).map_err(|e| self.err(e))
    }
}

impl Drop for Database {
    /// Flushes the memtables so the next open does not replay the write-ahead log
    /// (which holds every object written since the last flush).
    fn drop(&mut self) {
        for name in &self.cf_names {
            if let Some(cf) = self.db.cf_handle(name) {
                if let Err(e) = self.db.flush_cf(cf) {
                    tracing::warn!("flushing column family {name} at close: {e}");
                }
            }
        }
    }
}

fn objects_options() -> Options {
    let mut o = Options::default();
    o.set_compression_type(DBCompressionType::None);
    o.set_enable_blob_files(true);
    o.set_min_blob_size(4096);
    o.set_blob_compression_type(DBCompressionType::None);
    o.set_enable_blob_gc(true);
    o.set_write_buffer_size(128 << 20);
    let mut table = BlockBasedOptions::default();
    table.set_bloom_filter(10.0, false);
    o.set_block_based_table_factory(&table);
    o
}
