//! The documents point only at what the repository has: every relative link
//! of a Markdown file resolves to a file or folder of the repository, every
//! `src/…` path they name is there, and every item they name by its path
//! (`module::item`, `module::Type::method`, `Type::method`) is defined.
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
    for line in unfenced(markdown) {
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

/// The lines of `markdown` outside fenced blocks.
fn unfenced(markdown: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    markdown.lines().filter(move |line| {
        let fence = line.trim_start().starts_with("```");
        fenced ^= fence;
        !fenced && !fence
    })
}

/// The code spans of `markdown`, outside fenced blocks.
fn code_spans(markdown: &str) -> Vec<String> {
    unfenced(markdown)
        .flat_map(|line| line.split('`').skip(1).step_by(2).map(String::from))
        .collect()
}

/// Whether `c` may be part of an identifier.
fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether `word` stands in `text` as a whole word right after `before`.
fn follows(text: &str, before: &str, word: &str) -> bool {
    let pattern = format!("{before}{word}");
    text.match_indices(&pattern).any(|(at, _)| {
        let start_ok =
            before.is_empty() || !text[..at].ends_with(is_ident) || !before.starts_with(is_ident);
        let end_ok = !text[at + pattern.len()..].starts_with(is_ident);
        start_ok && end_ok
    })
}

/// Whether the Rust source `text` defines `name` or brings it in with a
/// `use` (a module handing on its children's names).
fn defines(text: &str, name: &str) -> bool {
    let kinds = [
        "fn ", "struct ", "enum ", "trait ", "const ", "static ", "type ", "mod ",
    ];
    kinds.iter().any(|k| follows(text, k, name))
        || text
            .split("use ")
            .skip(1)
            .filter_map(|rest| rest.split(';').next())
            .any(|statement| follows(statement, "", name))
}

/// The sources of `src/`, each with its module path (`a::b` for
/// `src/a/b.rs` and `src/a/b/mod.rs`).
fn sources(src: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("a folder of src").flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(src)
                    .expect("under src")
                    .with_extension("");
                let mut segs: Vec<String> = rel
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if segs.last().is_some_and(|s| s == "mod") {
                    segs.pop();
                }
                let text = std::fs::read_to_string(&path).expect("a source file");
                out.push((segs.join("::"), text));
            }
        }
    }
    out
}

/// Why the item `span` names cannot be found, if it names one: a path
/// of identifiers that starts with a module of the crate (`engine::compact`,
/// `engine::Compactions::find`) or with a type (`Store::record`). Any other
/// span is not a name and passes.
fn missing_name(span: &str, sources: &[(String, String)], tests: &Path) -> Option<String> {
    let segs: Vec<&str> = span.split("::").collect();
    let words = segs.iter().all(|s| {
        !s.is_empty() && s.chars().all(is_ident) && !s.starts_with(|c: char| c.is_ascii_digit())
    });
    if segs.len() < 2 || !words {
        return None;
    }
    let module = |path: &str| {
        sources
            .iter()
            .find(|(m, _)| m == path)
            .map(|(_, t)| t.as_str())
    };
    let any_fn = |name: &str| sources.iter().any(|(_, t)| follows(t, "fn ", name));
    if segs[0].starts_with(|c: char| c.is_ascii_uppercase()) {
        let typed = ["struct ", "enum ", "trait ", "type "]
            .iter()
            .any(|k| sources.iter().any(|(_, t)| follows(t, k, segs[0])));
        // A type of another crate's is not looked for.
        if !typed {
            return None;
        }
        let member = match segs[1..] {
            [variant] if variant.starts_with(|c: char| c.is_ascii_uppercase()) => {
                sources.iter().any(|(_, t)| follows(t, "", variant))
            }
            [method] => any_fn(method),
            _ => false,
        };
        return (!member).then(|| format!("{span}: {} has no such member", segs[0]));
    }
    module(segs[0])?;
    // The longest prefix that is a module; what follows is an item of it
    // and, at most, a method.
    let at = (1..=segs.len())
        .rev()
        .find(|&i| module(&segs[..i].join("::")).is_some())
        .expect("the first segment is a module");
    let text = module(&segs[..at].join("::")).expect("a module");
    let found = match &segs[at..] {
        [] => true,
        [item] => defines(text, item),
        [item, method] => defines(text, item) && any_fn(method),
        _ => false,
    };
    // A test binary's test (`compaction::some_test`) is named the same way.
    let test = tests.join(format!("{}.rs", segs[0]));
    let a_test =
        segs.len() == 2 && std::fs::read_to_string(test).is_ok_and(|t| follows(&t, "fn ", segs[1]));
    (!found && !a_test).then(|| format!("{span}: not defined in src/{}", segs[..at].join("/")))
}

#[test]
fn every_path_and_item_the_documents_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sources = sources(&root.join("src"));
    let mut missing = Vec::new();
    let mut names = 0;
    for doc in documents(root) {
        let text = std::fs::read_to_string(&doc).expect("read the document");
        let name = doc.strip_prefix(root).unwrap_or(&doc).display().to_string();
        for span in code_spans(&text) {
            if span.starts_with("src/") {
                names += 1;
                if !root.join(&span).exists() {
                    missing.push(format!("{name}: {span}: no such file"));
                }
            } else if span.contains("::") {
                names += 1;
                if let Some(why) = missing_name(&span, &sources, &root.join("tests")) {
                    missing.push(format!("{name}: {why}"));
                }
            }
        }
    }
    assert!(names > 100, "found {names} names in the documents");
    assert!(
        missing.is_empty(),
        "named and not there:\n{}",
        missing.join("\n")
    );
}

#[test]
fn a_name_is_found_only_where_it_is_defined() {
    let sources = vec![
        (
            "a".to_string(),
            "mod b;\npub use b::Handed;\npub fn go() {}".to_string(),
        ),
        (
            "a::b".to_string(),
            "pub struct Thing;\nimpl Thing { pub fn run(&self) {} }".to_string(),
        ),
    ];
    let tests = Path::new("no-such-folder");
    for found in [
        "a::go",
        "a::b::Thing",
        "a::Handed",
        "a::b::Thing::run",
        "Thing::run",
        "x::y",
        "a b::c",
        "Foreign::thing",
    ] {
        assert_eq!(missing_name(found, &sources, tests), None, "{found}");
    }
    for gone in [
        "a::gone",
        "a::b::Thing::gone",
        "a::b::Gone",
        "Thing::Gone",
        "Thing::gone",
        "a::go::x::y",
    ] {
        assert!(missing_name(gone, &sources, tests).is_some(), "{gone}");
    }
    assert!(!follows("pub fn going() {}", "fn ", "go"));
    assert_eq!(code_spans("`a` b `c`\n```\n`d`\n```"), ["a", "c"]);
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
