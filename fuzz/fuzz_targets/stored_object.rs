#![no_main]
//! Fuzzes `casfs::fuzzing::stored_object` (see src/fuzzing.rs).
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| casfs::fuzzing::stored_object(data));
