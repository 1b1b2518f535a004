#!/usr/bin/env python3
"""CPU cross-check of the index math of src/blu/backend/cuda/flash_attention_wgmma.cu (no GPU).

Two checks, written to mirror the kernel (keep them in step when it changes):
  layout: places Q, K and V tiles in a byte image of shared memory the way load_wg_tile does
          (wg_off: 64-column blocks, swz<64>), then fetches every wgmma operand through the
          descriptors the kernel builds (start address + k-step offsets, leading/stride byte
          offsets), using the canonical layouts of the PTX ISA / CUTLASS for 128-byte swizzle
          (K-major: row i at (i%8)*128 + (i/8)*SBO, element k at 2k; N-major: element n at
          2(n%64) + (n/64)*LBO, row k at (k%8)*128 + (k/8)*SBO; then the swizzle XORs address bits
          4-6 with bits 7-9) and compares with the logical sub-matrices. This checks that the
          kernel's layout and descriptors agree with that model, not the model against hardware.
  emu:    runs the consumers of every CTA thread by thread in numpy: the accumulator and A
          fragment layouts of wgmma m64nNk16, masking, the online softmax in the kernel's
          pipelined order (rescale after P·V of the previous tile), the 16-bit P, the epilogue
          (lse, O through the Q tile) and compares O and lse with a float64 reference.
Usage (Debian's python3-numpy): /usr/bin/python3 scripts/lab/flash_attention_wgmma_check.py layout
       /usr/bin/python3 scripts/lab/flash_attention_wgmma_check.py emu T,D,causal ...
       e.g. emu 1,64,1 100,64,1 300,128,0 1000,64,1
"""
import sys
import numpy as np

BQ, BK = 128, 128
LOG2E = 1.4426950408889634


