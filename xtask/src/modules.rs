//! `cargo xtask modules [--graph]`: the graph of the crate's files, checked against the layer
//! order ARCHITECTURE.md states; fails on a circle of files or an import that runs up the layers.
//!
//! An edge is a path in code or a `use` item that reaches a file: `crate::`, `super::`, `self::`
//! paths, a `use` item's paths (relative ones through the file's own submodules), and paths that
//! start with a name a `use` item brought in. Each path is followed to the file that defines the
//! item, through `pub use` re-exports (the crate root's and every module's) and glob imports.
//! Comments, strings and character literals are blanked first, so a doc link is no edge.
//!
//! A module's file is made of its submodules: its edges to them (the crate root's to every file,
//! `tensor/mod.rs`'s to `tensor/autograd/`) are left out of the circles, and only files that are
//! not parent and descendant can form one. Every other edge counts, `#[cfg(test)]` code included.
//!
//! The layers are read from ARCHITECTURE.md's sentence "Dependencies run one way: ...": groups of
//! top-level modules in backticks separated by arrows, highest first, then the leaves in the
//! parentheses after "The leaves". A file may use its own layer, any lower one and the leaves; a
//! leaf only leaves. A top-level module the sentence does not name is an error, so the map grows
//! with the code.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The stated layer order: `order[0]` is the highest layer; `leaves` serve every layer.
#[derive(Debug, Clone, PartialEq)]
pub struct Layers {
    pub order: Vec<Vec<String>>,
    pub leaves: Vec<String>,
}

impl Layers {
    /// Reads the order from ARCHITECTURE.md's "Dependencies run one way:" sentence.
    pub fn from_map(text: &str) -> Result<Layers, String> {
        const START: &str = "Dependencies run one way:";
        let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let at = joined
            .find(START)
            .ok_or_else(|| format!("no sentence starting {START:?}"))?;
        let rest = &joined[at + START.len()..];
        let end = rest.find(". ").ok_or("the layer sentence has no end")?;
        let order: Vec<Vec<String>> = rest[..end]
            .split('→')
            .map(backticked)
            .filter(|g| !g.is_empty())
            .collect();
        let leaves_at = rest[end..]
            .find("The leaves (")
            .ok_or("no \"The leaves (...)\" after the layer sentence")?;
        let leaves_text = &rest[end + leaves_at..];
        let close = leaves_text
            .find(')')
            .ok_or("the leaves' parentheses do not close")?;
        let leaves = backticked(&leaves_text[..close]);
        if order.is_empty() || leaves.is_empty() {
            return Err("the layer sentence names no modules".into());
        }
        Ok(Layers { order, leaves })
    }

    /// The layer of a top-level module: 0 is the highest; leaves are `usize::MAX`.
    fn rank(&self, module: &str) -> Option<usize> {
        if self.leaves.iter().any(|l| l == module) {
            return Some(usize::MAX);
        }
        self.order
            .iter()
            .position(|g| g.iter().any(|m| m == module))
    }
}

/// The names in backticks in `s`.
fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// An edge of the graph: `from` uses something `to` defines, first at `line` of `from`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub from: String,
    pub to: String,
    pub line: usize,
}

/// What the check found.
#[derive(Debug, Default)]
pub struct Report {
    /// Every file (relative to src/) and the files it uses, with the first line of each use.
    pub graph: BTreeMap<String, BTreeMap<String, usize>>,
    /// Each circle: its files, and the edges between them that close it.
    pub circles: Vec<(Vec<String>, Vec<Edge>)>,
    /// Imports from a file to a file in a higher layer.
    pub upward: Vec<Edge>,
    /// Top-level modules the stated order does not place.
    pub unplaced: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.circles.is_empty() && self.upward.is_empty() && self.unplaced.is_empty()
    }
}

