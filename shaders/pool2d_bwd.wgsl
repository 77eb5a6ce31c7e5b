// 2-D pooling, backward: out = dx (planes, h, w) gathers dy (planes, oh, ow) from every window
// holding each input (include/pool2d_window.wgsl). A max window passes its gradient to its first
// largest input, found again from x here, so the forward keeps no indices; an average passes
// dy / divisor to each input. Windows add in (oy, ox) order: no atomics, bitwise repeatable.
// Two outputs per invocation through include/pairs.wgsl.

// The first window (along one axis) that may hold input coordinate i, and one past the last.
fn candidates(i: u32, k: u32, s: u32, pd: u32, size: u32, out: u32) -> vec2<u32> {
    if (p.mode == 2u) {
        return vec2<u32>((i * out) / size, min(((i + 1u) * out + size - 1u) / size, out));
    }
    // Windows o with o s - pd <= i < o s - pd + k.
    let t = i + pd;
    var lo = 0u;
    if (t >= k) {
        lo = (t - k) / s + 1u;
    }
    return vec2<u32>(lo, min(t / s + 1u, out));
}

fn value(i: u32) -> f32 {
    let hw = p.h * p.w;
    let plane = i / hw;
    let r = i % hw;
    let iy = r / p.w;
    let ix = r % p.w;
    let ry = candidates(iy, p.kh, p.sh, p.ph, p.h, p.oh);
    let rx = candidates(ix, p.kw, p.sw, p.pw, p.w, p.ow);
    let base = plane * hw;
    let obase = plane * p.oh * p.ow;
    var s = 0.0;
    for (var oy = ry.x; oy < ry.y; oy++) {
        for (var ox = rx.x; ox < rx.y; ox++) {
            let win = window(oy, ox);
            if (iy < win.y0 || iy >= win.y1 || ix < win.x0 || ix >= win.x1) {
                continue;
            }
            let g = ld_dy(obase + oy * p.ow + ox);
            if (p.mode == 0u) {
                if (argmax(base, win) == base + r) {
                    s += g;
                }
            } else {
                s += g / win.div;
            }
        }
    }
    return s;
}
