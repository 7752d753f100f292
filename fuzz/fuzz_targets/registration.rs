#![no_main]
//! See `kvring::fuzz::registration`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzz::registration(data));
