//! `cargo xtask modules [--graph]`: the graph of the crate's files, checked against the layer
//! order ARCHITECTURE.md states; fails on a circle of files or an import that runs up the layers.
//!
//! An edge is a path in code or a `use` item that reaches a file: `crate::`, `super::`, `self::`
//! paths, a `use` item's paths (relative ones through the file's own submodules), and paths that
//! start with a name a `use` item brought in. Each path is followed to the file that defines the
//! item, through `pub use` re-exports (the crate root's and every module's) and glob imports.
//! Comments, strings and character literals are blanked first, so a doc link is no edge. A
//! method call names no path: a type's file calling methods an `impl` block in another file
//! adds (trainer.rs and stream.rs) is no edge; the check sees what names are imported.
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
//!
//! read.rs reads the crate's files and follows paths; this file judges the graph.

mod read;

use read::{file_module, Crate};
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
    Ok(report(&crate_, layers))
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

/// The verdict on the crate `c` read: its graph, circles, upward imports and unplaced modules.
fn report(c: &Crate, layers: &Layers) -> Report {
    let mut report = Report::default();
    for f in c.files() {
        report.graph.insert(f.clone(), BTreeMap::new());
    }
    for (from, to, line) in c.edges() {
        let uses = report.graph.get_mut(from).expect("every file");
        let first = uses.entry(to).or_insert(line);
        *first = (*first).min(line);
    }
    // Layers: every top-level module placed, and no edge to a higher layer.
    let top = |f: &str| file_module(f).first().cloned();
    let tops: BTreeSet<String> = c.files().iter().filter_map(|f| top(f)).collect();
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
    let index: HashMap<&String, usize> = names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
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
