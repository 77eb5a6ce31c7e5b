//! Learning-rate schedules: the learning rate of each step from the base rate.
//!
//! ```no_run
//! use fitgrad::optim::{LrSchedule, Optimizer, Sgd};
//! # fn f(params: Vec<fitgrad::Tensor>) -> fitgrad::Result<()> {
//! let sched = LrSchedule::WarmupCosine { warmup_steps: 100, total_steps: 10_000, min_lr_ratio: 0.1 };
//! let mut opt = Sgd::new(params, 0.1)?.momentum(0.9)?;
//! for step in 0..10_000 {
//!     opt.set_lr(sched.lr_at(0.1, step));
//!     // forward, backward ...
//!     opt.step()?;
//! }
//! # Ok(()) }
//! ```

use crate::{Error, Result};

/// How the learning rate moves over training. Steps count from 0 (the first `step()`). More
/// schedules may be added, so a `match` outside the crate needs a `_` arm.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub enum LrSchedule {
    /// The base rate at every step.
    Constant,
    /// Linear warm-up from 0 to the base rate over `warmup_steps` (step s gets base *
    /// s / warmup_steps), then a half cosine from the base rate at `warmup_steps` down to
    /// base * `min_lr_ratio` at `total_steps`, then flat at that floor.
    WarmupCosine {
        /// Steps of the linear warm-up (0: none).
        warmup_steps: u64,
        /// The step where the cosine reaches its floor (>= `warmup_steps`).
        total_steps: u64,
        /// The floor as a fraction of the base rate, in [0, 1].
        min_lr_ratio: f32,
    },
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based) for base rate `base_lr`.
    pub fn lr_at(&self, base_lr: f32, step: u64) -> f32 {
        match *self {
            LrSchedule::Constant => base_lr,
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_lr_ratio,
            } => {
                let base = base_lr as f64;
                if step < warmup_steps {
                    return (base * step as f64 / warmup_steps as f64) as f32;
                }
                let floor = base * min_lr_ratio as f64;
                if step >= total_steps {
                    return floor as f32;
                }
                // warmup_steps <= step < total_steps, so the span is at least 1.
                let progress = (step - warmup_steps) as f64 / (total_steps - warmup_steps) as f64;
                // libm, not the platform's cos: the same rates, bit for bit, on every OS.
                let cos = 0.5 * (1.0 + libm::cos(std::f64::consts::PI * progress));
                (floor + (base - floor) * cos) as f32
            }
        }
    }

    /// Checks the schedule: `min_lr_ratio` in [0, 1] and `warmup_steps <= total_steps`.
    pub fn validate(&self) -> Result<()> {
        if let LrSchedule::WarmupCosine {
            warmup_steps,
            total_steps,
            min_lr_ratio,
        } = *self
        {
            let op = "LrSchedule::WarmupCosine";
            if !(0.0..=1.0).contains(&min_lr_ratio) {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!("min_lr_ratio = {min_lr_ratio} must be in [0, 1]"),
                });
            }
            if warmup_steps > total_steps {
                return Err(Error::InvalidArgument {
                    op,
                    reason: format!(
                        "warmup_steps = {warmup_steps} passes total_steps = {total_steps}"
                    ),
                });
            }
        }
        Ok(())
    }
}

impl std::fmt::Display for LrSchedule {
    /// `constant`, or `warmup-cosine(warmup, total, min_lr_ratio)`: what checkpoints store.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LrSchedule::Constant => f.write_str("constant"),
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_lr_ratio,
            } => write!(
                f,
                "warmup-cosine({warmup_steps}, {total_steps}, {min_lr_ratio})"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-6 * b.abs().max(1e-6)
    }

    #[test]
    fn constant_is_the_base_rate() {
        for s in [0, 1, 1000, u64::MAX] {
            assert_eq!(LrSchedule::Constant.lr_at(0.25, s), 0.25);
        }
    }

    #[test]
    fn warmup_is_linear_from_zero() {
        let s = LrSchedule::WarmupCosine {
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
        };
        assert_eq!(s.lr_at(1.0, 0), 0.0);
        assert!(close(s.lr_at(1.0, 1), 0.1));
        assert!(close(s.lr_at(2.0, 5), 1.0));
        assert!(close(s.lr_at(1.0, 9), 0.9));
        // The peak at the end of the warm-up.
        assert!(close(s.lr_at(1.0, 10), 1.0));
    }

    #[test]
    fn cosine_decays_to_the_floor_then_stays() {
        let s = LrSchedule::WarmupCosine {
            warmup_steps: 10,
            total_steps: 110,
            min_lr_ratio: 0.1,
        };
        // Half-way through the decay: the mean of peak and floor.
        assert!(close(s.lr_at(1.0, 60), 0.55));
        // A quarter: floor + (1 - floor) * (1 + cos(pi / 4)) / 2.
        let q = 0.1 + 0.9 * 0.5 * (1.0 + std::f64::consts::FRAC_PI_4.cos());
        assert!(close(s.lr_at(1.0, 35), q as f32));
        for step in [110, 111, 1_000_000] {
            assert!(close(s.lr_at(1.0, step), 0.1));
        }
        // Monotone down from the peak.
        let mut last = f32::INFINITY;
        for step in 10..=120 {
            let lr = s.lr_at(1.0, step);
            assert!(lr <= last, "step {step}: {lr} > {last}");
            last = lr;
        }
        assert_eq!(s.validate().ok(), Some(()));
    }

    #[test]
    fn degenerate_schedules() {
        // No warm-up: starts at the peak.
        let s = LrSchedule::WarmupCosine {
            warmup_steps: 0,
            total_steps: 4,
            min_lr_ratio: 0.0,
        };
        assert_eq!(s.lr_at(1.0, 0), 1.0);
        assert!(close(s.lr_at(1.0, 2), 0.5));
        assert_eq!(s.lr_at(1.0, 4), 0.0);
        // Warm-up as long as training: the floor right after.
        let s = LrSchedule::WarmupCosine {
            warmup_steps: 4,
            total_steps: 4,
            min_lr_ratio: 0.5,
        };
        assert!(close(s.lr_at(1.0, 2), 0.5));
        assert_eq!(s.lr_at(1.0, 4), 0.5);
        assert_eq!(s.validate().ok(), Some(()));
    }

    #[test]
    fn bad_schedules_are_rejected() {
        for (w, t, r) in [(10, 5, 0.1), (0, 10, -0.1), (0, 10, 1.5), (0, 10, f32::NAN)] {
            let s = LrSchedule::WarmupCosine {
                warmup_steps: w,
                total_steps: t,
                min_lr_ratio: r,
            };
            assert!(
                matches!(s.validate(), Err(Error::InvalidArgument { .. })),
                "{s:?}"
            );
        }
        assert!(LrSchedule::Constant.validate().is_ok());
    }
}
