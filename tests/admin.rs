//! The admin API (`/admin/api/…`) and the CLI over the store
//! (`compactor conversations …`, `compactor compact`), against a harness
//! proxy whose conversations compact through the fake upstream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::Path;
use std::time::Duration;

use compactor::admin::{authorize, AccessRequest, Denial};
use serde_json::{json, Value};
use support::{
    cli, client, compactions, last_client_call, post, small_window, small_window_foreground,
    within, Harness,
};

const KEY: &str = "sk-admin-tests";
const MODEL: &str = "tiny-test";

/// The same models table for the CLI, plus the store path.
fn config_file(h: &Harness, extra: &str) -> std::path::PathBuf {
    let path = h.dir.path().join("proxy.toml");
    // The harness's store: its SQLite file, or its PostgreSQL database.
    let url = match h.state.config.store.url.as_str() {
        "" => String::new(),
        url => format!("url = {url:?}\n"),
    };
    let text = format!(
        "[store]\npath = {:?}\n{url}{extra}\n[[models]]\nmatch = \"tiny*\"\ncontext_window = 3000\nmax_output_tokens = 300\n",
        h.db.display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

struct Chat {
    url: String,
    history: Vec<Value>,
    /// Prompt tokens the upstream reported, per turn.
    reported: Vec<u64>,
    conversation: String,
}

impl Chat {
    fn new(h: &Harness) -> Chat {
        Chat {
            url: format!("{}/chat/completions", h.url()),
            history: vec![
                json!({"role": "system", "content": "You are a careful coding agent."}),
                json!({"role": "user", "content": "TASK: refactor the parser so that it streams."}),
                json!({"role": "assistant", "content": "Understood."}),
            ],
            reported: Vec::new(),
            conversation: String::new(),
        }
    }

    /// One turn: sends the whole history, appends the answer's message.
    /// Returns the compaction applied, if any.
    async fn turn(&mut self, text: &str) -> Option<String> {
        self.history.push(json!({"role": "user", "content": text}));
        let (status, headers, body) = post(
            &self.url,
            KEY,
            &json!({"model": MODEL, "messages": self.history}),
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let v: Value = serde_json::from_slice(&body).unwrap();
        self.history.push(v["choices"][0]["message"].clone());
        self.reported
            .push(v["usage"]["prompt_tokens"].as_u64().unwrap());
        self.conversation = headers["x-compactor-conversation"]
            .to_str()
            .unwrap()
            .to_string();
        headers
            .get("x-compactor-compacted")
            .map(|v| v.to_str().unwrap().to_string())
    }
}

fn filler(i: usize) -> String {
    format!(
        "Step {i}: please look at src/module_{i}.rs and explain it. {}",
        "lorem ipsum dolor ".repeat(25)
    )
}

/// Grows a conversation until the background compaction is stored, then
/// sends one more turn, which goes upstream rewritten. Returns the chat and
/// the compaction id.
async fn compacted_conversation(h: &Harness) -> (Chat, String) {
    let mut chat = Chat::new(h);
    let mut i = 0;
    while compactions(h) == 0 {
        if let Some(applied) = chat.turn(&filler(i)).await {
            // Stored between the look at the store and this turn: it
            // applied to this one.
            return (chat, applied);
        }
        i += 1;
        assert!(i < 40, "never compacted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let applied = chat
        .turn("What is the next step?")
        .await
        .expect("the next request was rewritten");
    (chat, applied)
}

async fn get(h: &Harness, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut req = client().get(format!("http://{}{path}", h.addr));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = within(req.send()).await.expect("admin request");
    let status = resp.status().as_u16();
    let body = within(resp.bytes()).await.expect("body");
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_lists_shows_and_exports_a_compacted_conversation() {
    let h = Harness::start_with(small_window).await;
    let (chat, applied) = compacted_conversation(&h).await;
    let id = chat.conversation.clone();
    let turns = chat.reported.len() as u64;

    let (status, list) = get(&h, "/admin/api/conversations", &[]).await;
    assert_eq!(status, 200, "{list}");
    let list = list["conversations"].as_array().unwrap();
    assert_eq!(list.len(), 1, "{list:?}");
    let c = &list[0];
    assert_eq!(c["id"], id.as_str());
    assert_eq!(c["model"], MODEL);
    assert_eq!(c["exchanges"], turns);
    assert_eq!(c["compactions"], 1);
    assert_eq!(c["context_window"], 3000);
    // 0.75 of the 2700 the answer's 300 leave of the window.
    assert_eq!(c["trigger_tokens"], 2025);
    assert_eq!(c["last_input_tokens"], *chat.reported.last().unwrap());
    assert_eq!(c["tenant"].as_str().unwrap().len(), 12);

    let (status, show) = get(&h, &format!("/admin/api/conversations/{id}"), &[]).await;
    assert_eq!(status, 200, "{show}");
    let exchanges = show["exchanges"].as_array().unwrap();
    let inputs: Vec<u64> = exchanges
        .iter()
        .map(|e| e["input_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(inputs, chat.reported, "input tokens of each request");
    let last = exchanges.last().unwrap();
    assert_eq!(last["compaction"], applied.as_str());
    assert!(exchanges[..exchanges.len() - 1]
        .iter()
        .all(|e| e["compaction"].is_null()));
    let k = &show["compactions"][0];
    assert_eq!(k["id"], applied.as_str());
    assert_eq!(k["rung"], "summary");
    assert!(
        k["reason"].as_str().unwrap().starts_with("threshold"),
        "{k}"
    );
    assert!(
        k["tokens_after"].as_u64() < k["tokens_before"].as_u64(),
        "{k}"
    );
    assert!(k["summary"]
        .as_str()
        .unwrap()
        .contains("TASK: refactor the parser so that it streams."));
    assert_eq!(k["first_applied_exchange"], last["id"]);
    assert_eq!(k["applied_exchanges"], 1);

    let (status, export) = get(&h, &format!("/admin/api/conversations/{id}/export"), &[]).await;
    assert_eq!(status, 200, "{export}");
    let view = &export["rewritten_view"];
    assert_eq!(view["exchange"], last["id"]);
    assert_eq!(view["compaction"], applied.as_str());
    assert_eq!(
        view["items"],
        last_client_call(&h)["messages"],
        "the derived view is exactly what the upstream received"
    );
    assert_eq!(
        export["original_items"],
        Value::from(chat.history.clone()),
        "the history as the client holds it"
    );
    let replacement = export["compactions"][0]["replacement"].as_array().unwrap();
    assert_eq!(
        replacement[..],
        view["items"].as_array().unwrap()[..replacement.len()]
    );
    assert_eq!(export["compactions"][0]["summary"], k["summary"]);
    assert_eq!(export["archived"], json!({}), "no tool output was replaced");

    // A unique prefix of the id works; an unknown id is a 404 in OpenAI style.
    let (status, by_prefix) =
        get(&h, &format!("/admin/api/conversations/{}", &id[..12]), &[]).await;
    assert_eq!(status, 200);
    assert_eq!(by_prefix, show);
    let (status, err) = get(&h, "/admin/api/conversations/conv_nope", &[]).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["code"], "conversation_not_found");
    let (status, err) = get(&h, "/admin/api/elsewhere", &[]).await;
    assert_eq!(status, 404);
    assert_eq!(err["error"]["code"], "unknown_url");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_carries_the_originals_of_truncated_tool_outputs() {
    // A target a truncation reaches (the default compacts deeper, to a
    // summary): the rung under test is the truncation's.
    let h = Harness::start_with(|c| {
        small_window(c);
        c.compaction.target_ratio = 0.4;
    })
    .await;
    let mut chat = Chat::new(&h);
    let log: String = (0..220)
        .map(|i| format!("entry {i}: the quick brown fox jumps over the lazy dog\n"))
        .collect();
    let tool_output = json!({"role": "tool", "tool_call_id": "call_1", "content": log});
    chat.history.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "read_log", "arguments": "{}"}}
    ]}));
    chat.history.push(tool_output.clone());
    // Over the hard limit (window minus max output) from the start: it is
    // compacted before it goes out, by the cheapest rung that suffices.
    let first = chat
        .turn("What does the log say?")
        .await
        .expect("compacted before it went out");
    let applied = chat.turn("And then?").await.expect("rewritten");
    assert_eq!(
        applied, first,
        "the same compaction applies to the next request"
    );
    let (status, export) = get(
        &h,
        &format!("/admin/api/conversations/{}/export", chat.conversation),
        &[],
    )
    .await;
    assert_eq!(status, 200, "{export}");
    assert_eq!(export["compactions"][0]["id"], applied.as_str());
    assert_eq!(export["compactions"][0]["rung"], "truncate", "{export}");
    let archived = export["archived"].as_object().unwrap();
    assert_eq!(archived.len(), 1, "{archived:?}");
    let (reference, original) = archived.iter().next().unwrap();
    assert!(reference.starts_with("item:") && reference.len() == 21);
    assert_eq!(original, &tool_output, "the original, byte for byte");
    let sent = last_client_call(&h);
    assert!(
        sent.to_string().contains(reference.as_str()),
        "the stub names it"
    );
    assert_eq!(export["rewritten_view"]["items"], sent["messages"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_reads_the_store_while_the_proxy_runs() {
    let h = Harness::start_with(small_window).await;
    let (chat, applied) = compacted_conversation(&h).await;
    // Another process reads the database, which a journaled exchange
    // reaches within the import delay; take it there now.
    within(h.state.store.flush()).await.unwrap();
    let id = chat.conversation.clone();
    let config = config_file(&h, "");
    let config = path_str(&config);

    // Human tables.
    let (code, out, err) = cli(&["conversations", "list", "--config", config], &[]).await;
    assert_eq!(code, 0, "{err}");
    let mut lines = out.lines();
    let head = lines.next().unwrap();
    for col in [
        "CONVERSATION",
        "TENANT",
        "MODEL",
        "EXCHANGES",
        "COMPACTIONS",
        "LAST TOKENS / WINDOW",
        "LAST SEEN",
    ] {
        assert!(head.contains(col), "{out}");
    }
    let row = lines.next().unwrap();
    assert!(row.starts_with(&id), "{out}");
    assert!(row.contains(MODEL) && row.contains("/ 3,000 ("), "{out}");

    let (code, out, err) = cli(&["conversations", "show", &id, "--config", config], &[]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("conversation {id}\n")), "{out}");
    assert!(
        out.contains("window 3,000 from config, trigger 2,025"),
        "{out}"
    );
    assert!(
        out.contains(&format!("compaction 1 {applied} · rung summary")),
        "{out}"
    );
    assert!(out.contains("reason: threshold"), "{out}");
    // The block counts what the summary's header says it stands for.
    let header = out
        .split("│ [compactor summary of ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .expect("the summary's header");
    assert!(
        out.contains(&format!("), summary of {header} earlier items, ")),
        "{out}"
    );
    assert!(out.contains("│ [compactor summary"), "{out}");
    assert!(
        out.contains("TASK: refactor the parser so that it streams."),
        "{out}"
    );
    // The compaction sits just before the exchange it rewrote (the last one).
    let marker = out.find("── compaction 1").unwrap();
    let tail = &out[marker..];
    assert_eq!(
        tail.lines()
            .filter(|l| l.trim_end().ends_with(&applied))
            .count(),
        1,
        "{out}"
    );
    let exchange_rows = out
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(exchange_rows, chat.reported.len(), "{out}");

    // --json is the API's JSON; COMPACTOR_DB works like --db (and without
    // the config the window is still the one the proxy used: recorded).
    let (_, api_list) = get(&h, "/admin/api/conversations", &[]).await;
    let (code, out, err) = cli(
        &["conversations", "list", "--json", "--config", config],
        &[],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), api_list);
    // COMPACTOR_DB names a SQLite file: a PostgreSQL store has none.
    if h.state.config.store.url.is_empty() {
        let (code, out, _) = cli(
            &["conversations", "list", "--json"],
            &[("COMPACTOR_DB", path_str(&h.db))],
        )
        .await;
        assert_eq!(code, 0);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["conversations"][0]["id"], id.as_str());
        assert_eq!(v["conversations"][0]["context_window"], 3_000);
        assert_eq!(v["conversations"][0]["window_source"], "config");
    }

    let (_, api_show) = get(&h, &format!("/admin/api/conversations/{id}"), &[]).await;
    let (code, out, _) = cli(
        &["conversations", "show", &id, "--json", "--config", config],
        &[],
    )
    .await;
    assert_eq!(code, 0);
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap(), api_show);

    let (_, api_export) = get(&h, &format!("/admin/api/conversations/{id}/export"), &[]).await;
    let (code, out, _) = cli(&["conversations", "export", &id, "--config", config], &[]).await;
    assert_eq!(code, 0);
    assert!(out.starts_with("{\n"), "pretty by default");
    let export: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(export, api_export);
    assert_eq!(
        export["rewritten_view"]["items"],
        last_client_call(&h)["messages"]
    );

    // Errors are named.
    let (code, _, err) = cli(
        &["conversations", "show", "conv_nope", "--config", config],
        &[],
    )
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("no conversation conv_nope"), "{err}");
    let missing = h.dir.path().join("absent.db");
    let (code, _, err) = cli(&["conversations", "list", "--db", path_str(&missing)], &[]).await;
    assert_eq!(code, 1);
    assert!(err.contains("absent.db"), "{err}");
    assert!(
        !missing.exists(),
        "a read-only command never creates a store"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_compaction_through_the_api_and_the_cli_applies_to_the_next_request() {
    let h = Harness::start_with(small_window_foreground).await;
    let mut chat = Chat::new(&h);
    const TURNS: usize = 12;
    for i in 0..TURNS {
        assert!(chat.turn(&filler(i)).await.is_none());
    }
    let id = chat.conversation.clone();
    let path = format!("/admin/api/conversations/{id}/compact");

    let (status, v) = h.post_admin(&path).await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["conversation"], id.as_str());
    assert_eq!(v["already_pending"], false);
    let (status, v) = h.post_admin(&path).await;
    assert_eq!(status, 202);
    assert_eq!(v["already_pending"], true);
    let (status, v) = get(&h, &path, &[]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((&v["pending"], &v["outcome"]), (&json!(true), &Value::Null));
    let (status, v) = h
        .post_admin("/admin/api/conversations/conv_nope/compact")
        .await;
    assert_eq!(status, 404);
    assert_eq!(v["error"]["code"], "conversation_not_found");

    let first = chat.turn("Go on.").await.expect("compacted on request");
    let (_, v) = get(&h, &path, &[]).await;
    assert_eq!(v["pending"], false, "{v}");
    assert_eq!(v["outcome"]["result"], "applied", "{v}");
    assert_eq!(v["outcome"]["compaction"], first.as_str());
    let (_, attempts) = get(&h, &format!("/admin/api/conversations/{id}/attempts"), &[]).await;
    assert_eq!(
        attempts["attempts"][0]["compaction"],
        first.as_str(),
        "{attempts}"
    );
    let (_, show) = get(&h, &format!("/admin/api/conversations/{id}"), &[]).await;
    assert_eq!(show["compactions"][0]["id"], first.as_str());
    assert_eq!(show["compactions"][0]["reason"], "manual");
    assert_eq!(
        show["compactions"][0]["first_applied_exchange"],
        show["exchanges"][TURNS]["id"]
    );
    for i in TURNS..TURNS + 6 {
        assert_eq!(chat.turn(&filler(i)).await, Some(first.clone()));
    }

    // The CLI asks the running proxy, the store named as the other
    // subcommands take it, and waits for the outcome: the conversation's
    // next request, sent once the request is seen.
    let config = config_file(&h, "");
    let listen = h.addr.to_string();
    let mut args: Vec<String> = ["compact", &id, "--config", path_str(&config)]
        .iter()
        .map(|a| a.to_string())
        .collect();
    // `--db` names a SQLite file; a PostgreSQL store is the config's URL.
    if h.state.config.store.url.is_empty() {
        args.extend(["--db".to_string(), path_str(&h.db).to_string()]);
    }
    args.extend(["--listen".to_string(), listen.clone()]);
    let waiting = tokio::spawn(async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(&args, &[]).await
    });
    within(async {
        while get(&h, &path, &[]).await.1["pending"] != true {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let again = chat.turn("Once more.").await.expect("compacted again");
    let (code, out, err) = within(waiting).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with(&format!("{id}: compacted: ")) && out.contains(&again),
        "{out}"
    );
    let (_, show) = get(&h, &format!("/admin/api/conversations/{id}"), &[]).await;
    let ks = show["compactions"].as_array().unwrap();
    assert_eq!(ks.len(), 2, "{show}");
    // Its summary goes after the first one's, which keeps its bytes.
    assert_eq!(
        ks[1]["reason"], "manual; appended after the earlier summary",
        "{show}"
    );
    assert_eq!(ks[1]["base"], ks[0]["id"], "extends the first");
    assert_eq!(
        chat.turn("And now?").await.as_deref(),
        ks[1]["id"].as_str(),
        "still applies"
    );

    // Through COMPACTOR_LISTEN, with --json.
    let (code, out, _) = cli(
        &["compact", &id, "--json", "--wait", "0"],
        &[("COMPACTOR_LISTEN", &listen)],
    )
    .await;
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (&v["already_pending"], &v["outcome"]),
        (&json!(false), &Value::Null)
    );
    // Without waiting, it says where the outcome will show.
    let (code, out, _) = cli(&["compact", &id, "--wait", "0", "--listen", &listen], &[]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("already requested") && out.contains("conversations show"),
        "{out}"
    );
    // A store no proxy serves: said so, nothing sent.
    let other = h.dir.path().join("other.db");
    std::fs::write(&other, b"").unwrap();
    let (code, _, err) = cli(
        &[
            "compact",
            &id,
            "--db",
            path_str(&other),
            "--listen",
            &listen,
        ],
        &[],
    )
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("no running proxy serves"), "{err}");

    // No proxy there: the error names the address.
    let (dead, _held) = support::dead_port();
    let dead_addr = format!("127.0.0.1:{dead}");
    let (code, _, err) = cli(&["compact", &id, "--listen", &dead_addr], &[]).await;
    assert_eq!(code, 1);
    assert!(err.contains(&format!("http://{dead_addr}")), "{err}");
    assert!(err.contains("cannot reach"), "{err}");
    let (code, _, err) = cli(&["compact", "conv_nope", "--listen", &listen], &[]).await;
    assert_eq!(code, 1);
    assert!(
        err.contains("404") && err.contains("no conversation"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_on_a_public_address_wants_the_admin_token() {
    // The proxy is told it listens publicly (the harness binds loopback),
    // so even loopback clients need the token.
    const VAR: &str = "COMPACTOR_TEST_ADMIN_TOKEN_7F3A";
    std::env::set_var(VAR, "s3cret-token");
    let h = Harness::start_with(|c| {
        c.server.listen = "0.0.0.0:8787".into();
        c.admin.token_env = VAR.into();
    })
    .await;
    let list = "/admin/api/conversations";
    let (status, v) = get(&h, list, &[]).await;
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "admin_token_required");
    assert_eq!(v["error"]["type"], "permission_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("x-compactor-admin-token"));
    let (status, v) = get(&h, list, &[("authorization", "Bearer wrong")]).await;
    assert_eq!(status, 403);
    assert_eq!(v["error"]["code"], "admin_token_invalid");
    let (status, v) = get(&h, list, &[("authorization", "Bearer s3cret-token")]).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["conversations"], json!([]));
    let (status, _) = get(&h, list, &[("x-compactor-admin-token", "s3cret-token")]).await;
    assert_eq!(status, 200);
    // The page holds no data: it is served, and asks for the token.
    let resp = within(client().get(format!("http://{}/admin/", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    // A browser page of another origin is refused even with the token.
    let (status, v) = get(
        &h,
        list,
        &[
            ("x-compactor-admin-token", "s3cret-token"),
            ("origin", "http://evil.example"),
        ],
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(v["error"]["code"], "admin_cross_origin");

    // The CLI sends the token named by the config.
    let (_, headers, _) = post(
        &format!("{}/chat/completions", h.url()),
        KEY,
        &json!({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    let id = headers["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string();
    let config = config_file(&h, &format!("[admin]\ntoken_env = {VAR:?}\n"));
    let listen = h.addr.to_string();
    let args = [
        "compact",
        &id,
        "--config",
        path_str(&config),
        "--listen",
        &listen,
    ];
    let (code, _, err) = cli(&args, &[(VAR, "s3cret-token")]).await;
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = cli(&args, &[(VAR, "")]).await;
    assert_eq!(code, 1);
    assert!(err.contains("403") && err.contains("admin token"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_admin_refuses_other_origins_and_host_names() {
    let h = Harness::start().await;
    let list = "/admin/api/conversations";
    assert_eq!(get(&h, list, &[]).await.0, 200);
    let origin = format!("http://{}", h.addr);
    assert_eq!(get(&h, list, &[("origin", origin.as_str())]).await.0, 200);
    let (status, v) = get(&h, list, &[("origin", "https://evil.example")]).await;
    assert_eq!(status, 403);
    assert_eq!(v["error"]["code"], "admin_cross_origin");
    let (status, v) = get(&h, list, &[("host", "rebound.evil.example")]).await;
    assert_eq!(status, 403, "DNS rebinding");
    assert_eq!(v["error"]["code"], "admin_foreign_host");
    // `/admin` redirects to the page.
    let resp = within(client().get(format!("http://{}/admin", h.addr)).send())
        .await
        .unwrap();
    assert_eq!(resp.status(), 308);
    assert_eq!(resp.headers()["location"], "/admin/");
}

fn access<'a>(listen: &str, peer: &str) -> AccessRequest<'a> {
    AccessRequest {
        listen: listen.parse().unwrap(),
        peer: peer.parse().unwrap(),
        host: None,
        origin: None,
        token: None,
    }
}

#[test]
fn the_loopback_and_token_rule() {
    let local = access("127.0.0.1:8787", "127.0.0.1:50000");
    assert_eq!(authorize(&local, None), Ok(()), "loopback by default");
    assert_eq!(
        authorize(&local, Some("t")),
        Ok(()),
        "a token is not needed there"
    );
    let v6 = access("[::1]:8787", "[::1]:50000");
    assert_eq!(authorize(&v6, None), Ok(()));

    // A non-loopback peer (reachable only on a public listener).
    let remote = access("0.0.0.0:8787", "203.0.113.9:40000");
    assert_eq!(authorize(&remote, None), Err(Denial::NoTokenConfigured));
    assert_eq!(authorize(&remote, Some("t")), Err(Denial::TokenRequired));
    let with = AccessRequest {
        token: Some("t"),
        ..remote
    };
    assert_eq!(authorize(&with, Some("t")), Ok(()));
    let wrong = AccessRequest {
        token: Some("x"),
        ..remote
    };
    assert_eq!(authorize(&wrong, Some("t")), Err(Denial::BadToken));
    assert_eq!(
        authorize(&with, None),
        Err(Denial::NoTokenConfigured),
        "no token configured: none accepted"
    );

    // Only the whole token: not a prefix of it, nor it with more after it.
    for presented in ["", "secre", "secret-and-more", "Secret"] {
        let req = AccessRequest {
            token: Some(presented),
            ..remote
        };
        assert_eq!(
            authorize(&req, Some("secret")),
            Err(Denial::BadToken),
            "{presented:?}"
        );
    }
    let exact = AccessRequest {
        token: Some("secret"),
        ..remote
    };
    assert_eq!(authorize(&exact, Some("secret")), Ok(()));

    // Public listener, loopback peer (e.g. a local reverse proxy): token too.
    let behind = access("0.0.0.0:8787", "127.0.0.1:40000");
    assert_eq!(authorize(&behind, None), Err(Denial::NoTokenConfigured));
    assert_eq!(authorize(&behind, Some("t")), Err(Denial::TokenRequired));
    let loopback_listener_remote_peer = access("127.0.0.1:8787", "198.51.100.1:1");
    assert_eq!(
        authorize(&loopback_listener_remote_peer, None),
        Err(Denial::NoTokenConfigured)
    );

    // Browser requests: same origin only; loopback host names only without a token.
    let same = AccessRequest {
        host: Some("127.0.0.1:8787"),
        origin: Some("http://127.0.0.1:8787"),
        ..local
    };
    assert_eq!(authorize(&same, None), Ok(()));
    let cross = AccessRequest {
        origin: Some("http://evil.example"),
        ..same
    };
    assert_eq!(authorize(&cross, None), Err(Denial::CrossOrigin));
    let rebound = AccessRequest {
        host: Some("evil.example:8787"),
        ..local
    };
    assert_eq!(authorize(&rebound, None), Err(Denial::ForeignHost));
    let named = AccessRequest {
        host: Some("localhost:8787"),
        ..local
    };
    assert_eq!(authorize(&named, None), Ok(()));
    let rebound_with_token = AccessRequest {
        token: Some("t"),
        ..rebound
    };
    assert_eq!(authorize(&rebound_with_token, Some("t")), Ok(()));
}

/// Sends one request with `headers`; returns the conversation it went to.
async fn send_as(h: &Harness, path: &str, body: Value, headers: &[(&str, &str)]) -> String {
    let mut req = client()
        .post(format!("{}{path}", h.url()))
        .header("authorization", format!("Bearer {KEY}"))
        .json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = within(req.send()).await.expect("request");
    assert_eq!(resp.status(), 200);
    resp.headers()["x-compactor-conversation"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_are_found_by_the_ids_their_clients_sent() {
    let h = Harness::start_with(small_window).await;
    let ours = send_as(
        &h,
        "/chat/completions",
        json!({"model": MODEL, "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "Count to five. My key is sk-proj-abcdefgh12345678, keep it."}]}),
        &[
            ("x-compactor-conversation", "my-session-42"),
            ("user-agent", "OpenAI/Python 2.20.0"),
        ],
    )
    .await;
    // As Codex sends it: a session header, the same prompt_cache_key, its
    // context block before the person's message.
    let codex = send_as(
        &h,
        "/responses",
        json!({"model": MODEL, "prompt_cache_key": "01a229d2-2989-7b93",
               "input": [
                 {"type": "message", "role": "user", "content": [
                   {"type": "input_text", "text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"}]},
                 {"type": "message", "role": "user", "content": [
                   {"type": "input_text", "text": "turn1: say hi"}]}]}),
        &[
            ("session-id", "01a229d2-2989-7b93"),
            ("user-agent", "codex_exec/0.171.0 (Debian 12.0.0; x86_64)"),
        ],
    )
    .await;
    within(h.state.store.flush()).await.unwrap();
    let config = config_file(&h, "");
    let config = path_str(&config);

    for (name, id) in [
        ("my-session-42", &ours),
        ("01a229d2-2989-7b93", &codex),
        (&ours[5..13], &ours),
        (&codex[..13], &codex),
    ] {
        let (code, out, err) = cli(&["conversations", "show", name, "--config", config], &[]).await;
        assert_eq!(code, 0, "{name}: {err}");
        assert!(
            out.starts_with(&format!("conversation {id}\n")),
            "{name}: {out}"
        );
        let (status, api) = get(&h, &format!("/admin/api/conversations/{name}"), &[]).await;
        assert_eq!(status, 200, "{name}: {api}");
        assert_eq!(api["conversation"]["id"], id.as_str());
        let (code, out, err) =
            cli(&["conversations", "export", name, "--config", config], &[]).await;
        assert_eq!(code, 0, "{name}: {err}");
        let export: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(export["conversation"]["id"], id.as_str());
    }

    let (_, list) = get(&h, "/admin/api/conversations", &[]).await;
    let row = |id: &str| {
        list["conversations"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .cloned()
            .unwrap()
    };
    let mine = row(&ours);
    assert_eq!(mine["client_ids"], json!(["my-session-42"]));
    assert_eq!(mine["client"], "OpenAI/Python 2.20.0");
    assert_eq!(mine["model"], MODEL);
    let preview = mine["preview"].as_str().unwrap();
    assert!(
        preview.starts_with("Count to five. My key is "),
        "{preview}"
    );
    assert!(!preview.contains("abcdefgh12345678"), "redacted: {preview}");
    let theirs = row(&codex);
    assert_eq!(theirs["client_ids"], json!(["01a229d2-2989-7b93"]));
    assert_eq!(theirs["preview"], "turn1: say hi");
    assert!(theirs["client"]
        .as_str()
        .unwrap()
        .starts_with("codex_exec/0.171.0"));

    let (code, out, _) = cli(&["conversations", "list", "--config", config], &[]).await;
    assert_eq!(code, 0);
    let line = out.lines().find(|l| l.starts_with(&ours)).unwrap();
    assert!(
        line.contains("my-session-42") && line.contains("OpenAI/Python"),
        "{out}"
    );
    assert!(line.contains("Count to five."), "{out}");
    let (code, out, _) = cli(&["conversations", "show", &ours, "--config", config], &[]).await;
    assert_eq!(code, 0);
    assert!(out.contains("  client ids  my-session-42\n"), "{out}");

    // The prefix alone is too short to name one (ambiguity itself is
    // tested over a store whose ids are chosen).
    let (code, _, err) = cli(&["conversations", "show", "conv_", "--config", config], &[]).await;
    assert_eq!(code, 1);
    assert!(err.contains("no conversation conv_"), "{err}");
}

/// A conversation is listed by the person's first message: not by the
/// `<system-reminder>` blocks Claude Code puts around it, nor by the
/// few-shot turns aider sends before it, nor by the turns a Gemini client
/// begins with (`model` is Gemini's role of an answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_are_listed_by_the_persons_first_message() {
    let h = Harness::start_with(small_window).await;
    let claude = send_as(
        &h,
        "/messages",
        json!({"model": MODEL, "max_tokens": 64, "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer, use this context: the cwd is /w.\n</system-reminder>"},
                {"type": "text", "text": "Fix the failing parser test"},
                {"type": "text", "text": "<system-reminder>Todo list is empty.</system-reminder>"}]}]}),
        &[("anthropic-version", "2023-06-01")],
    )
    .await;
    let aider = send_as(
        &h,
        "/chat/completions",
        json!({"model": MODEL, "messages": [
            {"role": "system", "content": "Act as an expert software developer."},
            {"role": "user", "content": "Change the greeting to be more casual"},
            {"role": "assistant", "content": "Ok, I will: show_greeting.py"},
            {"role": "user", "content": "I switched to a new code base."},
            {"role": "assistant", "content": "Ok."},
            {"role": "user", "content": "Rename the ledger module to accounts"},
            {"role": "system", "content": "Reply in English."}]}),
        &[],
    )
    .await;
    let gemini = send_as(
        &h,
        &format!("/models/{MODEL}:generateContent"),
        json!({"contents": [
            {"role": "user", "parts": [{"text": "Change the greeting to be more casual"}]},
            {"role": "model", "parts": [{"text": "Ok, I will: show_greeting.py"}]},
            {"role": "user", "parts": [{"text": "Rename the gemini module to models"}]}]}),
        &[],
    )
    .await;
    within(h.state.store.flush()).await.unwrap();
    let config = config_file(&h, "");
    let config = path_str(&config);
    let (code, out, err) = cli(&["conversations", "list", "--config", config], &[]).await;
    assert_eq!(code, 0, "{err}");
    let line = |id: &str| out.lines().find(|l| l.starts_with(id)).unwrap().to_string();
    assert!(
        line(&claude).contains("Fix the failing parser test"),
        "{out}"
    );
    assert!(!out.contains("system-reminder"), "{out}");
    assert!(line(&aider).contains("Rename the ledger module"), "{out}");
    assert!(!out.contains("greeting"), "{out}");
    let (_, list) = get(&h, "/admin/api/conversations", &[]).await;
    let preview = |id: &str| {
        let rows = list["conversations"].as_array().unwrap();
        rows.iter()
            .find(|c| c["id"] == id)
            .map(|c| c["preview"].clone())
    };
    assert_eq!(preview(&claude), Some(json!("Fix the failing parser test")));
    assert_eq!(
        preview(&aider),
        Some(json!("Rename the ledger module to accounts"))
    );
    assert_eq!(
        preview(&gemini),
        Some(json!("Rename the gemini module to models"))
    );
}

/// A history deleted through the admin API and then sent again (the
/// client still holds it) is recorded whole: the proxy no longer takes the
/// deleted items for stored because a recent request had them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_history_sent_again_is_recorded_whole() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let mut history = vec![json!({"role": "system", "content": "You review code."})];
    let mut conversation = String::new();
    for text in ["the first secret turn", "the second secret turn"] {
        history.push(json!({"role": "user", "content": text}));
        let (status, headers, body) =
            post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&body).expect("JSON");
        history.push(v["choices"][0]["message"].clone());
        conversation = headers["x-compactor-conversation"]
            .to_str()
            .expect("id")
            .to_string();
    }
    within(h.state.store.flush()).await.expect("flush");
    let resp = within(
        client()
            .delete(format!(
                "http://{}/admin/api/conversations/{conversation}",
                h.addr
            ))
            .send(),
    )
    .await
    .expect("delete");
    assert_eq!(resp.status(), 200);
    history.push(json!({"role": "user", "content": "and once more"}));
    let (status, headers, _) = post(&url, KEY, &json!({"model": MODEL, "messages": history})).await;
    assert_eq!(status, 200);
    let again = headers["x-compactor-conversation"].to_str().expect("id");
    assert_ne!(again, conversation, "a new conversation");
    within(h.state.store.flush()).await.expect("flush");
    let export = h
        .get_json(&format!("/admin/api/conversations/{again}/export"))
        .await;
    let items = export["original_items"].as_array().expect("items");
    assert_eq!(items.len(), history.len() + 1, "{export}");
    assert!(
        items.iter().all(|item| item["content"].is_string()),
        "every item reads back: {export}"
    );
}

/// A client picks its own conversation ids: one spelt like an abbreviation
/// of another conversation's id must not take that id's place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abbreviated_id_wins_over_a_client_id_spelt_the_same() {
    let h = Harness::start().await;
    let url = format!("{}/chat/completions", h.url());
    let send = |text: &str, header: Option<String>| {
        let mut req = client()
            .post(&url)
            .header("authorization", format!("Bearer {KEY}"))
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": text}]}));
        if let Some(v) = header {
            req = req.header("x-compactor-conversation", v);
        }
        async move {
            let resp = within(req.send()).await.expect("send");
            assert_eq!(resp.status(), 200);
            let id = resp.headers()["x-compactor-conversation"]
                .to_str()
                .unwrap()
                .to_string();
            within(resp.bytes()).await.expect("body");
            id
        }
    };
    let first = send("the first conversation", None).await;
    let abbreviation = first.strip_prefix("conv_").unwrap()[..8].to_string();
    let second = send("a second, unrelated one", Some(abbreviation.clone())).await;
    assert_ne!(first, second);
    h.wait_exchanges(2).await;
    for name in [abbreviation.clone(), format!("conv_{abbreviation}")] {
        let (status, show) = get(&h, &format!("/admin/api/conversations/{name}"), &[]).await;
        assert_eq!(status, 200, "{show}");
        assert_eq!(show["conversation"]["id"], first.as_str(), "{name}: {show}");
    }
    // The client's id alone, when it abbreviates nothing, still finds it.
    let third = send("a third", Some("my-own-name".into())).await;
    h.wait_exchanges(3).await;
    let (status, show) = get(&h, "/admin/api/conversations/my-own-name", &[]).await;
    assert_eq!(status, 200, "{show}");
    assert_eq!(show["conversation"]["id"], third.as_str());
}
