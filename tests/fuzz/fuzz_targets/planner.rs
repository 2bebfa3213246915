//! Fuzz target: any bytes as a line an external planner wrote (`src/running/external/protocol.rs`): its hello, a link
//! answer and a plan answer. Panics, aborts and out-of-memory are the findings; so is an accepted plan answer that
//! does not survive `parse(answer_line(x)) == x`.

#![no_main]

use kvrelay::external::protocol::{answer_line, parse_answer, parse_hello, parse_link_answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(line) = std::str::from_utf8(data) else { return };
    let _ = parse_hello(line);
    let _ = parse_link_answer(line, 7);
    if let Ok(answer) = parse_answer(line, 7, 3) {
        let again = parse_answer(&answer_line("plan", 7, &answer), 7, 3);
        assert_eq!(again.as_ref(), Ok(&answer), "round trip");
    }
});
