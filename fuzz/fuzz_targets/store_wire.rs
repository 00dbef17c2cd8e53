#![no_main]
//! `cargo +nightly fuzz run store_wire`: pvio_fuzz::store_wire::case driven by libFuzzer's bytes.
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    pvio_fuzz::store_wire::case(&mut pvio_fuzz::Input::from_bytes(data));
});
