//! The crate's module graph has no cycle.
//!
//! Every `src/**/*.rs` file of the library is a node (`src/a/mod.rs` and
//! `src/a.rs` are `a`, `src/a/b.rs` is `a::b`). An edge A → B is any path in
//! A's code that names B: `crate::…`, `super::…`, `self::…`, a child module
//! of A, or a name A imported with `use`, in `use` items, in code and inside
//! macro calls. `#[cfg(test)]` items are left out (a test may reach anywhere)
//! and so are doc comments (a link is not a dependency).
//!
//! A module's use of its own ancestors (`super::…`, or `crate::a::X` from
//! `a::b`) is not an edge: a parent and its children are one unit, the
//! children sharing what the parent defines, as a block uses its enclosing
//! scope, while the parent uses its children. What must not loop is the
//! units' use of each other, and a child's use of its siblings.
//!
//! The graph minus [`ALLOWED_BACK_EDGES`] must be acyclic, and every edge of
//! that list must still exist, so the list can only shrink: a change that
//! removes a back-edge deletes its line, and one that adds a cycle fails here.
//!
//! The phases of a request ([`PHASES`]) name no other phase: each returns
//! its decision to the driver, `server::proxy`. Only the store names its
//! backends ([`BACKENDS`]), and inside every folder of `src/` a child never
//! names its parent: a parent declares its children and hands their names
//! on, and what the children share is a child of its own, so the arrows
//! inside a folder only run down or across ([`folders`]).
//!
//! Beside the graph, one habit is kept here: no file of `src/` passes
//! [`MAX_LINES`] lines before its tests.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// The layers, from the bottom up, each a list of top-level modules (as
/// `docs/ARCHITECTURE.md` lists them): a module may use its own layer and
/// those below it, never one above. Within a layer, the cycle check above
/// keeps the order.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "foundations",
        &[
            "config",
            "bounded",
            "error",
            "ids",
            "redact",
            "background",
            "windows",
            "prices",
        ],
    ),
    ("wire formats", &["wire"]),
    (
        "token counts and the upstream client",
        &["tokens", "upstream"],
    ),
    ("pure compaction", &["compaction"]),
    ("state and records", &["store", "conversation", "metrics"]),
    ("engine", &["engine"]),
    ("composition root", &["app"]),
    (
        "edges",
        &["server", "admin", "cli", "demo", "fake_upstream"],
    ),
];

/// The database drivers: only `store` (and its children) may name them, so
/// that no other module opens a database or holds its types.
const DATABASE_CRATES: &[&str] = &["rusqlite", "tokio_postgres", "postgres_types"];

/// The store's backends: only the store names them (`store::open` chooses
/// one from the config), so that everything outside it holds the store's
/// traits.
const BACKENDS: &[&str] = &["store::sqlite", "store::postgres"];

/// Edges that run against the layering, each (from, to, what it reaches
/// for). Empty: not a place to add to; a change that needs a back-edge
/// moves what the edge reaches for instead.
const ALLOWED_BACK_EDGES: &[(&str, &str, &str)] = &[];

/// The phases of a request (`server::proxy`, the driver, runs them): none
/// may name another, so that each returns its decision to the driver
/// rather than take the next step itself. A phase's children count as the
/// phase.
const PHASES: &[&str] = &[
    "server::read",
    "server::identify",
    "server::compact_now",
    "server::send",
    "server::recall",
    "server::splice",
    "server::relay",
    "server::record",
    "server::compact",
];

/// A module path, `a::b`; the crate root is `crate`.
type Module = String;

/// Every `.rs` file under `dir`, with its text, in path order.
fn sources(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                out.push((path, text));
            }
        }
    }
    out.sort();
    out
}

/// The library's modules, each with its source, read from `src/`.
fn modules(src: &Path) -> BTreeMap<Module, String> {
    sources(src)
        .into_iter()
        .filter_map(|(path, text)| Some((module_of(src, &path)?, text)))
        .collect()
}

