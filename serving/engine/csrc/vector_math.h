/* 16-float vectors and an exp over them, shared by the engine's C files (GCC and Clang vector
 * extensions: one AVX-512 register, or a few narrower ones where the CPU has no AVX-512). */

#ifndef SWITCHYARD_VECTOR_MATH_H
#define SWITCHYARD_VECTOR_MATH_H

#include <stdint.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  /* for loads at any float's address */
typedef int32_t i16v __attribute__((vector_size(64)));
#define SY_LANES 16

static inline v16 load16(const float *p) { return *(const v16u *)p; }
static inline void store16(float *p, v16 x) { *(v16u *)p = x; }
static inline v16 splat(float x) { return (v16){0} + x; }
static inline v16 select16(i16v mask, v16 a, v16 b) { return (v16)(((i16v)a & mask) | ((i16v)b & ~mask)); }

static inline float hmax16(v16 x) {
    float m = x[0];
    for (int i = 1; i < SY_LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float hsum16(v16 x) {
    float s = 0.0f;
    for (int i = 0; i < SY_LANES; i++) s += x[i];
    return s;
}

/* exp(x), x clamped to [-87, 88] (exp(-87) ~ 1.6e-38): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a
 * degree-6 Taylor polynomial; n rounded by adding 1.5 * 2^23, whose float then holds n in its low bits.
 * Relative error < 2e-7. libm's expf is a call per element; this is a few vector instructions. */
static inline v16 exp16(v16 x) {
    const float magic = 12582912.0f;
    x = select16(x < splat(-87.0f), splat(-87.0f), x);
    x = select16(x > splat(88.0f), splat(88.0f), x);
    const v16 shifted = x * 1.44269504088896341f + magic;
    const v16 n = shifted - magic;
    const v16 r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    v16 p = splat(1.0f / 720.0f);
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const i16v exponent = (((i16v)shifted - (i16v)splat(magic)) + 127) << 23;
    return p * (v16)exponent;
}

static inline float exp1(float x) { return exp16(splat(x))[0]; }

#endif
