#![no_main]
//! `cargo +nightly fuzz run hypercalls`: pvio_fuzz::hypercalls::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::hypercalls::case(&mut pvio_fuzz::Input::from_bytes(data));
});