/// The module a file defines, or `None` for a file outside the library
/// (the binary's `main.rs`, `src/bin/`).
fn module_of(src: &Path, file: &Path) -> Option<Module> {
    let rel: PathBuf = file.strip_prefix(src).ok()?.with_extension("");
    let mut segs: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    match segs.as_slice() {
        [only] if only == "main" => return None,
        [first, ..] if first == "bin" => return None,
        [only] if only == "lib" => return Some("crate".into()),
        _ => {}
    }
    if segs.last().is_some_and(|s| s == "mod") {
        segs.pop();
    }
    Some(segs.join("::"))
}

/// The dependency graph: for each module, the modules its code names, but
/// its ancestors.
fn graph(modules: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    named(modules)
        .into_iter()
        .map(|(name, to)| {
            let to = to.into_iter().filter(|t| !is_ancestor(t, &name)).collect();
            (name, to)
        })
        .collect()
}

/// For each module, the modules its code names (its ancestors too).
fn named(modules: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let names: BTreeSet<&str> = modules.keys().map(String::as_str).collect();
    modules
        .iter()
        .map(|(name, text)| {
            let file = syn::parse_file(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let mut paths = Paths::default();
            paths.visit_file(&file);
            let here: Vec<&str> = segments(name);
            let mut to = BTreeSet::new();
            for path in &paths.found {
                let Some(abs) = absolute(&here, path, &paths.imports, &names) else {
                    continue;
                };
                if let Some(target) = longest_module(&abs, &names) {
                    if target != *name {
                        to.insert(target);
                    }
                }
            }
            (name.clone(), to)
        })
        .collect()
}

/// Whether module `a` encloses module `b`.
fn is_ancestor(a: &str, b: &str) -> bool {
    a == "crate" || b.strip_prefix(a).is_some_and(|rest| rest.starts_with("::"))
}

fn segments(module: &str) -> Vec<&str> {
    if module == "crate" {
        Vec::new()
    } else {
        module.split("::").collect()
    }
}

/// `path` as seen from module `here`, from the crate root, when it names
/// something of this crate.
fn absolute(
    here: &[&str],
    path: &[String],
    imports: &BTreeMap<String, Vec<String>>,
    names: &BTreeSet<&str>,
) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => here.iter().map(|s| s.to_string()).collect(),
        "super" => {
            let mut b: Vec<String> = here.iter().map(|s| s.to_string()).collect();
            b.pop()?;
            // `super::super::…`
            let mut rest = rest;
            while rest.first().is_some_and(|s| s == "super") {
                b.pop()?;
                rest = &rest[1..];
            }
            b.extend(rest.iter().cloned());
            return Some(b);
        }
        other => {
            let mut child: Vec<String> = here.iter().map(|s| s.to_string()).collect();
            child.push(other.to_string());
            if names.contains(child.join("::").as_str()) {
                child
            } else if let Some(imported) = imports.get(other) {
                let mut abs = absolute(here, imported, &BTreeMap::new(), names)?;
                abs.extend(rest.iter().cloned());
                return Some(abs);
            } else {
                return None;
            }
        }
    };
    base.extend(rest.iter().cloned());
    Some(base)
}

/// The deepest module that `abs` (a path from the crate root) is in.
fn longest_module(abs: &[String], names: &BTreeSet<&str>) -> Option<Module> {
    (1..=abs.len())
        .rev()
        .map(|n| abs[..n].join("::"))
        .find(|m| names.contains(m.as_str()))
}

/// Every path of a file's code outside `#[cfg(test)]` items, and what its
/// `use` items bring into scope under which name.
#[derive(Default)]
struct Paths {
    found: Vec<Vec<String>>,
    imports: BTreeMap<String, Vec<String>>,
    /// How deep in `mod x { … }` items of the file the visit is: their
    /// code is the file's module's, so a `super::` there names the file's
    /// module (or the inline module around), not its parent.
    inline: usize,
}

impl Paths {
    /// `path` as seen from the file's module.
    fn seen_from_file(&self, mut path: Vec<String>) -> Vec<String> {
        let supers = path.iter().take_while(|s| *s == "super").count();
        let dropped = supers.min(self.inline);
        if dropped > 0 {
            path.drain(..dropped);
            if dropped == supers {
                path.insert(0, "self".into());
            }
        }
        path
    }

    fn found(&mut self, path: Vec<String>) {
        let path = self.seen_from_file(path);
        self.found.push(path);
    }

