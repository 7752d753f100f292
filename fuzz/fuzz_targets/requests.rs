#![no_main]
//! See `kvring::fuzz::requests`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzz::requests(data));
