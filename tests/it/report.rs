//! `kvrelay report`: pages written for a passing and a failing run, then opened in headless Chromium (Debian's
//! `chromium-headless-shell`, installed by .ci/run): the assertions are on the screenshots' pixels and on the DOM
//! the browser built, not only on the HTML text. Screenshots are kept in target/report-screenshots/.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvrelay::report::{picture, FAIL, PASS};

use crate::support::kvrelay;

const SCENARIO: &str = "scenarios/basic/deepseek-v2-lite-dcp1-to-dcp2.yaml";
const PAGE: &str = "basic__deepseek-v2-lite-dcp1-to-dcp2.html";

fn out_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn report(extra: &[&str], dir: &Path) -> String {
    let mut args = vec!["report", SCENARIO, "--html", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let output = kvrelay(&args);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
    stdout
}

/// The headless browser: `$KVRELAY_CHROMIUM`, else Debian's `chromium-headless-shell` or `chromium`.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KVRELAY_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    ["chromium-headless-shell", "chromium", "chromium-browser"].iter().find_map(|name| {
        let path = Path::new("/usr/bin").join(name);
        path.exists().then_some(path)
    })
}

fn browser(chromium: &Path, args: &[String]) -> std::process::Output {
    // Root in containers and CI: no sandbox; no GPU here.
    Command::new(chromium)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,1600"])
        .args(args)
        .output()
        .expect("chromium starts")
}

/// Pixels of each colour of interest in a screenshot: (violation, pass banner, fail banner).
fn pixels(png_file: &Path) -> (usize, usize, usize) {
    let decoder = png::Decoder::new(std::fs::File::open(png_file).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buffer = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buffer).unwrap();
    let step = match info.color_type {
        png::ColorType::Rgba => 4,
        png::ColorType::Rgb => 3,
        other => panic!("screenshot colour type {other:?}"),
    };
    let rgb = |hex: &str| {
        let value = u32::from_str_radix(hex.trim_start_matches('#'), 16).unwrap();
        [(value >> 16) as u8, (value >> 8) as u8, value as u8]
    };
    let (violation, pass, fail) = (rgb(picture::VIOLATION), rgb(PASS), rgb(FAIL));
    let mut counts = (0, 0, 0);
    for pixel in buffer[..info.buffer_size()].chunks_exact(step) {
        let pixel = [pixel[0], pixel[1], pixel[2]];
        counts.0 += usize::from(pixel == violation);
        counts.1 += usize::from(pixel == pass);
        counts.2 += usize::from(pixel == fail);
    }
    counts
}

#[test]
fn a_report_page_shows_a_clean_run_clean_and_a_planted_bug_in_red_in_a_real_browser() {
    let (clean, broken) = (out_dir("clean"), out_dir("broken"));
    let said = report(&[], &clean);
    assert!(said.contains(&format!("pass {SCENARIO}")), "{said}");
    let said = report(&["--mutant", "decode-pages-per-chunk"], &broken);
    assert!(said.contains(&format!("FAIL {SCENARIO}")), "{said}");
    for dir in [&clean, &broken] {
        let index = std::fs::read_to_string(dir.join("index.html")).unwrap();
        assert!(index.contains(&format!("href=\"{PAGE}\"")), "the index links the page: {index}");
    }
    let (clean_html, broken_html) =
        (std::fs::read_to_string(clean.join(PAGE)).unwrap(), std::fs::read_to_string(broken.join(PAGE)).unwrap());
    // The mutant's first violation, in the oracle's coordinates, as a table row and as a mark's tooltip.
    let first = "decode pp0/tp0, layer 0 kv, row 16: expected token 128 of request 0";
    assert!(broken_html.contains(first), "the broken page names {first}");
    assert!(broken_html.contains("<td>row 16</td>"), "the table row of the first violation");
    assert!(!clean_html.contains("class=\"violation\""), "the clean page marks nothing");
    for html in [&clean_html, &broken_html] {
        assert!(!html.contains("http://") && !html.contains("https://"), "nothing is fetched");
    }

    let Some(chromium) = chromium() else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs this test in Chromium: .ci/run installs chromium-headless-shell"
        );
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: the browser half, no chromium-headless-shell or chromium here (.ci/run installs it)\n",
        );
        return;
    };
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/report-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let mut seen = Vec::new();
    for (name, dir) in [("pass", &clean), ("fail", &broken)] {
        let url = format!("file://{}", dir.join(PAGE).display());
        let shot = shots.join(format!("{name}.png"));
        let _ = std::fs::remove_file(&shot);
        let output = browser(&chromium, &[format!("--screenshot={}", shot.display()), url.clone()]);
        assert!(shot.exists(), "no screenshot: {}", String::from_utf8_lossy(&output.stderr));
        let dom = browser(&chromium, &["--dump-dom".to_owned(), url]);
        let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
        // The page's script counts the violation marks the browser laid out.
        let rendered = dom
            .split("data-rendered=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .and_then(|count| count.parse::<usize>().ok())
            .unwrap_or_else(|| panic!("the page's script did not run in the browser: {}", &dom[..dom.len().min(400)]));
        seen.push((pixels(&shot), rendered));
    }
    let [((clean_red, clean_pass, clean_fail), clean_marks), ((broken_red, broken_pass, broken_fail), broken_marks)] =
        seen[..]
    else {
        unreachable!()
    };
    assert_eq!((clean_red, clean_fail, clean_marks), (0, 0, 0), "the clean run shows no violation and no FAIL");
    assert!(clean_pass > 10_000, "the clean run's banner is green: {clean_pass} pixels");
    assert!(broken_marks > 1_000, "the browser laid out the violations: {broken_marks}");
    assert!(broken_red > 5_000, "violations show in red on screen: {broken_red} pixels");
    assert!(broken_fail > 10_000 && broken_pass == 0, "the failing run's banner is red: {broken_fail}, {broken_pass}");
}
