#![no_main]
//! See `kvring::fuzz::ring_frames`.
libfuzzer_sys::fuzz_target!(|data: &[u8]| kvring::fuzz::ring_frames(data));
