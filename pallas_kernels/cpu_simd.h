// The x86 intrinsics the CPU kernels are written in: the compiler's own on the x86 builds, SIMDe's ("SIMD
// Everywhere") under the same names on the portable build (SLUICE_SIMDE, cpu_build.py), which runs on any CPU
// (NEON on ARM; plain C, which the compiler may vectorize, with SIMDE_NO_NATIVE). The portable build has no
// AVX-512: it takes the kernels' AVX2 paths.
#ifndef SLUICE_CPU_SIMD_H_
#define SLUICE_CPU_SIMD_H_

#if defined(SLUICE_SIMDE)
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx2.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
// SIMDe (0.8.2) names every other _MM_FROUND_* constant the x86 way, not this one.
#if !defined(_MM_FROUND_NO_EXC)
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif
#else
#include <immintrin.h>
#endif

#endif  // SLUICE_CPU_SIMD_H_
