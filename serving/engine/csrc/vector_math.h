/* Float vectors of the CPU's own width and an exp over them, shared by the engine's C files (GCC and
 * Clang vector extensions): 16 lanes with AVX-512, 8 with AVX, 4 otherwise. A vector wider than the
 * CPU's registers is legal C, but GCC then moves its halves through the stack and general registers:
 * the attention kernel's 16-lane vectors ran ~3x slower on an AVX2 machine than 8-lane ones
 * (docs/architecture.md, "The kernels' vectors are the CPU's width"). */

#ifndef SWITCHYARD_VECTOR_MATH_H
#define SWITCHYARD_VECTOR_MATH_H

#include <stdint.h>

#if defined(__AVX512F__)
#define SY_LANES 16
#elif defined(__AVX__)
#define SY_LANES 8
#else
#define SY_LANES 4
#endif

typedef float vf __attribute__((vector_size(SY_LANES * 4)));
typedef float vfu __attribute__((vector_size(SY_LANES * 4), aligned(4)));  /* loads at any float's address */
typedef int32_t vi __attribute__((vector_size(SY_LANES * 4)));

static inline vf vload(const float *p) { return *(const vfu *)p; }
static inline void vstore(float *p, vf x) { *(vfu *)p = x; }
static inline vf vsplat(float x) { return (vf){0} + x; }
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* 0, 1, ..., SY_LANES - 1: which lanes of a vector of keys are visible */
static inline vf vlane_index(void) {
    static const float index[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return vload(index);
}

static inline float vhmax(vf x) {
    float m = x[0];
    for (int i = 1; i < SY_LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float vhsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < SY_LANES; i++) s += x[i];
    return s;
}

/* exp(x) in every lane, x clamped to [-87, 88] (exp(-87) ~ 1.6e-38): 2^n * p(r), x = n ln2 + r,
 * |r| <= ln2 / 2, p a degree-6 Taylor polynomial; n rounded by adding 1.5 * 2^23, whose float then
 * holds n in its low bits. Relative error < 2e-7. libm's expf is a call per element; this is a few
 * vector instructions. */
static inline vf vexp(vf x) {
    const float magic = 12582912.0f;
    x = vselect(x < vsplat(-87.0f), vsplat(-87.0f), x);
    x = vselect(x > vsplat(88.0f), vsplat(88.0f), x);
    const vf shifted = x * 1.44269504088896341f + magic;
    const vf n = shifted - magic;
    const vf r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    vf p = vsplat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vi exponent = (((vi)shifted - (vi)vsplat(magic)) + 127) << 23;
    return p * (vf)exponent;
}

static inline float exp1(float x) { return vexp(vsplat(x))[0]; }

#endif
