// The vectorised exp the kvforge.cpu ops share (attention's softmax, SwiGLU's sigmoid): one definition, so both
// round alike and a fix reaches both. Included inside each op's per-target block (Highway's per-target include
// guard): exp512 is the AVX-512 targets' (intrinsics, as before), Exp every other target's (Highway ops).

#if defined(KVFORGE_VECTOR_EXP_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef KVFORGE_VECTOR_EXP_H_
#undef KVFORGE_VECTOR_EXP_H_
#else
#define KVFORGE_VECTOR_EXP_H_
#endif

#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace kvforge_simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// exp with a degree-6 polynomial on the reduced argument and scalef for 2^n (about 1 ulp). Results that would
// be subnormal are flushed to 0, so the FMAs that consume them never take the slow subnormal path; inputs above
// 88.7 give exp(88.7) (finite), never inf.
inline __m512 exp512(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(normal, _mm512_scalef_ps(p, n));
}
#endif

// The same exp on any target: the same clamps, reduction and polynomial; 2^n applied as two exact power-of-two
// products (2^(n>>1) then 2^(n - (n>>1)), each a normal float), so the only rounding is the last product's, as
// scalef's. Each target's own MulAdd (scalar and SSE4 have no FMA instruction), so results may differ by target.
template <class D>
HWY_INLINE hn::Vec<D> Exp(D d, hn::Vec<D> x) {
  const hn::RebindToSigned<D> di;
  const auto normal = hn::Ge(x, hn::Set(d, -87.0f));
  x = hn::Min(hn::Max(x, hn::Set(d, -88.0f)), hn::Set(d, 88.7f));
  const auto n = hn::Round(hn::Mul(x, hn::Set(d, 1.44269504f)));
  auto r = hn::NegMulAdd(n, hn::Set(d, 0.693359375f), x);
  r = hn::NegMulAdd(n, hn::Set(d, -2.12194440e-4f), r);
  auto p = hn::Set(d, 1.0f / 720.0f);
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 120.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 24.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 6.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 0.5f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  const auto ni = hn::ConvertTo(di, n);
  const auto half = hn::ShiftRight<1>(ni);  // arithmetic: floor(n / 2)
  const auto bias = hn::Set(di, 127);
  const auto first = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(half, bias)));
  const auto second = hn::BitCast(d, hn::ShiftLeft<23>(hn::Add(hn::Sub(ni, half), bias)));
  return hn::IfThenElseZero(normal, hn::Mul(hn::Mul(p, first), second));
}

}  // namespace HWY_NAMESPACE
}  // namespace kvforge_simd
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
