//! Composing modules: [`Sequential`] (a list of boxed modules applied in order), `Vec<M>` of
//! one module type as a module, and the [`module!`](crate::module) macro that writes a custom
//! model's `named_parameters`, `named_buffers` and `set_training` from a list of its fields.

use super::Module;
use crate::{Result, Tensor};

/// Modules applied one after another: `Sequential::new().push(a).push(b)` is `b(a(x))`.
/// Parameters are named by position (`0.weight`, `1.bias`, ...), as torch's `nn.Sequential`.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module + Send + Sync>>,
}

impl Sequential {
    /// An empty sequence (the identity).
    pub fn new() -> Sequential {
        Sequential::default()
    }

    /// Appends a module.
    pub fn push(mut self, m: impl Module + Send + Sync + 'static) -> Sequential {
        self.layers.push(Box::new(m));
        self
    }

    /// Modules in the sequence.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the sequence holds no module.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

/// Parameters (or, with `buffers`, buffers) of `children`, each prefixed with its index.
fn indexed<'a>(
    children: impl Iterator<Item = &'a dyn Module>,
    buffers: bool,
) -> Vec<(String, Tensor)> {
    children
        .enumerate()
        .flat_map(|(i, m)| {
            let named = if buffers {
                m.named_buffers()
            } else {
                m.named_parameters()
            };
            named.into_iter().map(move |(n, t)| (format!("{i}.{n}"), t))
        })
        .collect()
}

impl Module for Sequential {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.layers.iter().try_fold(x.clone(), |h, m| m.forward(&h))
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        indexed(self.layers.iter().map(|m| m.as_ref() as &dyn Module), false)
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        indexed(self.layers.iter().map(|m| m.as_ref() as &dyn Module), true)
    }

    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        let children = self.layers.iter().enumerate();
        children
            .flat_map(|(i, m)| super::prefixed_units(&i.to_string(), m.as_ref()))
            .collect()
    }

    fn set_training(&self, training: bool) {
        for m in &self.layers {
            m.set_training(training);
        }
    }
}

/// A list of modules of one type is a module too: applied in order, parameters named by
/// position (a stack of transformer or residual blocks).
impl<M: Module> Module for Vec<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.iter().try_fold(x.clone(), |h, m| m.forward(&h))
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        indexed(self.iter().map(|m| m as &dyn Module), false)
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        indexed(self.iter().map(|m| m as &dyn Module), true)
    }

    fn units(&self) -> Vec<(String, Vec<Tensor>)> {
        let children = self.iter().enumerate();
        children
            .flat_map(|(i, m)| super::prefixed_units(&i.to_string(), m as &dyn Module))
            .collect()
    }

    fn set_training(&self, training: bool) {
        for m in self {
            m.set_training(training);
        }
    }
}

/// Implements [`Module`](crate::nn::Module) for a struct from the list of its fields that are
/// modules: parameters are named `field.child_name` in the listed order, and `set_training`
/// reaches every listed field. The body holds `forward` (and any other `Module` method to
/// override).
///
/// ```
/// use fitgrad::nn::{Linear, Module};
/// use fitgrad::{Result, Tensor};
///
/// struct Block { fc1: Linear, fc2: Linear }
///
/// fitgrad::module! {
///     impl Module for Block {
///         params { fc1, fc2 }
///         // x (B, C) -> x + fc2(tanh(fc1(x))), (B, C)
///         fn forward(&self, x: &Tensor) -> Result<Tensor> {
///             x.add(&self.fc2.forward(&self.fc1.forward(x)?.tanh()?)?)
///         }
///     }
/// }
/// ```
#[macro_export]
macro_rules! module {
    (impl Module for $ty:ty { params { $($field:ident),* $(,)? } $($body:tt)* }) => {
        impl $crate::nn::Module for $ty {
            $($body)*

            fn named_parameters(&self) -> ::std::vec::Vec<(::std::string::String, $crate::Tensor)> {
                let mut out = ::std::vec::Vec::new();
                $(
                    for (n, t) in $crate::nn::Module::named_parameters(&self.$field) {
                        out.push((::std::format!("{}.{}", ::std::stringify!($field), n), t));
                    }
                )*
                out
            }

            fn named_buffers(&self) -> ::std::vec::Vec<(::std::string::String, $crate::Tensor)> {
                let mut out = ::std::vec::Vec::new();
                $(
                    for (n, t) in $crate::nn::Module::named_buffers(&self.$field) {
                        out.push((::std::format!("{}.{}", ::std::stringify!($field), n), t));
                    }
                )*
                out
            }

            fn units(&self) -> ::std::vec::Vec<(::std::string::String, ::std::vec::Vec<$crate::Tensor>)> {
                let mut out = ::std::vec::Vec::new();
                $(
                    out.extend($crate::nn::prefixed_units(::std::stringify!($field), &self.$field));
                )*
                out
            }

            fn set_training(&self, training: bool) {
                $( $crate::nn::Module::set_training(&self.$field, training); )*
            }
        }
    };
}