def bf16(x):
    """Round to bfloat16 (nearest even), returned as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32)


def swz64(r, c):  # swz<64>(row, col) of flash_attention.cuh
    return r * 64 + ((((c >> 3) ^ (r & 7)) << 3) | (c & 7))


def wg_off(rows, r, c):  # wg_off<ROWS>(r, c)
    return (c >> 6) * rows * 64 + swz64(r, c & 63)


# --- layout ---------------------------------------------------------------------------------------
def place(img, base, tile):
    rows, d = tile.shape
    for r in range(rows):
        for c in range(d):
            img[(base + 2 * wg_off(rows, r, c)) // 2] = tile[r, c]


def phys(a):  # 128-byte swizzle on byte addresses
    return a ^ (((a >> 7) & 7) << 4)


def fetch_kmajor(img, start, sbo, rows):  # rows x 16 (K) operand
    out = np.zeros((rows, 16), np.float32)
    for i in range(rows):
        for k in range(16):
            a = start + (i % 8) * 128 + (i // 8) * sbo + 2 * k
            out[i, k] = img[phys(a) // 2]
    return out


def fetch_nmajor(img, start, lbo, sbo, n):  # 16 (K) x n operand
    out = np.zeros((16, n), np.float32)
    for k in range(16):
        for j in range(n):
            a = start + 2 * (j % 64) + (j // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
            out[k, j] = img[phys(a) // 2]
    return out


def check_layout():
    rng = np.random.default_rng(0)
    for D in (64, 128):
        # Shared memory as in the kernel: sQ (2 x [64][D]), sK [2][BK][D], sV [2][BK][D].
        q_base = 0
        k_base = q_base + BQ * D * 2
        v_base = k_base + 2 * BK * D * 2
        img = np.full((v_base + 2 * BK * D * 2) // 2, np.nan, np.float32)
        Q = rng.standard_normal((BQ, D)).astype(np.float32)
        K = rng.standard_normal((2, BK, D)).astype(np.float32)
        V = rng.standard_normal((2, BK, D)).astype(np.float32)
        for c in range(2):
            place(img, q_base + c * 64 * D * 2, Q[64 * c:64 * c + 64])
        for s in range(2):
            place(img, k_base + s * BK * D * 2, K[s])
            place(img, v_base + s * BK * D * 2, V[s])
        for base in (q_base, k_base, v_base):
            assert base % 1024 == 0
        bad = 0
        stage_bytes = BK * D * 2
        for c in range(2):
            dq = q_base + c * 64 * D * 2
            for s in range(2):
                for kk in range(D // 16):
                    a = fetch_kmajor(img, dq + (kk // 4) * 64 * 128 + (kk % 4) * 32, 1024, 64)
                    b = fetch_kmajor(img, k_base + s * stage_bytes + (kk // 4) * BK * 128 + (kk % 4) * 32, 1024, BK)
                    bad += not np.array_equal(a, Q[64 * c:64 * c + 64, 16 * kk:16 * kk + 16])
                    bad += not np.array_equal(b, K[s][:, 16 * kk:16 * kk + 16])
        for s in range(2):
            for kk in range(BK // 16):
                b = fetch_nmajor(img, v_base + s * stage_bytes + kk * 2048, BK * 128, 1024, D)
                bad += not np.array_equal(b, V[s][16 * kk:16 * kk + 16, :])
        print(f"layout D={D}: {'ok' if bad == 0 else f'{bad} operand fetches differ'}")
        if bad:
            sys.exit(1)


# --- emu ------------------------------------------------------------------------------------------
def frag_pos(n):
    """(row, col) in a 64 x n accumulator of register i in thread tid: arrays [128, n/2]."""
    tid = np.arange(128)[:, None]
    i = np.arange(n // 2)[None, :]
    warp, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    row = 16 * warp + g + 8 * ((i % 4) >> 1)
    col = 8 * (i // 4) + 2 * t + (i % 2)
    return row, col


def emu_case(T, D, causal):
    rng = np.random.default_rng(T * 1000 + D + causal)
    q, k, v = (bf16(rng.standard_normal((T, D))) for _ in range(3))
    scale = 1.0 / np.sqrt(D)
    sl2 = np.float32(scale * LOG2E)
    O = np.full((T, D), np.nan, np.float32)
    lse = np.full(T, np.nan, np.float32)
    srow, scol = frag_pos(BK)
    orow, ocol = frag_pos(D)
    tid = np.arange(128)
    g, t = (tid % 32) // 4, tid % 4
    num_qt = (T + BQ - 1) // BQ
    pad = lambda x, rows: np.vstack([x, np.zeros((rows, D), np.float32)])
    qp, kp, vp = pad(q, BQ + BK), pad(k, BQ + BK), pad(v, BQ + BK)  # zero-filled rows >= T
    for qt in range(num_qt):
        q0 = qt * BQ
        kv_end = min(T, q0 + BQ) if causal else T
        num_kt = (kv_end + BK - 1) // BK
        for c in range(2):
            r_wg = q0 + 64 * c
            row_lo = r_wg + 16 * (tid // 32) + g
            Qw = qp[r_wg:r_wg + 64]
            o = np.zeros((128, D // 2), np.float32)
            m = np.full((128, 2), -np.inf, np.float32)
            l = np.zeros((128, 2), np.float32)
            P = None
            for n in range(num_kt + 1):
                if n < num_kt:  # S of tile n (the kernel issues it before P·V of tile n-1)
                    k0 = n * BK
                    S_full = (Qw.astype(np.float64) @ kp[k0:k0 + BK].astype(np.float64).T).astype(np.float32)
                    s = S_full[srow, scol]
                if P is not None:  # O += P·V of tile n-1: P from the A fragments
                    Vt = vp[(n - 1) * BK:(n - 1) * BK + BK]
                    o += (P.astype(np.float64) @ Vt.astype(np.float64)).astype(np.float32)[orow, ocol]
                if n == num_kt:
                    break
                # mask
                if k0 + BK > T or (causal and k0 + BK - 1 > r_wg):
                    key = k0 + scol
                    row = row_lo[:, None] + 8 * ((np.arange(BK // 2)[None, :] % 4) >> 1)
                    s = np.where((key >= T) | (causal & (key > row)), -np.inf, s)
                alpha = np.zeros((128, 2), np.float32)
                rs = np.zeros((128, 2), np.float32)
                for r in range(2):
                    cols = [4 * j + 2 * r + e for j in range(BK // 8) for e in range(2)]
                    mx = np.maximum(m[:, r], s[:, cols].max(axis=1))
                    mx = mx.reshape(32, 4).max(axis=1).repeat(4)  # quad reduction (xor 1, 2)
                    msub = np.where(mx == -np.inf, 0, mx * sl2).astype(np.float32)
                    with np.errstate(invalid="ignore"):
                        alpha[:, r] = np.exp2(m[:, r] * sl2 - msub)
                    m[:, r] = mx
                    s[:, cols] = np.exp2(s[:, cols] * sl2 - msub[:, None])
                    rs[:, r] = s[:, cols].sum(axis=1)
                if n == 0:
                    l = rs.copy()
                else:  # after P·V of tile n-1
                    l = l * alpha + rs
                    o *= alpha[:, (np.arange(D // 2) % 4) >> 1]
                # P (16-bit) from s through the A fragment layout: pf[kk][0..3] per thread.
                P = np.zeros((64, BK), np.float32)
                warp = tid // 32
                for kk in range(BK // 16):
                    for reg in range(4):
                        for h in range(2):
                            i = 8 * kk + 2 * reg + h
                            rr = 16 * warp + g + 8 * (reg & 1)
                            cc = 16 * kk + 2 * t + 8 * (reg >> 1) + h
                            P[rr, cc] = bf16(s[:, i])
            # epilogue
            lq = l.reshape(32, 4, 2).sum(axis=1).repeat(4, axis=0)
            inv = np.where(lq > 0, 1 / lq, 0)
            for r in range(2):
                rows = row_lo + 8 * r
                ok = (t == 0) & (rows < T)
                lse[rows[ok]] = np.where(lq[ok, r] > 0, m[ok, r] * scale + np.log(lq[ok, r]), -np.inf)
            out = np.zeros((64, D), np.float32)
            out[orow, ocol] = bf16(o * inv[:, (np.arange(D // 2) % 4) >> 1])
            nrows = max(0, min(64, T - r_wg))
            O[r_wg:r_wg + nrows] = out[:nrows]
    # reference
    S = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
    if causal:
        S = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, S)
    mx = S.max(axis=1, keepdims=True)
    E = np.exp(S - mx)
    ref = (E / E.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    ref_lse = mx[:, 0] + np.log(E.sum(axis=1))
    err_o = np.abs(O - ref).max()
    err_l = np.abs(lse - ref_lse).max()
    ok = err_o <= 2e-2 and err_l <= 1e-4 and not np.isnan(O).any()
    print(f"emu T={T} D={D} causal={causal}: max|O err| {err_o:.3g}, max|lse err| {err_l:.3g} {'ok' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("layout", "emu"):
        sys.exit(__doc__)
    if sys.argv[1] == "layout":
        check_layout()
    else:
        cases = sys.argv[2:] or ["1,64,1", "100,64,1", "300,128,0", "1000,64,1"]
        fails = sum(not emu_case(*map(int, c.split(","))) for c in cases)
        sys.exit(1 if fails else 0)
