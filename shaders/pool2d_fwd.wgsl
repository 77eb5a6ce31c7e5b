// 2-D pooling, forward: out (planes, oh, ow) = the max or the average of each output's window of
// x (planes, h, w); windows and modes in include/pool2d_window.wgsl. Averages add in row order
// in f32. Two outputs per invocation through include/pairs.wgsl.

fn value(i: u32) -> f32 {
    let po = p.oh * p.ow;
    let plane = i / po;
    let r = i % po;
    let win = window(r / p.ow, r % p.ow);
    let base = plane * p.h * p.w;
    if (p.mode == 0u) {
        return ld_x(argmax(base, win));
    }
    var s = 0.0;
    for (var y = win.y0; y < win.y1; y++) {
        for (var x = win.x0; x < win.x1; x++) {
            s += ld_x(base + y * p.w + x);
        }
    }
    return s / win.div;
}
