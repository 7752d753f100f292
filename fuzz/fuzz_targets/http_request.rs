#![no_main]
//! See `kvring_server::fuzz::http_request`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring_server::fuzz::http_request(data));
