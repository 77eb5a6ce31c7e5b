//! Reverse-mode autograd. A tensor that requires grad carries a graph node; every op with such an
//! input records a node holding its backward rule (a closure beside the op's forward, owning
//! what the rule needs: detached saved tensors, shapes, scalars) and links to its inputs'
//! nodes. `backward()` orders the nodes reachable from the loss (reverse topological order of
//! the recorded graph, which is the tape read backwards), runs each rule once, and drops the rule
//! right after, so each saved activation is freed as soon as its backward has used it.
//!
//! Leaf gradients accumulate across `backward()` calls, in place on the GPU (one add kernel into
//! the existing buffer), until `zero_grad()`.

use crate::device::lock;
use crate::kernels::elementwise::{self, BinaryOp};
use crate::{Error, Result, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod replay;
pub use replay::{recomputing, replayable_seed};

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
    /// Backward passes running on this thread (a checkpointed segment runs one inside another).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
    static LEAF_HOOK: RefCell<Option<LeafHook>> = const { RefCell::new(None) };
    /// The node of each backward rule running on this thread, innermost last (a checkpointed
    /// segment's rule runs a backward pass of its own), for [`leaf_grad`].
    static RUNNING: RefCell<Vec<Arc<Node>>> = const { RefCell::new(Vec::new()) };
}

/// The gradient leaf input `i` of the running backward rule holds (sharing its memory), when
/// `keep` accepts it. A rule that adds its own gradient onto it in place returns `None` for
/// that input: batch-invariant sums continue from the gradient of the earlier micro-batches
/// instead of adding a separate sum to it (src/tensor/invariant.rs). `None` when input `i` is
/// no leaf, holds nothing, or `keep` refuses.
pub(crate) fn leaf_grad(i: usize, keep: impl FnOnce(&Tensor) -> bool) -> Option<Tensor> {
    RUNNING.with(|r| {
        let r = r.borrow();
        let node = r.last()?.inputs.get(i)?.as_ref()?;
        if !node.is_leaf {
            return None;
        }
        let held = lock(&node.grad).as_ref().filter(|g| keep(g)).cloned();
        held
    })
}

/// Pops the running rule's node when it returns (or fails).
struct RunningGuard;

impl Drop for RunningGuard {
    fn drop(&mut self) {
        RUNNING.with(|r| {
            r.borrow_mut().pop();
        });
    }
}

/// Called by the outermost backward pass on this thread with a leaf's id ([`leaf_id`]) as
/// soon as no node left in that pass adds to the leaf's gradient (ZeRO stage 2 reads and frees
/// gradients bucket by bucket from it).
pub type LeafHook = Box<dyn FnMut(usize) -> Result<()>>;

/// Keeps a [`LeafHook`] installed on this thread until dropped.
pub(crate) struct LeafHookGuard(());

impl LeafHookGuard {
    /// Installs `hook` for the backward passes run until the guard drops.
    pub(crate) fn set(hook: LeafHook) -> LeafHookGuard {
        LEAF_HOOK.with(|h| *h.borrow_mut() = Some(hook));
        LeafHookGuard(())
    }
}

impl Drop for LeafHookGuard {
    fn drop(&mut self) {
        LEAF_HOOK.with(|h| h.borrow_mut().take());
    }
}

/// The id a [`LeafHook`] gets for `t`'s gradient: `None` unless `t` is a leaf of the graph.
pub(crate) fn leaf_id(t: &Tensor) -> Option<usize> {
    t.node()
        .filter(|n| n.is_leaf)
        .map(|n| Arc::as_ptr(n) as usize)
}

/// Decrements the backward depth when dropped.
struct DepthGuard;

impl Drop for DepthGuard {
    fn drop(&mut self) {
        DEPTH.with(|d| d.set(d.get() - 1));
    }
}

/// Whether ops on this thread record a graph (false inside [`no_grad`]).
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous grad mode when dropped.
#[must_use = "grad recording is off only while the guard lives"]
pub struct NoGradGuard {
    prev: bool,
}

impl Drop for NoGradGuard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.prev));
    }
}

