#![no_main]
//! See `kvring::fuzz::http_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzz::http_request(data));
