//! The admin page in a real browser: headless Chromium loads `/admin/`,
//! runs its script, and the DOM it leaves lists the conversation this test
//! created and shows its compaction (chart marker, expandable summary); a
//! conversation's net bill and the holdout's comparison, every table
//! within a 1,400-px window (`COMPACTOR_SCREENSHOT_DIR` keeps the
//! screenshots).
//!
//! Needs Debian's `chromium` (`apt-get install chromium`; `.ci/run` installs
//! it), or a Chromium-compatible browser in `COMPACTOR_CHROMIUM`. Ignored by
//! a bare `cargo test`; `scripts/test` runs it (`--include-ignored`), and it
//! then fails, saying so, when no browser is installed.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{compactions, post, small_window, within, Harness};

const KEY: &str = "sk-admin-browser-tests";
const MODEL: &str = "tiny-test";
/// Chromium's own start-up can take a while on a loaded machine.
const BROWSER_DEADLINE: Duration = Duration::from_secs(90);

fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("COMPACTOR_CHROMIUM") {
        return PathBuf::from(p);
    }
    let candidates = [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ];
    for dir in std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()) {
        for name in candidates {
            let p = dir.join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "no Chromium found (looked for {candidates:?} on PATH): install Debian's `chromium` \
         (apt-get install chromium; .ci/run does) or set COMPACTOR_CHROMIUM to a browser binary"
    );
}

/// The window the layout is checked in: the chart must be in it whole.
const WINDOW: (u32, u32) = (1400, 1000);

/// The DOM after the page's scripts ran, as headless Chromium dumps it.
fn dump_dom(url: &str) -> String {
    let (dom, _) = run_chromium(url, false, WINDOW);
    dom
}

/// A screenshot of the page in [`WINDOW`] (PNG bytes).
fn screenshot(url: &str) -> Vec<u8> {
    run_chromium(url, true, WINDOW).1
}

/// Runs headless Chromium on `url` in a `window`-sized window: the DOM it
/// dumps, and the screenshot when `shot`.
fn run_chromium(url: &str, shot: bool, window: (u32, u32)) -> (String, Vec<u8>) {
    let browser = chromium();
    let profile = tempfile::tempdir().expect("profile dir");
    let out_path = profile.path().join("dom.html");
    let png_path = profile.path().join("shot.png");
    let err_path = profile.path().join("stderr.txt");
    let mut child = Command::new(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--no-proxy-server",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--virtual-time-budget=5000",
        ])
        .arg(format!(
            "--user-data-dir={}",
            profile.path().join("profile").display()
        ))
        .arg(format!("--window-size={},{}", window.0, window.1))
        .arg(if shot {
            format!("--screenshot={}", png_path.display())
        } else {
            "--dump-dom".to_string()
        })
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", browser.display()));
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for chromium") {
            break s;
        }
        if started.elapsed() > BROWSER_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium did not finish within {BROWSER_DEADLINE:?}; stderr:\n{}",
                std::fs::read_to_string(&err_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let dom = std::fs::read_to_string(&out_path).unwrap_or_default();
    let png = std::fs::read(&png_path).unwrap_or_default();
    assert!(
        status.success() && (!dom.is_empty() || !png.is_empty()),
        "chromium failed ({status}); stderr:\n{}",
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    (dom, png)
}

async fn browse(url: String) -> String {
    off_thread(move || dump_dom(&url)).await
}

async fn off_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::time::timeout(
        BROWSER_DEADLINE + Duration::from_secs(5),
        tokio::task::spawn_blocking(f),
    )
    .await
    .expect("browser step timed out")
    .expect("browser thread")
}

/// Width and height of a PNG, from its IHDR chunk.
fn png_size(png: &[u8]) -> (u32, u32) {
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 24,
        "a PNG"
    );
    let be = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    (be(&png[16..20]), be(&png[20..24]))
}