pub fn run(args: &[String]) -> ExitCode {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let map = match std::fs::read_to_string(root.join("ARCHITECTURE.md")) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("modules: ARCHITECTURE.md: {e}");
            return ExitCode::FAILURE;
        }
    };
    let layers = match Layers::from_map(&map) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("modules: ARCHITECTURE.md: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = match check(&root.join("src"), &layers) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("modules: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.iter().any(|a| a == "--graph") {
        for (file, uses) in &report.graph {
            let to: Vec<&str> = uses.keys().map(String::as_str).collect();
            println!(
                "{file} -> {}",
                if to.is_empty() {
                    "(none)".into()
                } else {
                    to.join(", ")
                }
            );
        }
    }
    print!("{}", summary(&report, &layers));
    if report.ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The check's verdict, one line per finding.
pub fn summary(report: &Report, layers: &Layers) -> String {
    let mut out = String::new();
    let edges: usize = report.graph.values().map(BTreeMap::len).sum();
    let order: Vec<String> = layers.order.iter().map(|g| g.join(", ")).collect();
    out += &format!(
        "{} files, {edges} edges; layers {} (leaves {})\n",
        report.graph.len(),
        order.join(" -> "),
        layers.leaves.join(", ")
    );
    for m in &report.unplaced {
        out += &format!("unplaced: src/{m} is in no layer of ARCHITECTURE.md's order\n");
    }
    for (files, closing) in &report.circles {
        out += &format!("circle: {}\n", files.join(" <-> "));
        for e in closing {
            out += &format!("    src/{}:{} uses src/{}\n", e.from, e.line, e.to);
        }
    }
    for e in &report.upward {
        out += &format!("upward: src/{}:{} uses src/{}\n", e.from, e.line, e.to);
    }
    if report.circles.is_empty() {
        out += "no circles\n";
    }
    if report.upward.is_empty() {
        out += "no import runs up the layers\n";
    }
    out
}

/// Builds the graph of the files under `src` and checks it against `layers`.
pub fn check(src: &Path, layers: &Layers) -> Result<Report, String> {
    let mut files = Vec::new();
    collect_rs(src, &mut files)?;
    files.sort();
    let mut crate_ = Crate::default();
    for path in &files {
        let rel = path
            .strip_prefix(src)
            .map_err(|e| e.to_string())?
            .to_string_lossy()
            .replace('\\', "/");
        let text = std::fs::read_to_string(path).map_err(|e| format!("{rel}: {e}"))?;
        crate_.add_file(&rel, &text);
    }
    Ok(crate_.report(layers))
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| e.to_string())?.path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The module path a file defines: `lib.rs` -> [], `nn/mod.rs` and `nn.rs` -> [nn].
fn file_module(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(String::from)
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// A `use` binding: `name` (or a glob when `None`) stands for `target`, a path from the crate
/// root or relative to the module (resolved when used).
#[derive(Debug, Clone)]
struct Binding {
    name: Option<String>,
    target: Vec<String>,
}

/// One module (a file's, or an inline `mod x { .. }` in it).
#[derive(Debug, Default)]
struct Module {
    file: String,
    /// Items defined here.
    items: BTreeSet<String>,
    bindings: Vec<Binding>,
}

/// A path met in a file, to be resolved once every file is read.
#[derive(Debug)]
struct PathUse {
    file: String,
    module: Vec<String>,
    line: usize,
    segments: Vec<String>,
}

#[derive(Default)]
struct Crate {
    modules: HashMap<Vec<String>, Module>,
    /// `#[macro_export]` macros live at the crate root but are defined in a file.
    exported_macros: HashMap<String, String>,
    paths: Vec<PathUse>,
    files: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Colons,
    Punct(char),
}

/// Blanks comments, strings and character literals (newlines kept, so lines still count).
fn blank(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let keep_lines = |s: &[char], out: &mut String| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    while i < c.len() {
        let start = i;
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && c.get(i + 1) == Some(&'*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(hashes) = raw_string_start(&c, i) {
            // r"..", r#".."#, br#".."#: ends at a quote followed by as many hashes.
            i += hashes.1;
            while i < c.len() {
                if c[i] == '"'
                    && c[i + 1..]
                        .iter()
                        .take(hashes.0)
                        .filter(|&&h| h == '#')
                        .count()
                        == hashes.0
                {
                    i += 1 + hashes.0;
                    break;
                }
                i += 1;
            }
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c[i] == '\'' {
            // A character literal ('x', '\n', '\u{..}'), or a lifetime ('a), left as it is.
            if c.get(i + 1) == Some(&'\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                out.push(c[i]);
                i += 1;
                continue;
            }
        } else {
            out.push(c[i]);
            i += 1;
            continue;
        }
        keep_lines(&c[start..i.min(c.len())], &mut out);
    }
    out
}

/// At a raw string's start (`r"`, `r#"`, `br"`...): (hashes, chars up to and with the quote).
fn raw_string_start(c: &[char], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return None;
    }
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (c.get(j) == Some(&'"')).then_some((hashes, j + 1 - i))
}

fn tokens(text: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            let word: String = c[start..i].iter().collect();
            out.push((Tok::Ident(word.trim_start_matches("r#").to_string()), line));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_' || c[i] == '.') {
                i += 1;
            }
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Colons, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

const ITEM_KEYWORDS: [&str; 8] = [
    "struct", "enum", "trait", "fn", "type", "const", "static", "union",
];

impl Crate {
    fn add_file(&mut self, rel: &str, text: &str) {
        let file_mod = file_module(rel);
        self.files.push(rel.to_string());
        self.modules.entry(file_mod.clone()).or_default().file = rel.to_string();
        let toks = tokens(&blank(text));
        let ident = |k: usize| match toks.get(k) {
            Some((Tok::Ident(s), _)) => Some(s.as_str()),
            _ => None,
        };
        // The inline modules open at this point: (module path, brace depth of its body).
        let mut stack: Vec<(Vec<String>, usize)> = vec![(file_mod.clone(), 0)];
        let mut depth = 0;
        let mut macro_export = false;
        let mut i = 0;
        while i < toks.len() {
            let (cur, body) = stack.last().cloned().expect("the file's module");
            let at_module_level = depth == body;
            match &toks[i].0 {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth -= 1;
                    if stack.len() > 1 && depth < stack.last().expect("open").1 {
                        stack.pop();
                    }
                }
                // `#[macro_export]`, for the `macro_rules!` after it.
                Tok::Ident(w) if w == "macro_export" => macro_export = true,
                Tok::Ident(w) if w == "mod" && at_module_level => {
                    if let (Some(name), Some((Tok::Punct('{'), _))) =
                        (ident(i + 1), toks.get(i + 2))
                    {
                        let mut path = cur.clone();
                        path.push(name.to_string());
                        self.modules.entry(path.clone()).or_default().file = rel.to_string();
                        depth += 1;
                        stack.push((path, depth));
                        i += 3;
                        continue;
                    }
                }
                Tok::Ident(w) if w == "macro_rules" => {
                    if let Some(name) = ident(i + 2) {
                        let m = self.modules.entry(cur.clone()).or_default();
                        m.items.insert(name.to_string());
                        if macro_export {
                            self.exported_macros
                                .insert(name.to_string(), rel.to_string());
                        }
                    }
                    macro_export = false;
                }
                Tok::Ident(w) if w == "use" => {
                    // At module level or in a function body: a binding of the module all the same.
                    let (trees, end) = use_tree(&toks, i + 1);
                    let line = toks[i].1;
                    for (path, name) in trees {
                        let binding = Binding {
                            name: name.clone(),
                            target: path.clone(),
                        };
                        self.modules
                            .entry(cur.clone())
                            .or_default()
                            .bindings
                            .push(binding);
                        self.paths.push(PathUse {
                            file: rel.to_string(),
                            module: cur.clone(),
                            line,
                            segments: path,
                        });
                    }
                    i = end;
                    continue;
                }
                Tok::Ident(w) if ITEM_KEYWORDS.contains(&w.as_str()) && at_module_level => {
                    if let Some(name) = ident(i + 1) {
                        if !ITEM_KEYWORDS.contains(&name) && name != "unsafe" && name != "async" {
                            self.modules
                                .entry(cur.clone())
                                .or_default()
                                .items
                                .insert(name.into());
                        }
                    }
                }
                Tok::Ident(_) => {
                    // A path: idents joined by `::`. Only its first occurrence starts it.
                    let after_colons = i > 0 && toks[i - 1].0 == Tok::Colons;
                    if !after_colons && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Colons) {
                        let mut segs = Vec::new();
                        let mut k = i;
                        while let Some(s) = ident(k) {
                            segs.push(s.to_string());
                            if toks.get(k + 1).map(|t| &t.0) != Some(&Tok::Colons) {
                                break;
                            }
                            k += 2;
                        }
                        self.paths.push(PathUse {
                            file: rel.to_string(),
                            module: cur.clone(),
                            line: toks[i].1,
                            segments: segs,
                        });
                        i = k + 1;
                        continue;
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }

    fn report(&self, layers: &Layers) -> Report {
        let mut report = Report::default();
        for f in &self.files {
            report.graph.insert(f.clone(), BTreeMap::new());
        }
        for p in &self.paths {
            let Some(to) = self.resolve_use(&p.module, &p.segments, 0) else {
                continue;
            };
            if to != p.file {
                let uses = report.graph.get_mut(&p.file).expect("every file");
                let line = uses.entry(to).or_insert(p.line);
                *line = (*line).min(p.line);
            }
        }
        // Layers: every top-level module placed, and no edge to a higher layer.
        let top = |f: &str| file_module(f).first().cloned();
        let tops: BTreeSet<String> = self.files.iter().filter_map(|f| top(f)).collect();
        report.unplaced = tops
            .iter()
            .filter(|m| layers.rank(m).is_none())
            .cloned()
            .collect();
        for (from, uses) in &report.graph {
            let Some(a) = top(from).and_then(|m| layers.rank(&m)) else {
                continue;
            };
            for (to, &line) in uses {
                let Some(b) = top(to).and_then(|m| layers.rank(&m)) else {
                    continue;
                };
                // Leaves have rank MAX: anything may use them, and they only each other.
                if b < a {
                    report.upward.push(Edge {
                        from: from.clone(),
                        to: to.clone(),
                        line,
                    });
                }
            }
        }
        // Circles: strongly connected sets of files, a file's edges to its own submodules left out.
        let counted = |from: &str, to: &str| {
            let (a, b) = (file_module(from), file_module(to));
            !(b.len() > a.len() && b.starts_with(&a))
        };
        let names: Vec<&String> = report.graph.keys().collect();
        let index: HashMap<&String, usize> =
            names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let adj: Vec<Vec<usize>> = names
            .iter()
            .map(|f| {
                report.graph[*f]
                    .keys()
                    .filter(|t| counted(f, t))
                    .map(|t| index[t])
                    .collect()
            })
            .collect();
        for comp in strongly_connected(&adj) {
            let files: Vec<String> = comp.iter().map(|&v| names[v].clone()).collect();
            let mut closing = Vec::new();
            for &v in &comp {
                for &w in &adj[v] {
                    if comp.contains(&w) {
                        closing.push(Edge {
                            from: names[v].clone(),
                            to: names[w].clone(),
                            line: report.graph[names[v]][names[w]],
                        });
                    }
                }
            }
            closing.sort();
            report.circles.push((files, closing));
        }
        report
    }

    /// The file a path written in module `module` reaches, if it reaches one of the crate's.
    fn resolve_use(&self, module: &[String], segs: &[String], hops: usize) -> Option<String> {
        if hops > 16 || segs.is_empty() {
            return None;
        }
        let (start, rest) = match segs[0].as_str() {
            "crate" => (Vec::new(), &segs[1..]),
            "self" => (module.to_vec(), &segs[1..]),
            "super" => {
                let mut m = module.to_vec();
                let mut k = 0;
                while segs.get(k).map(String::as_str) == Some("super") {
                    m.pop();
                    k += 1;
                }
                (m, &segs[k..])
            }
            "Self" => return None,
            first => {
                // Relative: a submodule, an item or a binding of this module (or of an enclosing
                // inline module, for `mod tests`'s `use super::*`).
                let mut m = module.to_vec();
                loop {
                    if self.has_child(&m, first) || self.names_here(&m, first) {
                        break (m, segs);
                    }
                    let file = &self.modules.get(&m)?.file;
                    if m.is_empty()
                        || self.modules.get(&m[..m.len() - 1]).map(|p| &p.file) != Some(file)
                    {
                        return None;
                    }
                    m.pop();
                }
            }
        };
        self.walk(start, rest, hops)
    }

    fn has_child(&self, module: &[String], name: &str) -> bool {
        let mut child = module.to_vec();
        child.push(name.to_string());
        self.modules.contains_key(&child)
    }

    fn names_here(&self, module: &[String], name: &str) -> bool {
        self.modules.get(module).is_some_and(|m| {
            m.items.contains(name) || m.bindings.iter().any(|b| b.name.as_deref() == Some(name))
        })
    }

    /// Follows `rest` from module `at`: submodules, then items, then bindings and globs.
    fn walk(&self, mut at: Vec<String>, rest: &[String], hops: usize) -> Option<String> {
        for (k, seg) in rest.iter().enumerate() {
            if self.has_child(&at, seg) {
                at.push(seg.clone());
                continue;
            }
            let module = self.modules.get(&at)?;
            if module.items.contains(seg) {
                return Some(module.file.clone());
            }
            if at.is_empty() {
                if let Some(f) = self.exported_macros.get(seg) {
                    return Some(f.clone());
                }
            }
            for b in &module.bindings {
                if b.name.as_deref() == Some(seg.as_str()) {
                    let mut path = b.target.clone();
                    path.extend_from_slice(&rest[k + 1..]);
                    return self.resolve_use(&at, &path, hops + 1);
                }
            }
            for b in module.bindings.iter().filter(|b| b.name.is_none()) {
                let mut path = b.target.clone();
                path.extend_from_slice(&rest[k..]);
                if let Some(f) = self.resolve_use(&at, &path, hops + 1) {
                    return Some(f);
                }
            }
            // Not found (a method, a variant, an extern item): the module's own file.
            return Some(module.file.clone());
        }
        self.modules.get(&at).map(|m| m.file.clone())
    }
}

/// A leaf of a use tree: its path and the name it binds (`None` for a glob).
type Leaf = (Vec<String>, Option<String>);

/// Parses a use tree from `toks[i]` to its `;`. Returns the leaves and the index after the `;`.
fn use_tree(toks: &[(Tok, usize)], i: usize) -> (Vec<Leaf>, usize) {
    let mut out = Vec::new();
    let mut k = i;
    parse_tree(toks, &mut k, Vec::new(), &mut out);
    while k < toks.len() && toks[k].0 != Tok::Punct(';') {
        k += 1;
    }
    (out, k + 1)
}

fn parse_tree(toks: &[(Tok, usize)], k: &mut usize, prefix: Vec<String>, out: &mut Vec<Leaf>) {
    let mut path = prefix;
    loop {
        match toks.get(*k).map(|t| &t.0) {
            Some(Tok::Colons) => *k += 1,
            Some(Tok::Ident(s)) if s == "as" => {
                *k += 1;
                if let Some(Tok::Ident(alias)) = toks.get(*k).map(|t| &t.0) {
                    *k += 1;
                    let alias = (alias != "_").then(|| alias.clone());
                    // `use x as _` binds nothing but still uses x: a binding no path can name.
                    out.push((path, Some(alias.unwrap_or_default())));
                }
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *k += 1;
            }
            Some(Tok::Punct('*')) => {
                *k += 1;
                out.push((path, None));
                return;
            }
            Some(Tok::Punct('{')) => {
                *k += 1;
                loop {
                    match toks.get(*k).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *k += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *k += 1,
                        None => return,
                        _ => parse_tree(toks, k, path.clone(), out),
                    }
                }
            }
            _ => {
                // End of this leaf (`,`, `}` or `;`): `self` in a group names the prefix.
                if path.last().map(String::as_str) == Some("self") {
                    path.pop();
                }
                let name = path.last().cloned();
                if !path.is_empty() {
                    out.push((path, name));
                }
                return;
            }
        }
    }
}

/// Strongly connected components of more than one vertex (Tarjan's, iterative), each sorted.
fn strongly_connected(adj: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = adj.len();
    let (mut index, mut low) = (vec![usize::MAX; n], vec![0; n]);
    let (mut on, mut stack, mut comps, mut next) = (vec![false; n], Vec::new(), Vec::new(), 0);
    for root in 0..n {
        if index[root] != usize::MAX {
            continue;
        }
        let mut work = vec![(root, 0)];
        while let Some((v, e)) = work.pop() {
            if e == 0 {
                index[v] = next;
                low[v] = next;
                next += 1;
                stack.push(v);
                on[v] = true;
            }
            if let Some(&w) = adj[v].get(e) {
                work.push((v, e + 1));
                if index[w] == usize::MAX {
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            if low[v] == index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = stack.pop().expect("on the stack");
                    on[w] = false;
                    comp.push(w);
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    comps.push(comp);
                }
            }
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
        }
    }
    comps
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAP: &str = "Dependencies run one way: examples → `top` → `mid` → `low`. The leaves\n\
                       (`error`) serve every layer.";

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = dir.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        dir
    }

    #[test]
    fn reads_the_layers_from_the_map() {
        let l = Layers::from_map(MAP).unwrap();
        assert_eq!(l.order, vec![vec!["top"], vec!["mid"], vec!["low"]]);
        assert_eq!(l.leaves, vec!["error"]);
    }

    #[test]
    fn a_circle_of_files_fails() {
        // mid/a.rs -> mid/b.rs through the folder's re-export; mid/b.rs -> mid/a.rs by super::.
        let dir = tree(&[
            ("lib.rs", "pub mod mid; mod error; pub use mid::Thing;"),
            ("error.rs", "pub struct Error;"),
            (
                "mid/mod.rs",
                "mod a; mod b; pub use b::Thing; pub use a::*;",
            ),
            (
                "mid/a.rs",
                "use crate::Thing; // crate::mid::b::nothing in a comment\npub fn f() {}",
            ),
            (
                "mid/b.rs",
                "pub struct Thing;\nfn g() { super::a::f(); let _ = \"crate::error\"; }",
            ),
        ]);
        let r = check(dir.path(), &Layers::from_map(MAP).unwrap()).unwrap();
        assert!(!r.ok());
        assert_eq!(r.circles.len(), 1, "{r:?}");
        assert_eq!(r.circles[0].0, vec!["mid/a.rs", "mid/b.rs"]);
        assert_eq!(
            r.graph["mid/a.rs"].keys().collect::<Vec<_>>(),
            vec!["mid/b.rs"]
        );
        // The folder's own re-exports of its files are no circle, nor is a string an edge.
        assert!(r.upward.is_empty() && r.unplaced.is_empty());
    }

    #[test]
    fn an_upward_import_and_an_unplaced_module_fail() {
        let dir = tree(&[
            ("lib.rs", "pub mod top; pub mod low; mod extra;"),
            ("top.rs", "pub struct T;"),
            ("low/mod.rs", "mod inner;"),
            (
                "low/inner.rs",
                "#[cfg(test)]\nmod tests {\n    use crate::top::T;\n}",
            ),
            ("extra.rs", ""),
        ]);
        let r = check(dir.path(), &Layers::from_map(MAP).unwrap()).unwrap();
        assert!(r.circles.is_empty());
        assert_eq!(
            r.upward,
            vec![Edge {
                from: "low/inner.rs".into(),
                to: "top.rs".into(),
                line: 3
            }]
        );
        assert_eq!(r.unplaced, vec!["extra"]);
    }

    #[test]
    fn the_crate_has_no_circle_and_no_upward_import() {
        let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        let map = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
        let layers = Layers::from_map(&map).unwrap();
        let r = check(&root.join("src"), &layers).unwrap();
        assert!(r.ok(), "{}", summary(&r, &layers));
    }
}
