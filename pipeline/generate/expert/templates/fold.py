"""F.fold / nn.Fold (col2im, families/fold.py): the sliding blocks of (N, C * kh * kw, L) summed back into
(N, C, H, W), fp32, fp16 and bf16.

One thread an output pixel, consecutive threads along W: each finds the blocks that cover it (those whose
position, by the stride, and tap, by the dilation, land on it) and adds their values in fp32, the blocks
along W outer and along H inner, as eager's col2im kernel orders its sum, then stores once. No atomics and
no zeroed output: a pixel no block covers is written 0. The sizes are constants of the kernel, the index
arithmetic 32-bit where the output has fewer than 2^31 elements (a second kernel).
"""

from __future__ import annotations

from pipeline.generate.expert.regions import Region
from pipeline.generate.expert.templates.code import Code, ctype, launch_bounds, torch_dtype
from pipeline.generate.expert.templates.signature import Signature, i64, ptr

_BODY = r"""namespace kp_{rid} {{
constexpr int C = {c}, H = {h}, W = {w}, KH = {kh}, KW = {kw}, SH = {sh}, SW = {sw}, PH = {ph}, PW = {pw};
constexpr int DH = {dh}, DW = {dw}, LH = {lh}, LW = {lw};
template <typename I>
__device__ __forceinline__ void fold(const {t}* __restrict__ x, {t}* __restrict__ out, I total) {{
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (I)gridDim.x * blockDim.x) {{
        const I px = i % W, t1 = i / W, py = t1 % H, t2 = t1 / H, c = t2 % C, n = t2 / C;
        const int y = (int)py + PH, xx = (int)px + PW;  // in padded coordinates
        // blocks whose window can reach this pixel: start * stride <= y <= start * stride + (KH - 1) * DH
        const int h0 = y < (KH - 1) * DH + 1 ? 0 : (y - (KH - 1) * DH - 1) / SH + 1, h1 = min(y / SH + 1, LH);
        const int w0 = xx < (KW - 1) * DW + 1 ? 0 : (xx - (KW - 1) * DW - 1) / SW + 1, w1 = min(xx / SW + 1, LW);
        const {t}* xn = x + (long long)n * C * KH * KW * LH * LW;
        float acc = 0.0f;
        for (int bw = w0; bw < w1; ++bw) {{
            const int kx = xx - bw * SW;
            if (kx % DW) continue;
            for (int bh = h0; bh < h1; ++bh) {{
                const int ky = y - bh * SH;
                if (ky % DH) continue;
                const long long row = ((long long)c * KH + ky / DH) * KW + kx / DW;
                acc += ld(xn[(row * LH + bh) * LW + bw]);
            }}
        }}
        out[i] = cv<{t}>(acc);
    }}
}}
}}  // namespace kp_{rid}
extern "C" __global__ void {bounds} kp_{rid}_fold(const {t}* __restrict__ x, {t}* __restrict__ out, long long total) {{
    kp_{rid}::fold<unsigned long long>(x, out, (unsigned long long)total);
}}
extern "C" __global__ void {bounds} kp_{rid}_fold32(const {t}* __restrict__ x, {t}* __restrict__ out, long long total) {{
    kp_{rid}::fold<unsigned int>(x, out, (unsigned int)total);
}}
"""


def render(r: Region, dtype: str, c: int, out_hw: tuple[int, int], kernel: tuple[int, int],
           dilation: tuple[int, int], padding: tuple[int, int], stride: tuple[int, int], threads: int) -> Code:  # fmt: skip
    """The fold kernel for a (N, C * kh * kw, L) input, or a (C * kh * kw, L) one (no batch dim)."""
    rid, t = r.rid, ctype(dtype)
    (h, w), (kh, kw), (dh, dw), (ph, pw), (sh, sw) = out_hw, kernel, dilation, padding, stride
    lh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    lw = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cuda = _BODY.format(rid=rid, t=t, c=c, h=h, w=w, kh=kh, kw=kw, sh=sh, sw=sw, ph=ph, pw=pw, dh=dh, dw=dw,
                        lh=lh, lw=lw, bounds=launch_bounds(threads, 0))  # fmt: skip
    sig = Signature((ptr("x", t, "xc"), ptr("out", t, const=False), i64("total")))
    x = r.node.args[0]
    rows = c * kh * kw
    launcher = "\n".join([
        f"def _fold_{rid}(sms, x):",
        f'    """{kh} x {kw} blocks ({lh} x {lw} of them) summed into {c} planes of {h} x {w}, a thread a pixel."""',
        "    xc = _contig(x if x.dim() == 3 else x.unsqueeze(0))",
        f"    if xc.shape[1:] != ({rows}, {lh * lw}):",
        f"        raise ValueError(f'kernelpro expert: (N, {rows}, {lh * lw}) blocks expected, not {{tuple(x.shape)}}')",
        f"    out = torch.empty((xc.shape[0], {c}, {h}, {w}), dtype={torch_dtype(dtype)}, device=x.device)",
        "    total = out.numel()",
        "    if total:",
        f"        blocks = max(1, min(-(-total // {threads}), sms * {max(1, 2048 // threads)} * 4))",
        "        if total < 2**31:",
        f"            kernels.kp_{rid}_fold32((blocks,), ({threads},), ({sig.args()}))  # noqa: F821",
        "        else:",
        f"            kernels.kp_{rid}_fold((blocks,), ({threads},), ({sig.args()}))  # noqa: F821",
        "    return out if x.dim() == 3 else out.squeeze(0)",
    ])  # fmt: skip
    return Code(cuda, launcher, f"_fold_{rid}", (f"kp_{rid}_fold", f"kp_{rid}_fold32"), (x.name,), r.outputs)


__all__ = ["render"]
