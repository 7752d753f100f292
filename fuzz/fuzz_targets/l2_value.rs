#![no_main]
//! See `kvring_server::fuzz::l2_value`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring_server::fuzz::l2_value(data));
