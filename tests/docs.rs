//! The documents point only at what the repository has: every relative link
//! of a Markdown file resolves to a file or folder of the repository.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

/// The repository's Markdown documents (the root and `docs/`).
fn documents(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for dir in [root.to_path_buf(), root.join("docs")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// The targets of the inline links `[text](target)` of `markdown`, outside
/// code spans and fenced blocks.
fn links(markdown: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans, so `[x](y)` written as code is no link.
        let text: String = line
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0)
            .map(|(_, s)| s)
            .collect();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_documents_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let docs = documents(root);
    assert!(
        docs.iter().any(|d| d.ends_with("README.md")),
        "found the documents: {docs:?}"
    );
    let mut broken = Vec::new();
    for doc in &docs {
        let text = std::fs::read_to_string(doc).expect("read the document");
        for target in links(&text) {
            let path = target.split('#').next().unwrap_or_default();
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let base = doc.parent().expect("a document's folder");
            if !base.join(path).exists() {
                let name = doc.strip_prefix(root).unwrap_or(doc);
                broken.push(format!("{}: {target}", name.display()));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to nothing:\n{}",
        broken.join("\n")
    );
}

#[test]
fn links_are_read_outside_code_only() {
    let md = "see [a](docs/A.md) and `[b](B.md)`\n```\n[c](C.md)\n```\n[d](https://x.example/#y) [e](#top)";
    assert_eq!(links(md), ["docs/A.md", "https://x.example/#y", "#top"]);
}

/// The reference's configuration table names every key of `proxy.toml`, the
/// complete example, so a key added there cannot go undocumented.
#[test]
fn the_reference_names_every_key_of_proxy_toml() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme =
        std::fs::read_to_string(root.join("docs/REFERENCE.md")).expect("docs/REFERENCE.md");
    let example = std::fs::read_to_string(root.join("proxy.toml")).expect("proxy.toml");
    let example: toml::Table = toml::from_str(&example).expect("proxy.toml parses");
    let mut missing = std::collections::BTreeSet::new();
    for (section, value) in &example {
        match value {
            toml::Value::Table(keys) => {
                for key in keys.keys() {
                    let name = format!("`{section}.{key}`");
                    if !readme.contains(&name) {
                        missing.insert(name);
                    }
                }
            }
            toml::Value::Array(entries) => {
                let header = format!("`[[{section}]]`");
                if !readme.contains(&header) {
                    missing.insert(header.clone());
                }
                for key in entries
                    .iter()
                    .filter_map(toml::Value::as_table)
                    .flat_map(|t| t.keys())
                {
                    let name = format!("`{key}`");
                    if !readme.contains(&name) {
                        missing.insert(format!("{header} {name}"));
                    }
                }
            }
            _ => {
                missing.insert(format!("`{section}` (a top-level key)"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/REFERENCE.md's configuration keys do not name: {}",
        missing.into_iter().collect::<Vec<_>>().join(", ")
    );
}
