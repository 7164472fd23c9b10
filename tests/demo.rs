//! `compactor demo` end to end: the scripted session through a real proxy
//! and the fake upstream, asserted on the text a newcomer would read.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use compactor::demo::{self, DemoOptions};

/// Numbers in a line like `[#12 context ~5,230 tokens / window 8,000, 65%]`.
fn context_of(line: &str) -> Option<(usize, u64)> {
    let rest = line.strip_prefix("[#")?;
    let (n, rest) = rest.split_once(" context ~")?;
    let (tokens, _) = rest.split_once(" tokens")?;
    Some((n.parse().ok()?, tokens.replace(',', "").parse().ok()?))
}

/// The number in a table row's column (`input tokens, total  412,300  147,300`).
fn row(text: &str, label: &str) -> (u64, u64) {
    let line = text
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no row {label:?} in:\n{text}"));
    let nums: Vec<u64> = line[label.len()..]
        .split_whitespace()
        .filter_map(|w| w.replace(',', "").parse().ok())
        .collect();
    (nums[0], nums[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_shows_tokens_climb_compaction_fire_and_tokens_drop() {
    let opts = DemoOptions {
        requests: 30,
        window: 6_000,
        ..DemoOptions::default()
    };
    let mut out: Vec<u8> = Vec::new();
    let report = tokio::time::timeout(
        Duration::from_secs(120),
        demo::run_with_output(opts, &mut out),
    )
    .await
    .expect("the demo finishes")
    .expect("the demo runs");
    let text = String::from_utf8(out).expect("utf-8");
    println!("{text}");

    let lines: Vec<&str> = text.lines().collect();
    let contexts: Vec<(usize, u64)> = lines.iter().filter_map(|l| context_of(l)).collect();
    assert_eq!(contexts.len(), 30, "one line per request:\n{text}");
    assert_eq!(
        contexts.iter().map(|c| c.0).collect::<Vec<_>>(),
        (1..=30).collect::<Vec<_>>()
    );
    assert!(
        lines.iter().any(|l| l.contains("/ window 6,000,")),
        "the window is shown"
    );

    // At least one compaction, and the request it rewrote is smaller than
    // the one before it.
    let compacted: Vec<usize> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("[compacted: "))
        .map(|(i, _)| i)
        .collect();
    assert!(!compacted.is_empty(), "no compaction line:\n{text}");
    for &i in &compacted {
        let line = lines[i];
        assert!(
            line.contains(" items → ") && line.contains(" tokens, "),
            "{line}"
        );
        let before = lines[..i]
            .iter()
            .rev()
            .find_map(|l| context_of(l))
            .expect("a request before");
        let after = lines[i + 1..]
            .iter()
            .find_map(|l| context_of(l))
            .expect("the rewritten request");
        assert_eq!(after.0, before.0 + 1);
        assert!(
            after.1 < before.1,
            "tokens drop after the compaction: {before:?} -> {after:?}\n{text}"
        );
    }
    // Nothing went over the window once compaction was on.
    assert!(
        contexts.iter().all(|c| c.1 <= 6_000),
        "no request over the window:\n{text}"
    );

    // The closing table: compacted < uncompacted, by far.
    let (un, co) = row(&text, "input tokens, client requests");
    assert!(co < un, "{co} < {un}");
    let (un_total, co_total) = row(&text, "= input tokens, total");
    assert_eq!(un_total, un);
    assert!(
        co_total < un_total,
        "summaries included: {co_total} < {un_total}"
    );
    let (over_un, over_co) = row(&text, "requests over the window");
    assert!(over_un > 0, "the uncompacted session would have overflowed");
    assert_eq!(over_co, 0);

    // The report agrees with the text.
    assert_eq!(report.requests.len(), 30);
    assert_eq!(report.compactions.len(), compacted.len());
    assert_eq!(report.uncompacted_input_tokens(), un);
    assert_eq!(report.compacted_input_tokens(), co);
    assert!(report.summarizer_calls >= 1 || report.compactions.iter().all(|c| c.rung != "summary"));
    // The proxy's own accounting: what the upstream received is what the
    // demo counted, and compaction saved some of what it would have.
    let s = &report.savings;
    assert_eq!(s.input_tokens, co);
    assert!(
        s.tokens_saved > 0 && s.input_tokens_uncompacted > co,
        "{s:?}"
    );
    assert_eq!(s.summarizer_calls, report.summarizer_calls as u64, "{s:?}");
    assert!(text.contains("as compactor accounts it"), "{text}");
}

/// The default session (what `compactor demo` runs): no request over the
/// window, the client's requests under half of the uncompacted run's input
/// tokens, and with the summarizer calls included not much over half. The
/// session's turns run a dozen tool calls each, and a compaction computed
/// past the threshold waits for the next user message unless the hard
/// limit forces it: inside such turns the requests go on growing on the
/// older compaction, which costs a few points of the total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_demo_about_halves_the_input_tokens() {
    let mut out: Vec<u8> = Vec::new();
    let report = tokio::time::timeout(
        Duration::from_secs(120),
        demo::run_with_output(DemoOptions::default(), &mut out),
    )
    .await
    .expect("the demo finishes")
    .expect("the demo runs");
    let text = String::from_utf8(out).expect("utf-8");
    println!("{text}");
    assert_eq!(report.requests.len(), DemoOptions::default().requests);
    assert!(
        report.compactions.iter().any(|c| c.rung == "summary"),
        "{text}"
    );
    assert!(
        report
            .requests
            .iter()
            .all(|r| r.total_tokens <= report.window),
        "{text}"
    );
    let uncompacted = report.uncompacted_input_tokens();
    assert!(
        report.compacted_input_tokens() * 2 < uncompacted,
        "{} vs {uncompacted}:\n{text}",
        report.compacted_input_tokens()
    );
    // A summary call asked of the request the upstream was just sent
    // repeats it: that part is a prompt-cache read upstream, billed at a
    // tenth of new input.
    let repeated = report.summarizer_repeated_tokens;
    assert!(repeated <= report.summarizer_input_tokens);
    let total =
        report.compacted_input_tokens() + report.summarizer_input_tokens - repeated + repeated / 10;
    assert!(
        total * 100 < uncompacted * 53,
        "{total} vs {uncompacted}:\n{text}"
    );
}

#[tokio::test]
async fn bad_options_are_refused() {
    let too_few = DemoOptions {
        requests: 1,
        ..DemoOptions::default()
    };
    assert!(demo::run(too_few).await.is_err());
    let tiny = DemoOptions {
        window: 100,
        ..DemoOptions::default()
    };
    assert!(demo::run(tiny).await.is_err());
}

/// The demo's screen is the demo's: exchanges past the warn ratio are
/// ordinary there, and no log line comes between its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_demo_prints_no_log_lines_between_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_compactor"));
    cmd.args(["demo", "--requests", "30", "--window", "6000", "--db"])
        .arg(dir.path().join("demo.db"))
        .env_remove("RUST_LOG");
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::task::spawn_blocking(move || cmd.output()),
    )
    .await
    .expect("the demo finishes")
    .expect("join")
    .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("compaction"), "the demo ran: {stdout}");
    for text in [&stdout, &stderr] {
        assert!(
            !text.contains("WARN"),
            "a warning on the demo's screen: {text}"
        );
        assert!(!text.contains("fraction="), "a log line: {text}");
    }
}