/// The value of `attr="…"` on the element whose opening tag holds `marker`.
fn attr_of(dom: &str, marker: &str, attr: &str) -> String {
    let at = dom
        .find(marker)
        .unwrap_or_else(|| panic!("{marker} in:\n{dom}"));
    let tag_start = dom[..at].rfind('<').unwrap();
    let tag = &dom[tag_start..tag_start + dom[tag_start..].find('>').unwrap()];
    let key = format!("{attr}=\"");
    let from = tag.find(&key).unwrap_or_else(|| panic!("{attr} on {tag}")) + key.len();
    tag[from..from + tag[from..].find('"').unwrap()].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium; scripts/test runs it"]
async fn the_admin_page_lists_the_conversation_and_shows_its_compaction() {
    let h = Harness::start_with(small_window).await;
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![
        json!({"role": "system", "content": "You are a careful coding agent."}),
        json!({"role": "user", "content": "TASK: make the parser stream <fast> & safely."}),
        json!({"role": "assistant", "content": "Understood."}),
    ];
    let mut conversation = String::new();
    let mut compacted = None;
    for i in 0..40 {
        let text = if compactions(&h) > 0 {
            "What is the next step?".to_string()
        } else {
            format!(
                "Step {i}: explain src/module_{i}.rs. {}",
                "lorem ipsum dolor ".repeat(25)
            )
        };
        history.push(json!({"role": "user", "content": text}));
        let (status, headers, body) =
            post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&body).unwrap();
        history.push(v["choices"][0]["message"].clone());
        conversation = headers["x-compactor-conversation"].to_str().unwrap().into();
        if let Some(c) = headers.get("x-compactor-compacted") {
            compacted = Some(c.to_str().unwrap().to_string());
            break;
        }
        within(tokio::time::sleep(Duration::from_millis(50))).await;
    }
    let compaction = compacted.expect("the conversation compacted");
    // A request the upstream refuses (summary calls a compaction may make
    // meanwhile get their own answer, not this one).
    h.fake
        .set_summary_reply(Some("## STATE\nThe parser streams.".into()));
    // Twice: a compacted request the upstream refuses goes again as the
    // client sent it.
    for _ in 0..2 {
        h.fake.push(compactor::fake_upstream::Reply::json(
            429,
            json!({"error": {"message": "slow down", "type": "rate_limit", "code": "rate_limited"}}),
        ));
    }
    history.push(json!({"role": "user", "content": "And now?"}));
    let (status, _, _) = post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
    assert_eq!(status, 429);
    history.pop();

    // Straight to the page, which selects the most recent conversation.
    let dom = browse(format!("http://{}/admin", h.addr)).await;
    assert!(dom.contains("1 conversation<"), "the list loaded:\n{dom}");
    assert!(
        dom.contains(&format!(
            r#"<tr class="conv selected" data-id="{conversation}">"#
        )),
        "the conversation is listed and selected:\n{dom}"
    );
    assert!(dom.contains(r#"id="token-chart""#), "the chart:\n{dom}");
    assert!(dom.contains(r#"class="window-line""#) && dom.contains(r#"class="trigger-line""#));
    assert!(
        dom.contains("window 3,000") && dom.contains("trigger 2,025"),
        "{dom}"
    );
    assert!(
        dom.contains(&format!(
            r#"class="compaction-marker" data-compaction="{compaction}""#
        )),
        "the compaction's marker on the chart:\n{dom}"
    );
    assert!(
        dom.contains(r#"<details class="summary">"#),
        "the summary, expandable:\n{dom}"
    );
    // Text from the page's data is rendered as text, never as markup.
    assert!(
        dom.contains("TASK: make the parser stream &lt;fast&gt; &amp; safely."),
        "the summary text:\n{dom}"
    );
    // Under the compaction, its facts checklist: the task kept, nothing
    // forgotten, the task's text as text.
    assert!(
        dom.contains(r#"<details class="audit">"#),
        "the checklist, closed when nothing was forgotten:\n{dom}"
    );
    assert!(
        dom.contains(r#"<tr data-state="present" data-kind="task"><td>kept</td><td>task</td><td><pre>TASK: make the parser stream &lt;fast&gt; &amp; safely.</pre></td></tr>"#),
        "the task on the checklist:\n{dom}"
    );
    assert!(
        dom.contains("What was forgotten: </strong>nothing, every extracted fact reached the compacted request"),
        "{dom}"
    );
    assert_eq!(
        dom.matches(r#"<tr class="exchange">"#).count(),
        history.len() / 2,
        "one row per exchange, the refused one too"
    );
    // Input and output of each exchange; the refused one marked.
    assert_eq!(
        dom.matches(r#"class="output-bar""#).count(),
        history.len() / 2 - 1
    );
    assert!(dom.contains(r#"class="refused-marker""#), "{dom}");
    // Round ticks: an even step of 1, 2 or 5 times a power of ten.
    let ticks: Vec<u64> = dom
        .split(r#"class="tick">"#)
        .skip(1)
        .map(|t| t[..t.find('<').unwrap()].replace(',', "").parse().unwrap())
        .collect();
    assert!(ticks.len() >= 3, "{ticks:?}");
    let step = ticks[1] - ticks[0];
    let mut unit = step;
    while unit >= 10 && unit.is_multiple_of(10) {
        unit /= 10;
    }
    assert!([1, 2, 5].contains(&unit), "{ticks:?}");
    assert!(ticks.windows(2).all(|w| w[1] - w[0] == step), "{ticks:?}");
    // Above the fold at 1400×1000: the chart's bottom within the window.
    // (The browser's own frame may take some of the window's height: the
    // viewport the page reports is what must hold the chart.)
    let viewport = attr_of(&dom, r#"id="chart""#, "data-viewport");
    let (width, height) = viewport.split_once('x').unwrap();
    let (width, height): (u32, u32) = (width.parse().unwrap(), height.parse().unwrap());
    assert!(width == WINDOW.0 && height <= WINDOW.1, "{viewport}");
    let bottom: u32 = attr_of(&dom, r#"id="chart""#, "data-bottom")
        .parse()
        .unwrap();
    assert!(
        bottom <= height,
        "the chart ends at {bottom}px, below the fold of a {viewport} viewport"
    );
    // And the screenshot is of that window.
    let shot_url = format!("http://{}/admin/", h.addr);
    let png = off_thread(move || screenshot(&shot_url)).await;
    assert_eq!(png_size(&png), WINDOW);
    if let Some(dir) = std::env::var_os("COMPACTOR_SCREENSHOT_DIR") {
        std::fs::write(PathBuf::from(dir).join("admin.png"), &png).unwrap();
    }

    // A conversation named in the fragment is selected.
    let (_, headers, _) = post(
        &url,
        KEY,
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "a new conversation"}]}),
    )
    .await;
    let other = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    assert_ne!(other, conversation);
    let dom = browse(format!("http://{}/admin/#{conversation}", h.addr)).await;
    assert!(dom.contains("2 conversations<"), "{dom}");
    assert!(dom.contains(&format!(r#"data-id="{other}""#)), "{dom}");
    assert!(
        dom.contains(&format!(
            r#"<tr class="conv selected" data-id="{conversation}">"#
        )),
        "{dom}"
    );
    assert!(
        dom.contains(&format!(r#"data-compaction="{compaction}""#)),
        "{dom}"
    );
}

/// A conversation's net bill on the page, the holdout compared, and every
/// table within a 1,400-px window (none needs a horizontal scroll), with
/// long names in the cells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs chromium; scripts/test runs it"]
async fn the_admin_page_shows_the_net_bill_and_its_tables_fit_the_window() {
    let h = Harness::start_with(|c| {
        small_window(c);
        c.models[0].input_price_per_mtok = Some(2.0);
        c.models[0].cached_input_price_per_mtok = Some(0.2);
        c.models[0].output_price_per_mtok = Some(8.0);
        c.compaction.holdout_ratio = 0.5;
    })
    .await;
    h.fake.simulate_prompt_cache();
    let url = format!("{}/chat/completions", h.url());
    let mut last = String::new();
    let mut compacted_one = None;
    // Conversations until one compacted and one held out are recorded.
    for conv in 0..12 {
        let mut history = vec![
            json!({"role": "system", "content": "You are a careful coding agent."}),
            json!({"role": "user", "content": format!(
                "TASK {conv}: make the parser of the configuration loader stream its input instead of reading whole files")}),
        ];
        let mut id = String::new();
        for i in 0..40 {
            // As Codex sends them: a long user agent and a session id.
            let resp = within(
                support::client()
                    .post(&url)
                    .header("authorization", format!("Bearer {KEY}"))
                    .header(
                        "user-agent",
                        "codex_cli_rs/0.63.0 (Debian GNU/Linux 13; x86_64) xterm-256color",
                    )
                    .header(
                        "session_id",
                        format!("0199a3c1-7e2b-7c10-9d4e-5f1a2b3c4d{conv:02}"),
                    )
                    .json(&json!({"model": MODEL, "messages": history}))
                    .send(),
            )
            .await
            .expect("request");
            assert_eq!(resp.status(), 200);
            let headers = resp.headers().clone();
            let body = within(resp.bytes()).await.expect("body");
            let v: Value = serde_json::from_slice(&body).unwrap();
            history.push(v["choices"][0]["message"].clone());
            id = headers["x-compactor-conversation"].to_str().unwrap().into();
            if headers.contains_key("x-compactor-compacted") {
                compacted_one.get_or_insert(id.clone());
                break;
            }
            if i >= 24 {
                break;
            }
            history.push(json!({"role": "user", "content": format!(
                "Step {i}: explain src/module_{i}.rs. {}", "lorem ipsum dolor ".repeat(25))}));
            within(tokio::time::sleep(Duration::from_millis(20))).await;
        }
        last = id;
        if compacted_one.is_some() && h.state.config.held_out(&last) {
            break;
        }
    }
    let compacted = compacted_one.expect("a conversation compacted");
    assert!(
        h.state.config.held_out(&last),
        "a held-out conversation too"
    );
    let dom = browse(format!("http://{}/admin/#{compacted}", h.addr)).await;
    // The conversation's net bill, in dollars.
    let bill = &dom[dom.find(r#"<table id="bill">"#).expect("the bill")..];
    let bill = &bill[..bill.find("</table>").unwrap()];
    for row in [
        "paid: exchanges, recall rounds, summaries</th><td class=\"num \">$",
        "of which summaries and provider compactions</th><td class=\"num \">$",
        "without compaction, with the cache it would have had</th><td class=\"num \">$",
        "list prices of ",
    ] {
        assert!(bill.contains(row), "{row} in {bill}");
    }
    assert!(
        bill.contains("<th>saved</th>") || bill.contains("<th>compaction cost more by</th>"),
        "{bill}"
    );
    // The holdout's comparison, with its counts.
    let holdout = &dom[dom.find(r#"<table id="holdout">"#).expect("the holdout")..];
    let holdout = &holdout[..holdout.find("</table>").unwrap()];
    assert!(holdout.contains("<th>compacted</th>"), "{holdout}");
    assert!(
        holdout.contains("<th>held out (50% of new conversations"),
        "{holdout}"
    );
    assert!(!dom.contains(r#"id="holdout-box" hidden"#), "shown");
    // Compaction storms on both sides, the proxy's and its clients'.
    let storms = &dom[dom.find(r#"<p id="storms""#).expect("the storms line")..];
    let storms = &storms[..storms.find("</p>").unwrap()];
    assert!(
        storms.contains(
            "Compaction storms since the proxy started: 0 of the proxy's own compactions held back"
        ) && storms.contains("· 0 compaction requests of clients repeated"),
        "{storms}"
    );
    // Every table within its box in a 1,400-px window: nothing to scroll
    // sideways.
    let overflow: i64 = attr_of(&dom, "data-overflow", "data-overflow")
        .parse()
        .unwrap();
    let page: u32 = attr_of(&dom, "data-overflow", "data-page-width")
        .parse()
        .unwrap();
    assert!(
        overflow <= 0 && page <= WINDOW.0,
        "a table {overflow}px wider than its box, the page {page}px wide, in a {}px window",
        WINDOW.0
    );
    // A window tall enough to show the bill under the chart.
    let tall = (WINDOW.0, 2000);
    let shot_url = format!("http://{}/admin/#{compacted}", h.addr);
    let png = off_thread(move || run_chromium(&shot_url, true, tall).1).await;
    assert_eq!(png_size(&png), tall);
    if let Some(dir) = std::env::var_os("COMPACTOR_SCREENSHOT_DIR") {
        std::fs::write(PathBuf::from(dir).join("admin-bill.png"), &png).unwrap();
    }
}
