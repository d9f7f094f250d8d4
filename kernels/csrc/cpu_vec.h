/* Generic 16-float vectors (GCC/clang vector extensions) shared by cpu_gemm.c and
 * cpu_fused.c: the exponential and SiLU(gate) * up, computed the same way on every code path
 * (the lanes' IEEE results do not depend on how wide the machine's registers are). Include
 * only in files compiled without floating-point contraction. */
#ifndef SHOAL_CPU_VEC_H
#define SHOAL_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* 64-byte vectors in always-inlined helpers of functions built for several ISAs. */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

ALWAYS_INLINE v16f splat16(float x) {
    v16f v;
    for (int i = 0; i < 16; ++i) {
        v[i] = x;
    }
    return v;
}

ALWAYS_INLINE v16f select16(v16i mask, v16f yes, v16f no) {
    return (v16f)(((v16i)yes & mask) | ((v16i)no & ~mask));
}

/* e^x, about 1 ulp (Cephes' expf): 0 below -87.3, +inf above 88.7. */
ALWAYS_INLINE v16f exp16(v16f x) {
    const v16i underflow = x < splat16(-87.33654f);
    const v16i overflow = x > splat16(88.72283f);
    x = select16(underflow, splat16(-87.0f), select16(overflow, splat16(88.0f), x));
    const v16f magic = splat16(12582912.0f);
    const v16f shifted = x * splat16(1.44269504088896341f) + magic;
    const v16f n = shifted - magic;
    const v16i exponent = (v16i)shifted - (v16i)magic;
    v16f r = x - n * splat16(0.693359375f);
    r = r - n * splat16(-2.12194440e-4f);
    v16f p = splat16(1.9875691500e-4f);
    p = p * r + splat16(1.3981999507e-3f);
    p = p * r + splat16(8.3334519073e-3f);
    p = p * r + splat16(4.1665795894e-2f);
    p = p * r + splat16(1.6666665459e-1f);
    p = p * r + splat16(5.0000001201e-1f);
    p = p * (r * r) + r + splat16(1.0f);
    const v16f result = p * (v16f)((exponent + 127) << 23);
    const v16f infinity = (v16f)(((v16i){0} == (v16i){0}) & 0x7F800000);
    return select16(overflow, infinity, (v16f)((v16i)result & ~underflow));
}

/* silu(g) * u = g / (1 + e^-g) * u, 16 at a time. */
ALWAYS_INLINE v16f silu_mul16(v16f gate, v16f up) { return gate / (splat16(1.0f) + exp16(-gate)) * up; }

ALWAYS_INLINE v16f load16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}


#endif
