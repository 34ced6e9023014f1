/*
 * The per-position metrics of harness/measure/metrics.py in two fused passes over a row pair.
 *
 * Compiled once per machine by harness/measure/rowkernel.py (the system C compiler, cached by
 * this file's sha256, the compiler and the CPU) and called through ctypes; without a compiler the
 * harness computes the same quantities with numpy (metrics.py, the numpy path), and
 * tests/test_rowkernel.py checks the two against each other and against float64.
 *
 * Row pair r (reference), c (candidate), float32, length v, in sub-blocks of 256 entries. Per row:
 *   pass 1: |r|^2, |c|^2, |r - c|^2, z = sum exp(r - shift), sed = sum exp(r - shift) (r - c),
 *           min and max of r - c, the maximum of each sub-block of both rows (for the top-k
 *           bound), and e = exp(r - shift) stored; shift = 0 while max r lies in [-20, 40], else
 *           max r (the pass is repeated with that shift: rare).
 *   pass 2: t = sum e_i g(m - d_i), g(x) = expm1(x) - x, m = sed / z, d = r - c; then
 *           KL(softmax r || softmax c) = log1p(t / z) (metrics._kld_row derives the form).
 *   top-k of r and c: the k-th largest sub-block maximum bounds the row's k-th largest entry;
 *           only sub-blocks reaching it are scanned; order: value descending, token id ascending
 *           (np.argmax's tie rule).
 * Sums: pass 1: each of 16 vector lanes adds 4 terms in float32, then that partial into a float64
 *       lane sum; pass 2: 256 non-negative terms in float32, then float64.
 * exp: float32, Cody-Waite reduction and a degree-6 polynomial (about 1 ulp); 0 below -87.3.
 * g: its Taylor series to x^8 while |x| < 0.5 (relative error < 1e-7: no cancellation near 0),
 *    else exp(x) - 1 - x.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define SUB 256
#define KMAX 64
#define GROUP 64

enum { S_RR, S_CC, S_DD, S_LOGZ, S_M, S_T, S_DMIN, S_DMAX, S_FLAG, S_RMAX, N_STATS };
/* S_FLAG: 0 = every field computed; 1 = |r|^2 or |c|^2 outside (1e-30, 1e30) or not finite (the
 * caller's float64 path; nothing else filled); 2 = max(m - d) > 30 (the KLD's float64 path; the
 * rest filled, S_T not). */

int harness_rowkernel_abi(void) { return 3; }

static inline float exp_f32(float x) {
    const float log2e = 1.44269504088896341f, ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float xc = x < -87.33654f ? -87.33654f : (x > 88.72283f ? 88.72283f : x);
    float n = __builtin_rintf(xc * log2e);
    float f = xc - n * ln2_hi;
    f = f - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x < -87.33654f ? 0.0f : p * scale;
}

static inline float g_series(float x) {
    float s = 2.48015873e-5f;
    s = s * x + 1.98412698e-4f;
    s = s * x + 1.38888889e-3f;
    s = s * x + 8.33333333e-3f;
    s = s * x + 4.16666667e-2f;
    s = s * x + 1.66666667e-1f;
    s = s * x + 0.5f;
    return s * x * x;
}

static inline float g_any(float x) {
    float near = g_series(x);
    float far = (exp_f32(x) - 1.0f) - x;
    return fabsf(x) < 0.5f ? near : far;
}

/* 16-lane vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 or four NEON/SSE
 * registers; the compiler splits them), their float64 widening, and 32-bit lane masks. */
typedef float vf __attribute__((vector_size(64)));
typedef double vd __attribute__((vector_size(128)));
typedef int32_t vi __attribute__((vector_size(64)));

static inline vf vload(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline vf vsel(vi m, vf a, vf b) { return (vf)(((vi)a & m) | ((vi)b & ~m)); } /* m ? a : b */

static inline vf vbroadcast(float x) { return (vf){0} + x; }

/* exp_f32 on 16 lanes, the same reduction and polynomial; round to nearest by the 1.5 * 2^23 shift. */
static inline vf exp_v(vf x) {
    const vf lo = vbroadcast(-87.33654f), hi = vbroadcast(88.72283f), magic = vbroadcast(12582912.0f);
    vi under = x < lo;
    vf xc = vsel(under, lo, vsel(x > hi, hi, x));
    vf n = (xc * 1.44269504088896341f + magic) - magic;
    vf f = xc - n * 0.693359375f;
    f = f - n * -2.12194440e-4f;
    vf p = f * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * f + 8.3334519073e-3f;
    p = p * f + 4.1665795894e-2f;
    p = p * f + 1.6666665459e-1f;
    p = p * f + 5.0000001201e-1f;
    p = p * f * f + f + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(p * (vf)bits) & ~under);
}

