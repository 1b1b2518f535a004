#!/usr/bin/env python3
"""CPU cross-check of the index math of src/blu/backend/cuda/flash_attention_wgmma_backward.cu (no GPU).

Uses the layout model of flash_attention_wgmma_check.py (the forward's check: canonical 128-byte
swizzle layouts of the PTX ISA / CUTLASS, fetched through descriptor start address + leading/stride
byte offsets). Two checks, written to mirror the kernel (keep them in step when it changes):
  layout: places K, V (two [64][D] halves), Q, dO (two stages) and dSᵀ (two buffers, written by
          the consumers' fragment stores) in a byte image of shared memory, then fetches every
          wgmma operand through the descriptors the kernel builds and compares with the logical
          sub-matrices: Sᵀ/dPᵀ (K-major A and B), dV/dK (N-major B), dQ (M-major A = dSᵀ, N-major
          B = K columns c·D/2..). The M-major A is fetched with the N-major model (the same
          canonical layout with M in place of N).
  emu:    runs both consumers of every CTA thread by thread in numpy: accumulator and A-fragment
          layouts of wgmma m64nNk16, the query-tile walk (causal: from the diagonal), masking only
          in the tiles the kernel masks (Note [wgmma backward math]: none for queries past T),
          lse and Dsum pre-scaled as the producer does, 16-bit Pᵀ and dSᵀ, dV, dK, dQ (dSᵀ
          through the shared buffer, each consumer's D/2 columns, added per tile into the
          fragment-ordered dQ tiles of Note [dQ tiles], which a model of the convert kernel puts
          back in row order) and the dK, dV epilogue rows; compares with float64. With G > 1, grouped-
          query attention: one key/value head, G query heads walked one after the other (tile i of
          a CTA is tile i % n_per of head i // n_per, masked by that head-local index), dQ tiles per
          query head, dK, dV summed over the heads. Also checks the stmatrix addresses of the dSᵀ
          stores against the swizzled layout.
Usage: /usr/bin/python3 scripts/lab/flash_attention_wgmma_bwd_check.py layout
       /usr/bin/python3 scripts/lab/flash_attention_wgmma_bwd_check.py emu T,D,causal[,G] ...
       e.g. emu 1,64,1 100,64,1 300,128,0 200,64,0 200,64,1,3 (G: query heads per key/value head)
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flash_attention_wgmma_check import bf16, fetch_kmajor, fetch_nmajor, frag_pos, place, swz64  # noqa: E402

BK, BQ = 128, 64
LOG2E = 1.4426950408889634


def koff(kk):  # k step of a K-major [64][D] tile
    return (kk // 4) * 64 * 128 + (kk % 4) * 32


def store_dst(img, base, c, dst):
    """The consumer-c fragment stores of dSᵀ (64 keys x 64 queries, float) into a [128][64] buffer."""
    tid = np.arange(128)
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    for kk in range(BQ // 16):
        for reg in range(4):
            r = 64 * c + 16 * warp + g + 8 * (reg & 1)  # dsf[kk][reg]: rows r, r+8, r, r+8
            qc = 16 * kk + 2 * t + 8 * (reg >> 1)
            for h in range(2):
                img[(base + 2 * swz64(r, qc + h)) // 2] = dst[r - 64 * c, qc + h]


def check_layout():
    rng = np.random.default_rng(0)
    for D in (64, 128):
        kb = 0
        v_b = kb + BK * D * 2
        q_b = v_b + BK * D * 2
        do_b = q_b + 2 * BQ * D * 2
        ds_b = do_b + 2 * BQ * D * 2
        end = ds_b + 2 * BK * BQ * 2
        tile, half, dsb = BQ * D * 2, 64 * D * 2, BK * BQ * 2
        for base in (v_b, q_b, do_b, ds_b):
            assert base % 1024 == 0
        img = np.full(end // 2, np.nan, np.float32)
        K, V = (rng.standard_normal((BK, D)).astype(np.float32) for _ in range(2))
        Q, dO = (rng.standard_normal((2, BQ, D)).astype(np.float32) for _ in range(2))
        dST = rng.standard_normal((2, BK, BQ)).astype(np.float32)  # [buffer][key][query]
        for c in range(2):
            place(img, kb + c * half, K[64 * c:64 * c + 64])
            place(img, v_b + c * half, V[64 * c:64 * c + 64])
        for s in range(2):
            place(img, q_b + s * tile, Q[s])
            place(img, do_b + s * tile, dO[s])
            for c in range(2):
                store_dst(img, ds_b + s * dsb, c, dST[s, 64 * c:64 * c + 64])
        bad = 0
        for c in range(2):
            for s in range(2):
                for kk in range(D // 16):  # Sᵀ = K_c·Qᵀ, dPᵀ = V_c·dOᵀ
                    cols = slice(16 * kk, 16 * kk + 16)
                    bad += not np.array_equal(fetch_kmajor(img, kb + c * half + koff(kk), 1024, 64), K[64 * c:64 * c + 64, cols])
                    bad += not np.array_equal(fetch_kmajor(img, v_b + c * half + koff(kk), 1024, 64), V[64 * c:64 * c + 64, cols])
                    bad += not np.array_equal(fetch_kmajor(img, q_b + s * tile + koff(kk), 1024, 64), Q[s][:, cols])
                    bad += not np.array_equal(fetch_kmajor(img, do_b + s * tile + koff(kk), 1024, 64), dO[s][:, cols])
                for kk in range(BQ // 16):  # dV += Pᵀ·dO, dK += dSᵀ·Q: B N-major
                    rows = slice(16 * kk, 16 * kk + 16)
                    bad += not np.array_equal(fetch_nmajor(img, do_b + s * tile + kk * 2048, 64 * 128, 1024, D), dO[s][rows])
                    bad += not np.array_equal(fetch_nmajor(img, q_b + s * tile + kk * 2048, 64 * 128, 1024, D), Q[s][rows])
                kcol = 64 * c if D == 64 else 8192 * c
                for kk in range(BK // 16):  # dQ = dS·K: A M-major (dSᵀ), B N-major (K columns c·D/2..)
                    a = fetch_nmajor(img, ds_b + s * dsb + kk * 2048, 64 * 128, 1024, 64)  # [k=key][m=query]
                    bad += not np.array_equal(a, dST[s, 16 * kk:16 * kk + 16])
                    b = fetch_nmajor(img, kb + kcol + (kk // 4) * half + (kk % 4) * 2048, 64 * 128, 1024, D // 2)
                    bad += not np.array_equal(b, K[16 * kk:16 * kk + 16, c * D // 2:(c + 1) * D // 2])
        print(f"layout D={D}: {'ok' if bad == 0 else f'{bad} operand fetches differ'}")
        if bad:
            sys.exit(1)


def a_frag_matrix(x):
    """The 64x64 16-bit A operand a warpgroup feeds from accumulator registers x [128, 32] (to_frag)."""
    tid = np.arange(128)
    warp, g, t = tid // 32, (tid % 32) // 4, tid % 4
    M = np.full((64, BQ), np.nan, np.float32)
    for kk in range(BQ // 16):
        for reg in range(4):
            for h in range(2):
                i = 8 * kk + 2 * reg + h
                M[16 * warp + g + 8 * (reg & 1), 16 * kk + 2 * t + 8 * (reg >> 1) + h] = bf16(x[:, i])
    return M


def emu_case(T, D, causal, G=1):
    """One key/value head and its G query heads (G = 1: no GQA), as the kernel walks them: tile i of
    a CTA is tile l = i % n_per of query head j = i // n_per (Note [GQA backward])."""
    rng = np.random.default_rng(T * 1000 + D + causal + 7919 * (G - 1))
    k, v = (bf16(rng.standard_normal((T, D))) for _ in range(2))
    qs, dos = ([bf16(rng.standard_normal((T, D))) for _ in range(G)] for _ in range(2))
    scale = 1.0 / np.sqrt(D)
    sl2 = np.float32(scale * LOG2E)
    # Reference forward per query head (float64), the saved lse (fp32) and O rounded to 16 bits,
    # Dsum from it; dK, dV summed over the heads.
    ref = {"dq": [], "dk": 0, "dv": 0}
    lses, dsums = [], []
    for q, do in zip(qs, dos):
        S = (q.astype(np.float64) @ k.astype(np.float64).T) * scale
        if causal:
            S = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, S)
        mx = S.max(axis=1, keepdims=True)
        E = np.exp(S - mx)
        Pref = E / E.sum(axis=1, keepdims=True)
        O = bf16(Pref @ v)
        lses.append((mx[:, 0] + np.log(E.sum(axis=1))).astype(np.float32))
        dsums.append((do.astype(np.float64) * O).sum(axis=1).astype(np.float32))
        dP = do.astype(np.float64) @ v.astype(np.float64).T
        dS = Pref * (dP - dsums[-1][:, None]) * scale
        ref["dq"].append(dS @ k)
        ref["dk"] = ref["dk"] + dS.T @ q
        ref["dv"] = ref["dv"] + Pref.T @ do

    pad = lambda x, rows: np.concatenate([x, np.zeros((rows,) + x.shape[1:], x.dtype)])
    kp, vp = pad(k, BK + BQ), pad(v, BK + BQ)
    qps, dops = [pad(x, BK + BQ) for x in qs], [pad(x, BK + BQ) for x in dos]
    # The producer's in-place scaling of lse and Dsum (zero-filled past T).
    lse2s = [(pad(x, BK + BQ) * np.float32(LOG2E)).astype(np.float32) for x in lses]
    dsum_ss = [(pad(x, BK + BQ) * np.float32(scale)).astype(np.float32) for x in dsums]
    got = {n: np.full((T, D), np.nan, np.float32) for n in ("dk", "dv")}
    num_tiles = (T + BQ - 1) // BQ
    dq_tiles = np.zeros((G, num_tiles * BQ * D), np.float32)  # Note [dQ tiles]: per query head, padded
    srow, scol = frag_pos(BQ)  # Sᵀ, dPᵀ: rows keys, columns queries
    orow, ocol = frag_pos(D)  # dK, dV
    qrow_f, qcol_f = frag_pos(D // 2)  # dQ
    num_qt = (T + BQ - 1) // BQ
    for kb in range((T + BK - 1) // BK):
        k0 = kb * BK
        qt_begin = k0 // BQ if causal else 0
        n_per = num_qt - qt_begin
        acc = {c: {"dk": np.zeros((128, D // 2), np.float32), "dv": np.zeros((128, D // 2), np.float32)} for c in (0, 1)}
        for i in range(G * n_per):
            j, l = divmod(i, n_per)
            qp, dop, lse2, dsum_s = qps[j], dops[j], lse2s[j], dsum_ss[j]
            q0 = (qt_begin + l) * BQ
            Qt, dOt = qp[q0:q0 + BQ], dop[q0:q0 + BQ]
            sdS = np.full((BK, BQ), np.nan, np.float32)
            for c in (0, 1):
                kw0 = k0 + 64 * c
                s = (kp[kw0:kw0 + 64].astype(np.float64) @ Qt.astype(np.float64).T).astype(np.float32)[srow, scol]
                dp = (vp[kw0:kw0 + 64].astype(np.float64) @ dOt.astype(np.float64).T).astype(np.float32)[srow, scol]
                key = kw0 + srow
                qq = q0 + scol
                with np.errstate(over="ignore"):
                    pv = np.exp2(s * sl2 - lse2[qq])
                n_masked = n_per if kw0 + 64 > T else min(c + 1, n_per) if causal else 0
                if l < n_masked:  # the kernel's masked tiles (by the head-local index)
                    pv = np.where((key >= T) | (causal & (key > qq)), 0, pv)
                Pm = a_frag_matrix(pv)
                acc[c]["dv"] += (Pm.astype(np.float64) @ dOt.astype(np.float64)).astype(np.float32)[orow, ocol]
                ds = pv * (dp * np.float32(scale) - dsum_s[qq])
                dSm = a_frag_matrix(ds)
                acc[c]["dk"] += (dSm.astype(np.float64) @ Qt.astype(np.float64)).astype(np.float32)[orow, ocol]
                sdS[64 * c:64 * c + 64] = dSm  # the fragment stores write exactly the A operand's values
            assert not np.isnan(sdS).any()
            Kfull = kp[k0:k0 + BK]
            for c in (0, 1):
                cols = slice(c * D // 2, (c + 1) * D // 2)
                dq = (sdS.T.astype(np.float64) @ Kfull[:, cols].astype(np.float64)).astype(np.float32)[qrow_f, qcol_f]
                # Thread tid's registers 4j..4j+3 → float4 number j·128 + tid of consumer c's half.
                tid = np.arange(128)[:, None]
                reg = np.arange(D // 4)[None, :]
                idx = q0 * D + c * 32 * D + ((reg // 4) * 128 + tid) * 4 + reg % 4
                assert not np.isnan(dq).any(), "dQ of a tile (rows past T included) must be finite"
                np.add.at(dq_tiles[j], idx, dq)
        for c in (0, 1):
            kw0 = k0 + 64 * c
            for n in ("dk", "dv"):
                out = np.zeros((64, D), np.float32)
                out[orow, ocol] = bf16(acc[c][n])
                nrows = max(0, min(64, T - kw0))
                got[n][kw0:kw0 + nrows] = out[:nrows]
    # flash_bwd_dq_tiles_convert_kernel: float4 f of a tile → rows r, r+8, columns col, col+1.
    got["dq"] = []
    for j in range(G):
        dq_rows = np.full((num_tiles * BQ, D), np.nan, np.float32)
        for qt in range(num_tiles):
            tile = dq_tiles[j, qt * BQ * D:(qt + 1) * BQ * D].reshape(-1, 4)
            for f in range(BQ * D // 4):
                c, jj, tid = f // (8 * D), f % (8 * D) // 128, f % 128
                r = 16 * (tid // 32) + (tid % 32) // 4
                col = c * (D // 2) + 8 * jj + 2 * (tid % 4)
                rr = qt * BQ + r
                dq_rows[rr, col:col + 2] = tile[f, 0:2]
                dq_rows[rr + 8, col:col + 2] = tile[f, 2:4]
        got["dq"].append(bf16(dq_rows[:T]))
    got["dq"], ref["dq"] = np.stack(got["dq"]), np.stack(ref["dq"])
    ok = True
    msg = []
    for n in ("dq", "dk", "dv"):
        err = np.abs(got[n] - ref[n])
        tol = 4e-2 * np.sqrt(G if n != "dq" else 1) + 4e-2 * np.abs(ref[n])  # dK, dV: G heads' terms
        good = not np.isnan(got[n]).any() and (err <= tol).all()
        ok &= good
        msg.append(f"max|{n} err| {np.nanmax(err):.3g}")
    print(f"emu T={T} D={D} causal={causal} G={G}: {', '.join(msg)} {'ok' if ok else 'FAIL'}")
    return ok


def check_stmatrix():
    """The dSᵀ stmatrix addresses (D = 64): lane l gives row 64c + 16w + l%8 + 8(l/8 % 2), chunk
    2kk + l/16 of it, at (base + ((l/16) ^ (l%8))·16) ^ 32kk in buffer b — must be swz64's place."""
    ok = True
    for c in range(2):
        for w in range(4):
            for lane in range(32):
                a0 = (64 * c + 16 * w + lane % 8 + 8 * (lane // 8 % 2)) * 128 + (((lane // 16) ^ (lane % 8)) << 4)
                for b in range(2):
                    for kk in range(4):
                        m, rr = lane // 8, lane % 8
                        row, col = 64 * c + 16 * w + rr + 8 * (m & 1), 16 * kk + 8 * (m >> 1)
                        ok &= ((a0 + b * BK * BQ * 2) ^ (32 * kk)) == b * BK * BQ * 2 + 2 * swz64(row, col)
    print(f"stmatrix addresses of the dSᵀ stores: {'ok' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("layout", "emu"):
        sys.exit(__doc__)
    if sys.argv[1] == "layout":
        check_layout()
        sys.exit(0 if check_stmatrix() else 1)
    else:
        cases = sys.argv[2:] or ["1,64,1", "100,64,1", "300,128,0", "200,64,0", "129,128,1", "200,64,1,3", "130,128,0,2"]
        fails = sum(not emu_case(*map(int, c.split(","))) for c in cases)
        sys.exit(1 if fails else 0)
