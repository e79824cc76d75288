#![no_main]
//! Fuzzes `casfs::fuzzing::http_head` (see src/fuzzing.rs).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| casfs::fuzzing::http_head(data));
