// The fewest invocations that share one row (softmax and cross-entropy, mode 0) or one output
// (max and argmax, mode 0). Its only copy: the Rust dispatch reads the value from this file.
const MIN_LANES: u32 = 16u;
