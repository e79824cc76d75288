#![no_main]
//! Fuzzes `casfs::fuzzing::checkpoint_record` (see src/fuzzing.rs).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| casfs::fuzzing::checkpoint_record(data));
