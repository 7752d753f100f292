#![no_main]
//! See `kvring::fuzz::l2_value`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzz::l2_value(data));
