//! Fuzz target: any bytes as a transport plug-in's info text (`kvrelay::fabric::plugin::PluginInfo::parse`), which
//! a C ABI plug-in hands kvrelay at load time. Panics, aborts and out-of-memory are the findings; so is an accepted
//! text without a non-empty name and version, or a fact that is not on one of the text's lines.

#![no_main]

use kvrelay::fabric::plugin::PluginInfo;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(info) = PluginInfo::parse(text) {
        assert!(!info.name.is_empty() && !info.version.is_empty(), "name and version are required");
        for (key, value) in &info.facts {
            assert!(text.lines().any(|line| line.contains(key.as_str()) && line.contains(value.as_str())));
        }
    }
});
