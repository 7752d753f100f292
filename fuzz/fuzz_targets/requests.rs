#![no_main]
//! See `kvring_server::fuzz::requests`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring_server::fuzz::requests(data));
