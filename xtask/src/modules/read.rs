//! The crate as `cargo xtask modules` reads it: comments, strings and character literals blanked,
//! the rest cut into identifiers, `::` and punctuation; each file's items, inline modules,
//! `use` trees and paths; and a path followed to the file that defines its item (through
//! submodules, `pub use` re-exports, globs and `#[macro_export]` macros).

use std::collections::{BTreeSet, HashMap};

/// The module path a file defines: `lib.rs` -> [], `nn/mod.rs` and `nn.rs` -> [nn].
pub(super) fn file_module(rel: &str) -> Vec<String> {
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

/// The crate as read: its modules (each file's and each inline one), their items and `use`
/// bindings, and every path met, resolved on demand to the file that defines its item.
#[derive(Default)]
pub(super) struct Crate {
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
    /// The files read, relative to src/.
    pub(super) fn files(&self) -> &[String] {
        &self.files
    }

    /// Every path met that reaches another of the crate's files: (from, to, line).
    pub(super) fn edges(&self) -> impl Iterator<Item = (&str, String, usize)> + '_ {
        self.paths.iter().filter_map(|p| {
            let to = self.resolve_use(&p.module, &p.segments, 0)?;
            (to != p.file).then_some((p.file.as_str(), to, p.line))
        })
    }

    /// Reads one file: its items, inline modules, `use` bindings and paths.
    pub(super) fn add_file(&mut self, rel: &str, text: &str) {
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
