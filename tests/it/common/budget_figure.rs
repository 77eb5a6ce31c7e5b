//! The smallest-budget figure of a `BudgetTooSmall` message passed back as a user would: the
//! rounded figure and the exact bytes both run, one byte less is refused again. Included by
//! the example tests with `#[path]`.

use fitgrad::Error;

/// The two figures of a `BudgetTooSmall` message: "needs at least 2.07 MiB (2162688 bytes)".
fn printed_minimum(msg: &str) -> (String, String) {
    let rest = msg
        .split("needs at least ")
        .nth(1)
        .unwrap_or_else(|| panic!("no figure in: {msg}"));
    let (rounded, rest) = rest.split_once(" (").expect("the exact bytes follow");
    let exact = rest.split_once(" bytes)").expect("in bytes").0;
    (rounded.to_string(), exact.to_string())
}

/// `run(budget)` refuses `too_small` with the figure; the figure as printed (rounded, then
/// exact) runs; one byte less is refused.
pub fn figure_passed_back_works(run: impl Fn(&str) -> fitgrad::Result<()>, too_small: &str) {
    let err = run(too_small).expect_err("the budget is too small");
    let Error::BudgetTooSmall { minimum, .. } = &err else {
        panic!("expected BudgetTooSmall, got {err}");
    };
    let (rounded, exact) = printed_minimum(&err.to_string());
    assert_eq!(exact, minimum.to_string());
    for b in [&rounded, &exact] {
        run(b).unwrap_or_else(|e| panic!("--memory-budget '{b}' (printed by: {err}): {e}"));
    }
    let less = (minimum - 1).to_string();
    let again = run(&less).expect_err("one byte less than the minimum");
    assert!(
        matches!(again, Error::BudgetTooSmall { .. }),
        "--memory-budget {less}: {again}"
    );
}