    fn import(&mut self, alias: String, path: Vec<String>) {
        let path = self.seen_from_file(path);
        self.imports.insert(alias, path.clone());
        self.found.push(path);
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                let name = n.ident.to_string();
                let mut full = prefix.clone();
                if name != "self" {
                    full.push(name.clone());
                }
                let alias = if name == "self" {
                    prefix.last().cloned().unwrap_or_default()
                } else {
                    name
                };
                self.import(alias, full);
            }
            syn::UseTree::Rename(r) => {
                let mut full = prefix.clone();
                if r.ident != "self" {
                    full.push(r.ident.to_string());
                }
                self.import(r.rename.to_string(), full);
            }
            syn::UseTree::Glob(_) => self.found(prefix.clone()),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    /// Paths written inside a macro call (`tracing::info!(…)`, `json!(…)`):
    /// every run of `ident :: ident …` among its tokens.
    fn tokens(&mut self, tokens: TokenStream) {
        let mut run: Vec<String> = Vec::new();
        let mut colons = 0;
        for tt in tokens {
            match tt {
                TokenTree::Ident(i) if run.is_empty() || colons == 2 => {
                    run.push(i.to_string());
                    colons = 0;
                }
                TokenTree::Punct(p) if p.as_char() == ':' && !run.is_empty() && colons < 2 => {
                    colons += 1;
                }
                other => {
                    self.end_run(&mut run);
                    colons = 0;
                    match other {
                        TokenTree::Group(g) => self.tokens(g.stream()),
                        TokenTree::Ident(i) => run.push(i.to_string()),
                        _ => {}
                    }
                }
            }
        }
        self.end_run(&mut run);
    }

    fn end_run(&mut self, run: &mut Vec<String>) {
        if !run.is_empty() {
            let path = std::mem::take(run);
            self.found(path);
        }
    }
}

fn is_cfg_test(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let attrs = match item {
            syn::Item::Mod(m) => &m.attrs,
            syn::Item::Fn(f) => &f.attrs,
            syn::Item::Impl(i) => &i.attrs,
            syn::Item::Use(u) => &u.attrs,
            syn::Item::Struct(s) => &s.attrs,
            syn::Item::Enum(e) => &e.attrs,
            syn::Item::Const(c) => &c.attrs,
            syn::Item::Static(s) => &s.attrs,
            syn::Item::Trait(t) => &t.attrs,
            syn::Item::Type(t) => &t.attrs,
            syn::Item::Macro(m) => &m.attrs,
            _ => return syn::visit::visit_item(self, item),
        };
        if !is_cfg_test(attrs) {
            syn::visit::visit_item(self, item);
        }
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.found(p.segments.iter().map(|s| s.ident.to_string()).collect());
        syn::visit::visit_path(self, p);
    }

    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        self.inline += 1;
        syn::visit::visit_item_mod(self, m);
        self.inline -= 1;
    }

    /// `pub(super)`, `pub(in crate::a)`: whom an item is shown to, not
    /// what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.visit_path(&m.path);
        self.tokens(m.tokens.clone());
    }
}

/// The strongly connected components with more than one module (Tarjan).
fn cycles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Tarjan<'g> {
        graph: &'g BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        out: Vec<Vec<Module>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    comp.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

/// What is wrong with `graph` given the allowed back-edges: cycles left once
/// they are removed, and allowed edges that no longer exist.
fn problems(
    graph: &BTreeMap<Module, BTreeSet<Module>>,
    allowed: &[(&str, &str, &str)],
) -> Vec<String> {
    let mut out = Vec::new();
    for (from, to, _) in allowed {
        if !graph.get(*from).is_some_and(|t| t.contains(*to)) {
            out.push(format!(
                "the allowed back-edge {from} -> {to} is gone: delete it from ALLOWED_BACK_EDGES"
            ));
        }
    }
    let mut rest = graph.clone();
    for (from, to, _) in allowed {
        if let Some(t) = rest.get_mut(*from) {
            t.remove(*to);
        }
    }
    for comp in cycles(&rest) {
        out.push(format!(
            "a module cycle: {} (all of {} reach each other)",
            shortest_cycle(&rest, &comp).join(" -> "),
            comp.join(", ")
        ));
    }
    out
}