/// Turns recording off on this thread until the guard drops (evaluation, optimizer updates),
/// like `with torch.no_grad():`.
///
/// ```no_run
/// use fitgrad::nn::Module;
/// # fn f(model: &fitgrad::nn::Mlp, x: &fitgrad::Tensor) -> fitgrad::Result<()> {
/// let _g = fitgrad::no_grad();
/// let logits = model.forward(x)?; // no graph, no saved activations
/// # Ok(()) }
/// ```
pub fn no_grad() -> NoGradGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(false));
    NoGradGuard { prev }
}

/// Turns recording back on inside a `no_grad` scope until the guard drops (checkpointed
/// segments recompute their forward with recording inside the backward pass).
pub fn enable_grad() -> NoGradGuard {
    let prev = GRAD_ENABLED.with(|g| g.replace(true));
    NoGradGuard { prev }
}

/// Gradient checkpointing: runs `f(inputs)` without keeping its intermediate activations; the
/// backward pass runs `f` again with recording on and backpropagates through that. Only the
/// inputs are saved. `params` are the leaves `f` uses (they get their gradients during the
/// recomputation); listing them makes the segment recorded even when no input requires grad.
///
/// Trades one extra forward of the segment for its activations: worth it where a segment keeps
/// more than its input alive (gelu layers keep their pre-activation; deep stacks keep one
/// activation per layer).
///
/// Exact with dropout: the seeds the first forward draws through [`replayable_seed`] (every
/// `nn::Dropout` call) are recorded and handed out again, in order, to the recomputation, so it
/// applies the same masks (see src/tensor/autograd/replay.rs).
pub fn checkpoint<F>(inputs: &[&Tensor], params: &[&Tensor], f: F) -> Result<Tensor>
where
    F: Fn(&[Tensor]) -> Result<Tensor> + Send + Sync + 'static,
{
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let (out, seeds) = {
        let _g = no_grad();
        let tape = replay::record_seeds();
        let out = f(&detached)?;
        (out, tape.finish())
    };
    let n_inputs = inputs.len();
    let n_params = params.len();
    let mut all: Vec<&Tensor> = inputs.to_vec();
    all.extend_from_slice(params);
    Ok(record("checkpoint", out, &all, move || {
        Box::new(move |g, need| {
            let _e = enable_grad();
            let xs: Vec<Tensor> = detached
                .iter()
                .zip(need)
                .map(|(x, &n)| {
                    if n {
                        x.detach().with_requires_grad()
                    } else {
                        x.detach()
                    }
                })
                .collect();
            let tape = replay::replay_seeds(seeds.clone());
            let out = f(&xs)?;
            tape.finish()?;
            // Only the recomputed graph is needed: the output's memory goes before backward
            // (a rule that needs it, like relu's mask, keeps its own reference).
            if let Some(node) = out.node().cloned() {
                if out.dims() != g.dims() {
                    return Err(Error::Autograd(format!(
                        "checkpoint: the recomputed output has shape {:?}, the gradient {:?}",
                        out.dims(),
                        g.dims()
                    )));
                }
                drop(out);
                backward(&node, g.detach())?;
            }
            let mut grads: Vec<Option<Tensor>> = xs.iter().map(|x| x.grad()).collect();
            grads.truncate(n_inputs);
            grads.extend((0..n_params).map(|_| None));
            Ok(grads)
        })
    }))
}

/// A backward rule: given the gradient of the op's output and which inputs need one, the
/// gradients of the inputs (in input order; `None` where not needed).
pub(crate) type BackwardFn =
    Box<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// One vertex of the graph: a leaf (a tensor the user marked) or an op's output.
pub(crate) struct Node {
    /// The op's name, for errors.
    name: &'static str,
    /// The backward rule; `None` for leaves, and for ops once their backward has run.
    backward: Mutex<Option<BackwardFn>>,
    inputs: Vec<Option<Arc<Node>>>,
    /// Leaves only: the accumulated gradient.
    grad: Mutex<Option<Tensor>>,
    /// Leaves only: the shape a gradient must have.
    leaf_dims: Vec<usize>,
    is_leaf: bool,
}

impl Node {
    pub(crate) fn leaf(dims: &[usize]) -> Arc<Node> {
        Arc::new(Node {
            name: "leaf",
            backward: Mutex::new(None),
            inputs: Vec::new(),
            grad: Mutex::new(None),
            leaf_dims: dims.to_vec(),
            is_leaf: true,
        })
    }

    pub(crate) fn is_leaf(&self) -> bool {
        self.is_leaf
    }