/* Pass 1 over a row pair: acc = (|r|^2, |c|^2, |r - c|^2, z, sed); bmr/bmc: the maxima of r and c
 * over each sub-block of SUB entries (ceil(v / SUB) each); e = exp(r - shift) written. Sixteen
 * lanes each sum GROUP / 16 = 4 consecutive-in-lane terms in float32 (at most 3 roundings, and a
 * large term can swallow at most 3 small ones), then add that partial into a float64 lane
 * accumulator; the last entries (fewer than 16) go through lane 0 in float64. */
static void pass1(const float *restrict r, const float *restrict c, float *restrict e, int64_t v, float shift,
                  float *restrict bmr, float *restrict bmc, double acc[5], float *dmin, float *dmax) {
    vd rr = {0}, cc = {0}, dd = {0}, z = {0}, sed = {0};
    vf mn = vbroadcast(INFINITY), mx = vbroadcast(-INFINITY);
    const vf sh = vbroadcast(shift);
    int64_t vfull = v / 16 * 16;
    for (int64_t s = 0, b = 0; s < v; s += SUB, b++) {
        int64_t hi = s + SUB < vfull ? s + SUB : vfull;
        vf rm = vbroadcast(-INFINITY), cm = vbroadcast(-INFINITY);
        for (int64_t g = s; g < hi; g += GROUP) {
            int64_t ghi = g + GROUP < hi ? g + GROUP : hi;
            vf rr32 = {0}, cc32 = {0}, dd32 = {0}, z32 = {0}, sed32 = {0};
            for (int64_t i = g; i < ghi; i += 16) {
                vf ri = vload(r + i), ci = vload(c + i), d = ri - ci;
                vf ei = exp_v(ri - sh);
                memcpy(e + i, &ei, sizeof ei);
                rr32 += ri * ri;
                cc32 += ci * ci;
                dd32 += d * d;
                z32 += ei;
                sed32 += ei * d;
                mn = vsel(d < mn, d, mn);
                mx = vsel(d > mx, d, mx);
                rm = vsel(ri > rm, ri, rm);
                cm = vsel(ci > cm, ci, cm);
            }
            rr += __builtin_convertvector(rr32, vd);
            cc += __builtin_convertvector(cc32, vd);
            dd += __builtin_convertvector(dd32, vd);
            z += __builtin_convertvector(z32, vd);
            sed += __builtin_convertvector(sed32, vd);
        }
        float brm = -INFINITY, bcm = -INFINITY;
        for (int j = 0; j < 16; j++) {
            brm = rm[j] > brm ? rm[j] : brm;
            bcm = cm[j] > bcm ? cm[j] : bcm;
        }
        if (s + SUB >= v) /* the last sub-block: its entries past vfull */
            for (int64_t i = vfull; i < v; i++) {
                float ri = r[i], ci = c[i], d = ri - ci, ei = exp_f32(ri - shift);
                e[i] = ei;
                rr[0] += (double)ri * ri;
                cc[0] += (double)ci * ci;
                dd[0] += (double)d * d;
                z[0] += ei;
                sed[0] += (double)ei * d;
                mn[0] = d < mn[0] ? d : mn[0];
                mx[0] = d > mx[0] ? d : mx[0];
                brm = ri > brm ? ri : brm;
                bcm = ci > bcm ? ci : bcm;
            }
        bmr[b] = brm;
        bmc[b] = bcm;
    }
    double a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0;
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < 16; j++) {
        a0 += rr[j]; a1 += cc[j]; a2 += dd[j]; a3 += z[j]; a4 += sed[j];
        lo = mn[j] < lo ? mn[j] : lo;
        hi = mx[j] > hi ? mx[j] : hi;
    }
    acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3; acc[4] = a4;
    *dmin = lo;
    *dmax = hi;
}

static double pass2(const float *restrict r, const float *restrict c, const float *restrict e, int64_t v, float m,
                    int series_only) {
    double t = 0.0;
    for (int64_t s = 0; s < v; s += SUB) {
        int64_t hi = s + SUB < v ? s + SUB : v;
        float ft = 0;
        if (series_only) {
#pragma omp simd reduction(+ : ft)
            for (int64_t i = s; i < hi; i++) ft += e[i] * g_series(m - (r[i] - c[i]));
        } else {
#pragma omp simd reduction(+ : ft)
            for (int64_t i = s; i < hi; i++) ft += e[i] * g_any(m - (r[i] - c[i]));
        }
        t += ft;
    }
    return t;
}