/// A shortest cycle through the first module of `comp`, a strongly
/// connected set of `graph`, as the modules along it (the first repeated at
/// the end).
fn shortest_cycle(graph: &BTreeMap<Module, BTreeSet<Module>>, comp: &[Module]) -> Vec<Module> {
    let start = comp[0].as_str();
    let members: BTreeSet<&str> = comp.iter().map(String::as_str).collect();
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph[v].iter().map(String::as_str) {
            if !members.contains(w) {
                continue;
            }
            if w == start {
                let mut path = vec![start.to_string(), v.to_string()];
                let mut at = v;
                while at != start {
                    at = came_from[at];
                    path.push(at.to_string());
                }
                path.reverse();
                return path;
            }
            if !came_from.contains_key(w) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("{start} is on a cycle of its strongly connected set")
}

#[test]
fn the_module_graph_has_no_cycle_but_the_listed_back_edges() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    assert!(
        modules.len() > 20 && modules.contains_key("server") && modules.contains_key("wire::items"),
        "read the crate's modules: {:?}",
        modules.keys().collect::<Vec<_>>()
    );
    let graph = graph(&modules);
    let problems = problems(&graph, ALLOWED_BACK_EDGES);
    assert!(
        problems.is_empty(),
        "\n{}\n(a new cycle: move what its edge reaches for, or invert it; \
         ALLOWED_BACK_EDGES only shrinks)\n",
        problems.join("\n")
    );
}

/// The top-level module of `module` (`wire::items` is `wire`).
fn top(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// Each edge that reaches a layer above its own, and each module in no
/// layer.
fn layer_problems(
    graph: &BTreeMap<Module, BTreeSet<Module>>,
    layers: &[(&str, &[&str])],
) -> Vec<String> {
    let layer_of = |m: &str| layers.iter().position(|(_, ms)| ms.contains(&top(m)));
    let mut out = Vec::new();
    let mut unplaced = BTreeSet::new();
    for (from, tos) in graph {
        if from == "crate" {
            continue;
        }
        let Some(lf) = layer_of(from) else {
            unplaced.insert(top(from).to_string());
            continue;
        };
        for to in tos {
            match layer_of(to) {
                Some(lt) if lt > lf => out.push(format!(
                    "{from} ({}) uses {to} ({}), a higher layer",
                    layers[lf].0, layers[lt].0
                )),
                Some(_) => {}
                None => {
                    unplaced.insert(top(to).to_string());
                }
            }
        }
    }
    out.extend(
        unplaced.into_iter().map(|m| {
            format!("module {m} is in no layer: add it to LAYERS and docs/ARCHITECTURE.md")
        }),
    );
    out
}

/// Each edge from one phase (or a child of it) to another.
fn phase_edges(graph: &BTreeMap<Module, BTreeSet<Module>>, phases: &[&str]) -> Vec<String> {
    let phase_of = |m: &str| {
        phases
            .iter()
            .copied()
            .find(|p| m == *p || is_ancestor(p, m))
    };
    let mut out = Vec::new();
    for (from, tos) in graph {
        let Some(pf) = phase_of(from) else {
            continue;
        };
        for to in tos {
            if let Some(pt) = phase_of(to).filter(|pt| *pt != pf) {
                out.push(format!(
                    "{from} uses {to}: the phase {pf} names the phase {pt}"
                ));
            }
        }
    }
    out
}

/// The modules outside `store` whose code names a database driver.
fn driver_users(modules: &BTreeMap<Module, String>, crates: &[&str]) -> Vec<String> {
    modules
        .iter()
        .filter(|(name, _)| top(name) != "store")
        .filter_map(|(name, text)| {
            let file = syn::parse_file(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let mut paths = Paths::default();
            paths.visit_file(&file);
            let named: BTreeSet<&str> = paths
                .found
                .iter()
                .filter_map(|p| p.first().map(String::as_str))
                .filter(|first| crates.contains(first))
                .collect();
            (!named.is_empty()).then(|| format!("{name} names {named:?}"))
        })
        .collect()
}

/// Each edge from a module outside the store to one of its backends (or a
/// backend's child).
fn backend_users(graph: &BTreeMap<Module, BTreeSet<Module>>, backends: &[&str]) -> Vec<String> {
    let backend_of = |m: &str| backends.iter().find(|b| m == **b || is_ancestor(b, m));
    let mut out = Vec::new();
    for (from, tos) in graph {
        if top(from) == "store" {
            continue;
        }
        for to in tos {
            if let Some(b) = backend_of(to) {
                out.push(format!(
                    "{from} uses {to}: the backend {b} is named outside the store"
                ));
            }
        }
    }
    out
}

/// Each edge from a module inside one of `folders` back up to one of its
/// ancestors inside that folder (the folder itself included).
fn arrows_back_up(named: &BTreeMap<Module, BTreeSet<Module>>, folders: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for (from, tos) in named {
        let Some(folder) = folders.iter().find(|f| is_ancestor(f, from)) else {
            continue;
        };
        for to in tos {
            let inside = to == folder || is_ancestor(folder, to);
            if inside && is_ancestor(to, from) {
                out.push(format!("{from} uses its ancestor {to}"));
            }
        }
    }
    out
}

#[test]
fn only_the_store_names_its_backends() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let mut problems: Vec<String> = BACKENDS
        .iter()
        .filter(|b| !modules.contains_key(**b))
        .map(|b| format!("{b} is no module: update BACKENDS"))
        .collect();
    problems.extend(backend_users(&graph(&modules), BACKENDS));
    assert!(
        problems.is_empty(),
        "\n{}\n(open the store through `store::open` and hold its traits)\n",
        problems.join("\n")
    );
}

/// The folders of `src/`: each top-level module that has children. A new
/// folder is held to the rule from its first file.
fn folders(modules: &BTreeMap<Module, String>) -> Vec<String> {
    let tops: BTreeSet<&str> = modules
        .keys()
        .filter_map(|m| m.split_once("::").map(|(top, _)| top))
        .collect();
    tops.into_iter().map(str::to_owned).collect()
}

#[test]
fn no_child_of_a_folder_uses_its_parent() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let folders = folders(&modules);
    assert!(
        ["engine", "server", "store", "wire"]
            .iter()
            .all(|f| folders.iter().any(|g| g == f)),
        "the folders were not found: {folders:?}"
    );
    let folders: Vec<&str> = folders.iter().map(String::as_str).collect();
    let problems = arrows_back_up(&named(&modules), &folders);
    assert!(
        problems.is_empty(),
        "\n{}\n(what the children share goes in a child of its own, which they name)\n",
        problems.join("\n")
    );
}

