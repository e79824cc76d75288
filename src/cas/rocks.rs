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
        // Opening is on every command's path: don't start 16 threads per column family
        // to open a handful of files, and don't read every file's statistics.
        opts.set_max_file_opening_threads(1);
        opts.set_skip_stats_update_on_db_open(true);
        opts.set_stats_dump_period_sec(0);

        let mut names: Vec<String> = extra_cfs.iter().map(|s| s.to_string()).collect();
        // Column families a store already has must be opened too (RocksDB refuses to open
        // a database otherwise), even ones this version does not use.
        if let Ok(existing) = DB::list_cf(&opts, path) {
            for name in existing {
                if name != OBJECTS_CF && !names.contains(&name) {
                    names.push(name);
                }
            }
        }
        let mut cfs = vec![ColumnFamilyDescriptor::new(OBJECTS_CF, objects_options())];
        for name in names {
            let mut o = Options::default();
            o.set_compression_type(DBCompressionType::None);
            cfs.push(ColumnFamilyDescriptor::new(name, o));
        }
        let db = DB::open_cf_descriptors(&opts, path, cfs).map_err(|source| CasError::Db {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Database {
            db,
            path: path.to_path_buf(),
        })
    }

    /// Opens an existing database read-only: no lock is taken, so this works while
    /// another process has it open for writing, and sees what was durable at open.
    pub fn open_read_only(path: &Path) -> CasResult<Database> {
        let mut opts = Options::default();
        opts.set_max_file_opening_threads(1);
        opts.set_skip_stats_update_on_db_open(true);
        let err = |source| CasError::Db {
            path: path.to_path_buf(),
            source,
        };
        // A writer may rotate and delete a log file between our listing and our
        // opening of it: try again a few times.
        let mut attempt = 0;
        loop {
            let names = DB::list_cf(&opts, path).map_err(err)?;
            let cfs = names.into_iter().map(|name| {
                let o = if name == OBJECTS_CF {
                    objects_options()
                } else {
                    Options::default()
                };
                ColumnFamilyDescriptor::new(name, o)
            });
            match DB::open_cf_descriptors_read_only(&opts, path, cfs, false) {
                Ok(db) => {
                    return Ok(Database {
                        db,
                        path: path.to_path_buf(),
                    })
                }
                Err(e) if attempt < 5 && e.to_string().contains("No such file") => {
                    attempt += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
                }
                Err(e) => return Err(err(e)),
            }
        }
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
