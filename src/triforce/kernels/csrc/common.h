/* Definitions shared by the portable builds of the csrc/ C files (no ISA flags: a CPU without AVX2, or aarch64).
 *
 * MADD(a, b, c) = a * b + c: one rounding (fmaf) where the target fuses it in hardware (__FP_FAST_FMAF: aarch64),
 * else a multiply and an add, two roundings (x86-64 without FMA, where fmaf is a libm call per element). The portable
 * builds are compiled with -ffp-contract=off, so the compiler never fuses the second form on its own: one build rounds
 * one way everywhere, and a row's chain of MADDs is the same whatever the rows beside it. */
#ifndef TRIFORCE_COMMON_H
#define TRIFORCE_COMMON_H

#include <math.h>

#if defined(__FP_FAST_FMAF)
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

#endif  /* TRIFORCE_COMMON_H */