#[test]
fn every_module_uses_only_its_own_layer_and_those_below() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = graph(&modules(&src));
    let problems = layer_problems(&graph, LAYERS);
    assert!(
        problems.is_empty(),
        "\n{}\n(move what the edge reaches for down a layer, or the user up)\n",
        problems.join("\n")
    );
}

#[test]
fn no_phase_of_a_request_names_another() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules = modules(&src);
    let mut problems: Vec<String> = PHASES
        .iter()
        .filter(|phase| !modules.contains_key(**phase))
        .map(|phase| format!("{phase} is no module: update PHASES"))
        .collect();
    problems.extend(phase_edges(&graph(&modules), PHASES));
    assert!(
        problems.is_empty(),
        "\n{}\n(a phase returns its decision to the driver, `server::proxy`, which takes \
         the next step; what two phases share goes in a module that is none)\n",
        problems.join("\n")
    );
}

#[test]
fn only_the_store_names_a_database_driver() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let users = driver_users(&modules(&src), DATABASE_CRATES);
    assert!(users.is_empty(), "{users:#?}");
}

/// The checker itself, on small made-up crates: it sees each kind of path,
/// finds a cycle, and holds the allow-list to what exists.
mod checker {
    use super::*;

    fn graph_of(files: &[(&str, &str)]) -> BTreeMap<Module, BTreeSet<Module>> {
        graph(
            &files
                .iter()
                .map(|(m, t)| (m.to_string(), t.to_string()))
                .collect(),
        )
    }