/* (value desc, id asc) insertion into a sorted top list of size n <= k. */
static inline int before(float va, int64_t ia, float vb, int64_t ib) { return va > vb || (va == vb && ia < ib); }

static inline void insert(float *tv, int64_t *ti, int *n, int k, float val, int64_t id) {
    if (*n == k && !before(val, id, tv[k - 1], ti[k - 1])) return;
    int j = *n < k ? (*n)++ : k - 1;
    while (j > 0 && before(val, id, tv[j - 1], ti[j - 1])) {
        tv[j] = tv[j - 1];
        ti[j] = ti[j - 1];
        j--;
    }
    tv[j] = val;
    ti[j] = id;
}

/* Top k of row x (finite), given its sub-block maxima bm: the k-th largest sub-block maximum is a
 * lower bound on the row's k-th largest entry (k distinct entries reach it), so only sub-blocks
 * whose maximum reaches it are scanned. */
static void topk(const float *x, const float *bm, int64_t v, int k, int64_t *ids, float *vals) {
    int64_t nb = (v + SUB - 1) / SUB;
    float bv[KMAX];
    int64_t bi[KMAX];
    int nbv = 0;
    for (int64_t j = 0; j < nb; j++) insert(bv, bi, &nbv, k, bm[j], j);
    float bound = nbv == k ? bv[k - 1] : -INFINITY; /* fewer sub-blocks than k: every entry is a candidate */
    int n = 0;
    for (int64_t j = 0; j < nb; j++) {
        if (bm[j] < bound) continue;
        int64_t hi = (j + 1) * SUB < v ? (j + 1) * SUB : v;
        for (int64_t i = j * SUB; i < hi; i++)
            if (x[i] >= bound) insert(vals, ids, &n, k, x[i], i);
    }
}

/*
 * Every row of a block: ref, cand [n, v] row-major float32; e [v] and bm [2 ceil(v / 256)] scratch;
 * stats [n, N_STATS] float64; ids [n, 2, k] int64 and vals [n, 2, k] float32 (reference's top k,
 * then the candidate's), filled where S_FLAG != 1. Requires 1 <= k <= min(KMAX, v). Returns 0, or
 * -1 on arguments outside those bounds.
 */
int harness_rows(const float *ref, const float *cand, int64_t n, int64_t v, int k, float *e, float *bm,
                 double *stats, int64_t *ids, float *vals) {
    int64_t nb = (v + SUB - 1) / SUB;
    if (k < 1 || k > KMAX || k > v) return -1;
    float *bmr = bm, *bmc = bm + nb;
    for (int64_t row = 0; row < n; row++) {
        const float *r = ref + row * v, *c = cand + row * v;
        double *st = stats + row * N_STATS;
        double acc[5];
        float dmin, dmax;
        pass1(r, c, e, v, 0.0f, bmr, bmc, acc, &dmin, &dmax);
        st[S_RR] = acc[0];
        st[S_CC] = acc[1];
        st[S_DD] = acc[2];
        if (!(acc[0] > 1e-30 && acc[0] < 1e30 && acc[1] > 1e-30 && acc[1] < 1e30)) {
            st[S_FLAG] = 1;
            continue;
        }
        int64_t *ri = ids + row * 2 * k, *ci = ri + k;
        float *rv = vals + row * 2 * k, *cv = rv + k;
        topk(r, bmr, v, k, ri, rv);
        topk(c, bmc, v, k, ci, cv);
        float rmax = rv[0];
        float shift = 0.0f;
        if (!(rmax >= -20.0f && rmax <= 40.0f)) {
            shift = rmax;
            pass1(r, c, e, v, shift, bmr, bmc, acc, &dmin, &dmax);
        }
        double z = acc[3], m = acc[4] / z;
        st[S_LOGZ] = (double)shift + log(z);
        st[S_M] = m;
        st[S_DMIN] = dmin;
        st[S_DMAX] = dmax;
        st[S_RMAX] = rmax;
        if (m - (double)dmin > 30.0) {
            st[S_FLAG] = 2;
            continue;
        }
        int series_only = fabs(m - (double)dmin) < 0.5 && fabs(m - (double)dmax) < 0.5;
        st[S_T] = pass2(r, c, e, v, (float)m, series_only) / z;
        st[S_FLAG] = 0;
    }
    return 0;
}
