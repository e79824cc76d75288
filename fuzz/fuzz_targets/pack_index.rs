#![no_main]
//! Fuzzes `casfs::fuzzing::pack_index` (see src/fuzzing.rs).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| casfs::fuzzing::pack_index(data));