    fn edges(g: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<String> {
        g.iter()
            .flat_map(|(f, ts)| ts.iter().map(move |t| format!("{f}->{t}")))
            .collect()
    }

    #[test]
    fn it_sees_use_items_code_paths_super_children_imports_and_macros() {
        let g = graph_of(&[
            (
                "crate",
                "pub mod a; pub mod b; pub mod c; pub mod d; pub mod e;",
            ),
            (
                "a",
                "pub mod x; use crate::{b::{self, B}, c as see}; fn f() { x::g(); see::h(); }",
            ),
            ("a::x", "fn g() -> super::super::d::D { super::Y }"),
            ("b", "fn f() { tracing::info!(v = %crate::e::E); }"),
            (
                "c",
                "#[cfg(test)] mod tests { use crate::a::A; } /// [crate::d]\nfn f() {}",
            ),
            ("d", ""),
            ("e", "use crate::d; fn f() { d::D; }"),
        ]);
        // a::x -> a (`super::Y`) is a child using its parent: not an edge.
        assert_eq!(
            edges(&g),
            ["a->a::x", "a->b", "a->c", "a::x->d", "b->e", "e->d"]
        );
    }

    #[test]
    fn it_fails_on_a_cycle_and_names_its_edges() {
        let g = graph_of(&[
            ("crate", "pub mod a; pub mod b; pub mod c;"),
            ("a", "use crate::b::B;"),
            ("b", "fn f() { crate::c::g() }"),
            ("c", "fn g() { let _ = crate::a::A; }"),
        ]);
        let p = problems(&g, &[]);
        assert_eq!(
            p,
            ["a module cycle: a -> b -> c -> a (all of a, b, c reach each other)"]
        );
        assert!(problems(&g, &[("c", "a", "test")]).is_empty());
    }

    #[test]
    fn it_fails_when_an_allowed_edge_is_gone() {
        let g = graph_of(&[
            ("crate", "pub mod a; pub mod b;"),
            ("a", "use crate::b::B;"),
            ("b", ""),
        ]);
        let p = problems(&g, &[("b", "a", "test")]);
        assert_eq!(
            p,
            ["the allowed back-edge b -> a is gone: delete it from ALLOWED_BACK_EDGES"]
        );
    }

    #[test]
    fn it_fails_on_an_import_of_a_higher_layer_and_on_a_module_in_none() {
        let g = graph_of(&[
            ("crate", "pub mod low; pub mod high; pub mod stray;"),
            ("low", "pub mod x;"),
            ("low::x", "fn f() { crate::high::h() }"),
            ("high", "use crate::low::L; use crate::stray::S;"),
            ("stray", ""),
        ]);
        let layers: &[(&str, &[&str])] = &[("bottom", &["low"]), ("top", &["high"])];
        assert_eq!(
            layer_problems(&g, layers),
            [
                "low::x (bottom) uses high (top), a higher layer",
                "module stray is in no layer: add it to LAYERS and docs/ARCHITECTURE.md",
            ]
        );
        let ok: &[(&str, &[&str])] = &[("bottom", &["low", "stray"]), ("top", &["high"])];
        let g = graph_of(&[
            ("crate", "pub mod low; pub mod high; pub mod stray;"),
            ("high", "use crate::low::L; use crate::stray::S;"),
            ("low", ""),
            ("stray", ""),
        ]);
        assert!(layer_problems(&g, ok).is_empty());
    }

    #[test]
    fn it_fails_on_a_phase_that_names_another() {
        let g = graph_of(&[
            ("crate", "pub mod s;"),
            ("s", "mod a; mod b; mod c; mod shared; mod driver;"),
            ("s::a", "pub mod x; use super::shared::T;"),
            ("s::a::x", "fn f() { super::super::b::g() }"),
            ("s::b", "use super::shared::T;"),
            ("s::c", "fn f() { let _ = super::a::A; }"),
            ("s::shared", ""),
            (
                "s::driver",
                "fn f() { super::a::f(); super::b::g(); super::c::f(); }",
            ),
        ]);
        // A phase's use of its child, of a module that is no phase, and the
        // driver's use of the phases are no edges between phases.
        let phases = ["s::a", "s::b", "s::c"];
        assert_eq!(
            phase_edges(&g, &phases),
            [
                "s::a::x uses s::b: the phase s::a names the phase s::b",
                "s::c uses s::a: the phase s::c names the phase s::a",
            ]
        );
    }

    #[test]
    fn it_fails_on_a_backend_named_outside_the_store() {
        let g = graph_of(&[
            ("crate", "pub mod store; pub mod app; pub mod cli;"),
            ("store", "pub mod sqlite; pub mod open; pub use open::open;"),
            ("store::sqlite", "pub mod check;"),
            ("store::sqlite::check", ""),
            ("store::open", "use super::sqlite::Backend;"),
            ("app", "fn f() { crate::store::open(); }"),
            (
                "cli",
                "use crate::store::sqlite::check; fn f() { check::g() }",
            ),
        ]);
        assert_eq!(
            backend_users(&g, &["store::sqlite"]),
            ["cli uses store::sqlite::check: the backend store::sqlite is named outside the store"]
        );
    }

    #[test]
    fn it_fails_on_a_child_that_uses_its_parent_inside_the_folder() {
        let files: BTreeMap<Module, String> = [
            ("crate", "pub mod s; pub mod t;"),
            ("s", "mod a; mod b; pub use a::A; pub struct Helper;"),
            ("s::a", "pub mod x; use super::b::B; use crate::t::T;"),
            (
                "s::a::x",
                "fn f() -> super::A { crate::s::Helper } mod inner { use super::f; }",
            ),
            (
                "s::b",
                "use super::A; pub(super) fn g() {} pub(in crate::s) fn h() {}",
            ),
            ("t", "pub mod u;"),
            ("t::u", "use super::T;"),
        ]
        .iter()
        .map(|(m, t)| (m.to_string(), t.to_string()))
        .collect();
        // Naming a sibling, or a module outside the folder, is no arrow
        // back up; `t` is not listed.
        assert_eq!(
            arrows_back_up(&named(&files), &["s"]),
            [
                "s::a::x uses its ancestor s",
                "s::a::x uses its ancestor s::a",
                "s::b uses its ancestor s",
            ]
        );
    }

    #[test]
    fn it_sees_a_driver_named_outside_the_store() {
        let modules: BTreeMap<Module, String> = [
            ("store::sqlite", "use rusqlite::Connection;"),
            (
                "cli",
                "fn f() { let _ = rusqlite::Connection::open(\"x\"); }",
            ),
            ("app", "use crate::store::sqlite::Open;"),
        ]
        .iter()
        .map(|(m, t)| (m.to_string(), t.to_string()))
        .collect();
        assert_eq!(
            driver_users(&modules, DATABASE_CRATES),
            ["cli names {\"rusqlite\"}"]
        );
    }
}

/// Lines a file of `src/` may have before its `#[cfg(test)]` module: past
/// it, a file holds more than one subject, and is split by subject.
const MAX_LINES: usize = 800;

/// Each `.rs` file under `dir`, with its lines before its first
/// `#[cfg(test)]` at the start of a line (all of them when it has none).
fn lines_before_tests(dir: &Path) -> Vec<(PathBuf, usize)> {
    sources(dir)
        .into_iter()
        .map(|(path, text)| {
            let before = text
                .lines()
                .take_while(|l| !l.starts_with("#[cfg(test)]"))
                .count();
            (path, before)
        })
        .collect()
}

#[test]
fn no_file_of_src_passes_800_lines_before_its_tests() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = lines_before_tests(&src);
    assert!(files.len() > 50, "found the sources: {}", files.len());
    let long: Vec<String> = files
        .iter()
        .filter(|(_, n)| *n > MAX_LINES)
        .map(|(p, n)| {
            let p = p.strip_prefix(&src).unwrap_or(p);
            format!("src/{}: {n} lines before its tests", p.display())
        })
        .collect();
    assert!(
        long.is_empty(),
        "over {MAX_LINES} lines (split by subject):\n{}",
        long.join("\n")
    );
}

#[test]
fn the_line_gate_counts_up_to_the_tests() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.rs"),
        "fn a() {}\n\n#[cfg(test)]\nmod tests {}\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("b.rs"), "fn b() {}\nfn c() {}\n").unwrap();
    let counted = lines_before_tests(dir.path());
    let counts: Vec<usize> = counted.iter().map(|(_, n)| *n).collect();
    assert_eq!(counts, [2, 2], "{counted:?}");
}
