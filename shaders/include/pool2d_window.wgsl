// Shared by pool2d_fwd.wgsl and pool2d_bwd.wgsl (prepended at build time): the parameters at
// binding 0 and the input window of each output. Tensors are (planes, h, w) contiguous, planes
// = N C; the output is (planes, oh, ow).
//
// Modes: 0 max and 1 average over fixed windows (kernel kh x kw, stride, zero padding; an
// average divides by kh kw when `include_pad`, as torch's count_include_pad, else by the
// window's inputs), 2 the adaptive average: output oy covers inputs
// floor(oy h / oh) .. ceil((oy + 1) h / oh), and so for x.

struct Params {
    n: u32,      // elements of the kernel's output (pairs.wgsl)
    mode: u32,
    h: u32,
    w: u32,
    oh: u32,
    ow: u32,
    kh: u32,
    kw: u32,
    sh: u32,
    sw: u32,
    ph: u32,
    pw: u32,
    include_pad: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}
@group(0) @binding(0) var<uniform> p: Params;

const WG: u32 = 256u;

// Output (oy, ox)'s inputs: rows y0 .. y1 and columns x0 .. x1 (clipped to the input), and the
// average's divisor.
struct Window {
    y0: u32,
    y1: u32,
    x0: u32,
    x1: u32,
    div: f32,
}

fn window(oy: u32, ox: u32) -> Window {
    if (p.mode == 2u) {
        let y0 = (oy * p.h) / p.oh;
        let y1 = ((oy + 1u) * p.h + p.oh - 1u) / p.oh;
        let x0 = (ox * p.w) / p.ow;
        let x1 = ((ox + 1u) * p.w + p.ow - 1u) / p.ow;
        return Window(y0, y1, x0, x1, f32((y1 - y0) * (x1 - x0)));
    }
    let ys = i32(oy * p.sh) - i32(p.ph);
    let xs = i32(ox * p.sw) - i32(p.pw);
    let y0 = u32(max(ys, 0));
    let x0 = u32(max(xs, 0));
    let y1 = u32(clamp(ys + i32(p.kh), 0, i32(p.h)));
    let x1 = u32(clamp(xs + i32(p.kw), 0, i32(p.w)));
    var div = f32(p.kh * p.kw);
    if (p.include_pad == 0u) {
        div = f32((y1 - y0) * (x1 - x0));
    }
    return Window(y0, y1, x0, x1, div);
}

// The offset in its plane of a max window's first largest input, scanning rows then columns.
fn argmax(base: u32, win: Window) -> u32 {
    var best = base + win.y0 * p.w + win.x0;
    var m = ld_x(best);
    for (var y = win.y0; y < win.y1; y++) {
        for (var x = win.x0; x < win.x1; x++) {
            let e = base + y * p.w + x;
            let v = ld_x(e);
            if (v > m) {
                m = v;
                best = e;
            }
        }
    }
    return best;
}
