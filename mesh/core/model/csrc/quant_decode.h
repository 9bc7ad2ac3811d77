/* How a group of quant_blocks.h's layout decodes: its quant bytes and scales, and one k's 64 weights as the float32
 * the `gguf` package gives them (quant_linear.c's loops put these into sums or an L1 buffer). Each kind's weight is
 * one rounding of exact products (quant_blocks.h), so these are the dequantized checkpoint's weights bit for bit.
 */
#ifndef WAVEMESH_QUANT_DECODE_H
#define WAVEMESH_QUANT_DECODE_H

#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "register_tile.h"

#define QINLINE INLINE

/* IQ4_NL's 16 values (an IQ4F nibble's weight before its scale; the gguf package's kvalues) */
static const float IQ4_VALUES[16] __attribute__((aligned(64))) = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                                   1,    13,   25,  38,  53,  69,  89,  113};

#if defined(__AVX512F__)
typedef __m512i qivec;
QINLINE qivec load_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
QINLINE qivec load_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
QINLINE qivec ilow(qivec v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
QINLINE qivec ihigh(qivec v) { return _mm512_srli_epi32(v, 4); }
QINLINE qivec iminus8(qivec v) { return _mm512_sub_epi32(v, _mm512_set1_epi32(8)); }
QINLINE vec tofloat(qivec v) { return _mm512_cvtepi32_ps(v); }
QINLINE vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
QINLINE vec iq4_values(qivec v) { return _mm512_permutexvar_ps(v, _mm512_load_ps(IQ4_VALUES)); }  /* at nibbles v */
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256i qivec;
QINLINE qivec load_u8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE qivec load_i8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
QINLINE qivec ilow(qivec v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
QINLINE qivec ihigh(qivec v) { return _mm256_srli_epi32(v, 4); }
QINLINE qivec iminus8(qivec v) { return _mm256_sub_epi32(v, _mm256_set1_epi32(8)); }
QINLINE vec tofloat(qivec v) { return _mm256_cvtepi32_ps(v); }
QINLINE vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
QINLINE vec iq4_values(qivec v) {  /* at nibbles v: two 8-entry lookups (the low 3 bits), chosen by bit 3 */
    vec lo = _mm256_permutevar8x32_ps(_mm256_load_ps(IQ4_VALUES), v);
    vec hi = _mm256_permutevar8x32_ps(_mm256_load_ps(IQ4_VALUES + 8), v);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}
#endif

/* The quant bytes of a group (after its scales and minimums). */
QINLINE const uint8_t *group_quants(const uint8_t *grp, const int qtype) {
    return grp + group_scale_bytes(qtype);
}

#if !defined(__F16C__)
/* IEEE binary16 -> float32, exactly: group_scales' path where no float16 conversion instruction exists. */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* zero or subnormal: man * 2^-24, exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* A group's 64 float16 scales (and, for Q4_1, 64 minimums) widened to float32 into d (and m): exact, the values
 * the gguf package gives. (Q2_KF's: its first sub-block's; the second's are read in place, second_scales.) */
QINLINE void group_scales(const uint8_t *grp, const int qtype, float *d, float *m) {
    if (float_scales(qtype)) {  /* the K kinds: already float32 (scales, then minimums or second scales) */
        memcpy(d, grp, QTILE_N * sizeof(float));
        if (qtype != IQ4F) memcpy(m, grp + QTILE_N * sizeof(float), QTILE_N * sizeof(float));  /* IQ4F: none */
        return;
    }
    const uint16_t *h = (const uint16_t *)grp;
    for (int sc = 0; sc < (qtype == Q4_1 ? 2 : 1); sc++) {
        float *out = sc ? m : d;
#if defined(__F16C__)
        for (int j = 0; j < QTILE_N; j += 8)
            _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + sc * QTILE_N + j))));
#else
        for (int j = 0; j < QTILE_N; j++) out[j] = half_to_float(h[sc * QTILE_N + j]);
#endif
    }
}

/* Q2_KF: the float32 scales of a group's second sub-block of 16 (its negated minimums follow, QTILE_N on). */
QINLINE const float *second_scales(const uint8_t *grp) {
    return (const float *)(grp + QTILE_N * 2 * sizeof(float));
}

/* LANES rows' weights at one k of a group: q the k's quant bytes (offset to these rows; for Q4_0 / Q4_1 the byte row
 * k mod 16, its high nibbles when `high`), their scales d and minimums m (float32): the float32 the gguf package
 * gives each. */
QINLINE vec dequantize_at(const uint8_t *q, const int qtype, const int high, vec d, vec m) {
    if (qtype == Q5_KF) return vfma(tofloat(load_u8(q)), d, m);  /* q * D exact, as Q4_1's */
    if (byte_quants(qtype)) return vmul(tofloat(load_i8(q)), d);
    qivec v = high ? ihigh(load_u8(q)) : ilow(load_u8(q));
    if (qtype == Q4_0) return vmul(tofloat(iminus8(v)), d);
    if (qtype == IQ4F) return vmul(iq4_values(v), d);  /* value * D exact */
    return vfma(tofloat(v), d, m);  /* q * d exact: one rounding gives the gguf package's two (top of file) */
}

/* The 64 rows' weights of one k of a group (its quants qs, its widened scales d and minimums m), dequantized into
 * w[64] (qtype a constant where inlined). */
QINLINE void decode_k(const uint8_t *qs, const int qtype, int k, const float *d, const float *m, float *w) {
    const uint8_t *q = qs + (int64_t)(byte_quants(qtype) ? k : k & 15) * QTILE_N;  /* Q4: byte row k mod 16 */
    const int high = !byte_quants(qtype) && k >= 16;
    const float *scale = qtype == Q6_KF && k >= 16 ? m : d, *minimum = m;  /* Q6_KF: the second sub-block's scales */
    if (qtype == Q2_KF && k >= 16) {  /* Q2_KF: its second sub-block's scales and minimums, in place */
        scale = second_scales(qs - group_scale_bytes(qtype));  /* the group starts its scales' bytes before qs */
        minimum = scale + QTILE_N;
    }
    for (int j = 0; j < QTILE_N; j += LANES)
        vstore(w + j, dequantize_at(q + j, qtype, high, vload(scale + j), with_minimum(qtype) ? vload(minimum + j)
                                                                                              : vload(scale + j)));
}

#endif