    pub(crate) fn grad(&self) -> Option<Tensor> {
        lock(&self.grad).clone()
    }

    pub(crate) fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        if let Some(g) = &grad {
            self.check_leaf_grad(g)?;
        }
        *lock(&self.grad) = grad.map(|g| g.detach());
        Ok(())
    }

    fn check_leaf_grad(&self, g: &Tensor) -> Result<()> {
        if g.dims() != self.leaf_dims.as_slice() {
            return Err(Error::Autograd(format!(
                "a gradient of shape {:?} for a tensor of shape {:?}",
                g.dims(),
                self.leaf_dims
            )));
        }
        Ok(())
    }

    /// grad += g, in place when a gradient is already held. A new gradient is kept as it is when
    /// nothing else shares its memory (else copied, so a later in-place add cannot change another
    /// tensor).
    fn accumulate(&self, g: Tensor) -> Result<()> {
        self.check_leaf_grad(&g)?;
        let mut slot = lock(&self.grad);
        match slot.as_ref() {
            Some(held) => {
                if held.dtype() != g.dtype() {
                    return Err(Error::DType {
                        op: "backward (gradient accumulation)",
                        expected: held.dtype(),
                        got: g.dtype(),
                    });
                }
                elementwise::binary(BinaryOp::Add, held, &g, held)?;
            }
            None => {
                let d = g.detach();
                drop(g);
                let kept = if d.storage_is_unique() { d } else { d.copy()? };
                kept.device()
                    .retag(&kept, crate::memory::Category::Gradients);
                *slot = Some(kept);
            }
        }
        Ok(())
    }
}

impl Drop for Node {
    /// Unlinks the graph iteratively: dropping a long chain of nodes recursively (a loop of
    /// thousands of recorded ops) would overflow the stack.
    fn drop(&mut self) {
        let mut stack: Vec<Arc<Node>> = self.inputs.drain(..).flatten().collect();
        while let Some(node) = stack.pop() {
            if let Ok(mut inner) = Arc::try_unwrap(node) {
                stack.extend(inner.inputs.drain(..).flatten());
                // The rule owns saved tensors only, never nodes, so it drops shallowly.
            }
        }
    }
}

/// Gives `out` a node recording `backward` when recording is on and an input requires grad.
/// `backward` builds the rule only then, so nothing is saved for inference. Saved tensors must
/// be detached (`t.detach()`): a saved tensor holding its own node would make a cycle.
pub(crate) fn record(
    name: &'static str,
    mut out: Tensor,
    inputs: &[&Tensor],
    backward: impl FnOnce() -> BackwardFn,
) -> Tensor {
    if !is_grad_enabled() || inputs.iter().all(|t| t.node().is_none()) {
        return out;
    }
    out.set_node(Some(Arc::new(Node {
        name,
        backward: Mutex::new(Some(backward())),
        inputs: inputs.iter().map(|t| t.node().cloned()).collect(),
        grad: Mutex::new(None),
        leaf_dims: Vec::new(),
        is_leaf: false,
    })));
    out
}

/// Records an op that has no backward rule yet: `backward()` through it is an
/// [`Error::Autograd`] naming the op, rather than a gradient that silently stops.
pub(crate) fn record_nondiff(name: &'static str, out: Tensor, inputs: &[&Tensor]) -> Tensor {
    record(name, out, inputs, || {
        Box::new(move |_, _| {
            Err(Error::Autograd(format!(
                "{name} has no backward rule; detach() its input or compute it under no_grad()"
            )))
        })
    })
}

/// `Some(f())` when `need`: the gradient of one input, computed only if that input wants it.
pub(crate) fn grad_if(need: bool, f: impl FnOnce() -> Result<Tensor>) -> Result<Option<Tensor>> {
    if need {
        f().map(Some)
    } else {
        Ok(None)
    }
}

/// The non-leaf nodes reachable from `root`, each after every node that consumes it.
fn reverse_topological(root: &Arc<Node>) -> Vec<Arc<Node>> {
    // Iterative post-order DFS (graphs can be deep: a long training loop without no_grad).
    let mut post = Vec::new();
    let mut seen: HashMap<*const Node, ()> = HashMap::new();
    let mut stack: Vec<(Arc<Node>, usize)> = vec![(root.clone(), 0)];
    seen.insert(Arc::as_ptr(root), ());
    while let Some((node, next)) = stack.pop() {
        if next < node.inputs.len() {
            let child = node.inputs[next].clone();
            stack.push((node, next + 1));
            if let Some(c) = child {
                if !c.is_leaf && seen.insert(Arc::as_ptr(&c), ()).is_none() {
                    stack.push((c, 0));
                }
            }
        } else {
            post.push(node);
        }
    }
    post.reverse();
    post
}

