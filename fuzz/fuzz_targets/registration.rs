#![no_main]
//! See `kvring_server::fuzz::registration`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring_server::fuzz::registration(data));
