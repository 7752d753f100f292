#![no_main]
//! See `kvring_server::fuzz::ring_frames`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring_server::fuzz::ring_frames(data));
