//! Fuzz target: any bytes as a Hugging Face config.json for `kvrelay scenario from-config`
//! (`src/tools/from_config.rs`), imported for two fixed flag sets; an accepted import goes through the scenario
//! loader as the CLI does. Panics, aborts and out-of-memory are the findings.

#![no_main]

use kvrelay::from_config::{import, parse_flags};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = std::str::from_utf8(data) else { return };
    let (Ok(prefill), Ok(decode)) = (parse_flags("prefill", "--tp 2 --page-size 16"), parse_flags("decode", "--tp 4"))
    else {
        return;
    };
    if let Ok(scenario) = import("fuzz.json", config, &prefill, &decode, 64, "fuzz") {
        let _ = kvrelay::scenario::parse(&scenario, "fuzz.yaml", "fuzz");
    }
});