/// Runs the backward pass from `root`, whose gradient is `seed`.
pub(crate) fn backward(root: &Arc<Node>, seed: Tensor) -> Result<()> {
    let _guard = no_grad();
    if root.is_leaf {
        return root.accumulate(seed);
    }
    let order = reverse_topological(root);
    let outermost = DEPTH.with(|d| d.replace(d.get() + 1)) == 0;
    let _depth = DepthGuard;
    // With a hook installed, the leaves whose last adding node is each node of `order`.
    let mut done_after: Vec<Vec<usize>> = Vec::new();
    if outermost && LEAF_HOOK.with(|h| h.borrow().is_some()) {
        let mut last: HashMap<usize, usize> = HashMap::new();
        for (k, node) in order.iter().enumerate() {
            for input in node.inputs.iter().flatten().filter(|i| i.is_leaf) {
                last.insert(Arc::as_ptr(input) as usize, k);
            }
        }
        done_after = vec![Vec::new(); order.len()];
        for (leaf, k) in last {
            done_after[k].push(leaf);
        }
        done_after.iter_mut().for_each(|d| d.sort_unstable());
    }
    let fire = |k: usize| -> Result<()> {
        for &leaf in done_after.get(k).map_or(&[][..], Vec::as_slice) {
            LEAF_HOOK.with(|h| match h.borrow_mut().as_mut() {
                Some(hook) => hook(leaf),
                None => Ok(()),
            })?;
        }
        Ok(())
    };
    let mut pending: HashMap<*const Node, Tensor> = HashMap::new();
    pending.insert(Arc::as_ptr(root), seed);
    for (k, node) in order.into_iter().enumerate() {
        let Some(g) = pending.remove(&Arc::as_ptr(&node)) else {
            fire(k)?;
            continue;
        };
        let rule = lock(&node.backward).take().ok_or_else(|| {
            Error::Autograd(format!(
                "the graph through '{}' was already freed by an earlier backward(); \
                 run the forward again",
                node.name
            ))
        })?;
        let needs: Vec<bool> = node.inputs.iter().map(|i| i.is_some()).collect();
        RUNNING.with(|r| r.borrow_mut().push(node.clone()));
        let running = RunningGuard;
        let grads = rule(&g, &needs)?;
        drop(running);
        // The rule and its saved tensors go now, before the next node allocates.
        drop(rule);
        drop(g);
        for (input, grad) in node.inputs.iter().zip(grads) {
            let (Some(input), Some(grad)) = (input, grad) else {
                continue;
            };
            if input.is_leaf {
                input.accumulate(grad)?;
            } else {
                let key = Arc::as_ptr(input);
                let sum = match pending.remove(&key) {
                    Some(prev) => prev.add(&grad)?,
                    None => grad,
                };
                pending.insert(key, sum);
            }
        }
        fire(k)?;
    }
    Ok(())
}

/// `g` summed over the dims that broadcasting stretched, to `dims` (the gradient of a broadcast
/// input).
pub(crate) fn sum_to(g: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if g.dims() == dims {
        return Ok(g.clone());
    }
    let rank = g.rank();
    let pad = rank - dims.len();
    let mut cur = g.clone();
    for axis in 0..rank {
        let want = if axis < pad { 1 } else { dims[axis - pad] };
        if want == 1 && cur.dims()[axis] != 1 {
            cur = cur.sum_axis(axis, true)?;
        }
    }
    cur.reshape(dims)
}

/// `g` broadcast to `dims` (the gradient of a reduction).
pub(crate) fn expand(g: &Tensor, dims: &[usize]) -> Result<Tensor> {
    if g.dims() == dims {
        return Ok(g.clone());
    }
    let out = Tensor::uninit(g.device(), crate::Shape::new(dims)?, g.dtype())?;
    elementwise::binary(BinaryOp::Expand, g, g, &out)?;
    Ok(out)
}
