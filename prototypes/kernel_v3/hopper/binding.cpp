// torch binding of quantmla's Hopper extensions (issue 19); the kernels are in the .cu files beside it.
#include <torch/extension.h>

extern "C" int quantmla_fragment_probe(const uint32_t* words, const uint16_t* b, float* d, int tiles, int bits,
                                       int output, int bf16, void* stream);
extern "C" int quantmla_tile_h16(const uint32_t* words, const void* scale, const void* minimum, const void* q,
                                 const void* p, float* scores, float* partial, float* rank1, int tokens, int per_cta,
                                 int ctas, unsigned lbo, unsigned sbo, void* stream);
extern "C" int quantmla_stream_h16(const uint32_t* words, const void* scale, const void* minimum, const void* q,
                                   const void* p, float* scores, float* partial, float* rank1, int tokens,
                                   int per_cta, int ctas, int write_scores, int variant, unsigned lbo, unsigned sbo,
                                   void* stream);
extern "C" int quantmla_stream_h16_dq(const uint32_t* words, const void* scale_gm, const void* minimum_gm,
                                      const void* q, const void* p, float* scores, float* partial, int tokens,
                                      int per_cta, int ctas, int write_scores, unsigned lbo, unsigned sbo,
                                      void* stream);
extern "C" int quantmla_stream_h16_cs(const uint32_t* words, const void* scale_gm, const void* minimum_gm,
                                      const void* q, const void* p, float* scores, float* partial, int tokens,
                                      int per_cta, int ctas, int write_scores, int warps, int schedule, void* stream);

// `stream`: the caller's current CUDA stream as an integer (torch.cuda.current_stream().cuda_stream), so the
// binding needs no CUDA headers
torch::Tensor fragment_probe(torch::Tensor words, torch::Tensor b, int64_t bits, bool output, bool bf16,
                             int64_t stream) {
  TORCH_CHECK(words.is_cuda() && words.scalar_type() == torch::kInt32 && words.is_contiguous() &&
                  words.dim() == 2 && words.size(1) == 32,
              "words must be a contiguous CUDA int32 tensor [n, 32]");
  TORCH_CHECK(b.is_cuda() && b.scalar_type() == torch::kInt16 && b.is_contiguous() && b.numel() == 256,
              "b must be a contiguous CUDA int16 tensor of 16 x 16 raw 16-bit patterns");
  TORCH_CHECK(bits == 2 || bits == 4, "bits must be 2 or 4, got ", bits);
  const int tiles = static_cast<int>(words.size(0) * (4 / bits));
  auto d = torch::empty({tiles, 16, 16}, words.options().dtype(torch::kFloat32));
  const int rc = quantmla_fragment_probe(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
                                         reinterpret_cast<const uint16_t*>(b.data_ptr<int16_t>()),
                                         d.data_ptr<float>(), tiles, static_cast<int>(bits), output, bf16,
                                         reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "fragment probe launch failed (cudaError ", rc, ")");
  return d;
}

// the h = 16 prototypes' common checks: words [tokens / 16, 32, 32] int32, the rest fp16; all contiguous CUDA
static void check_inputs(const torch::Tensor& words, int64_t tokens, std::initializer_list<torch::Tensor> halves) {
  TORCH_CHECK(words.is_cuda() && words.scalar_type() == torch::kInt32 && words.is_contiguous() &&
                  words.numel() == tokens / 16 * 32 * 32,
              "words must be contiguous CUDA int32 [tokens / 16, 32, 32]");
  for (const auto& t : halves)
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kHalf && t.is_contiguous(), "fp16 contiguous CUDA inputs");
}

// the h = 16 prototype: words [T/16, 32, 32] int32, scale and minimum [T, 8] fp16, q [16, 512] fp16, p [16, T]
// fp16; returns (scores [T, 16], partial outputs [ctas, 16, 512], rank-1 terms [ctas, 16, 8]), fp32
std::vector<torch::Tensor> tile_h16(torch::Tensor words, torch::Tensor scale, torch::Tensor minimum, torch::Tensor q,
                                    torch::Tensor p, int64_t per_cta, int64_t lbo, int64_t sbo, int64_t stream) {
  const int64_t tokens = scale.size(0);
  check_inputs(words, tokens, {scale, minimum, q, p});
  TORCH_CHECK(scale.sizes() == minimum.sizes() && scale.size(1) == 8, "scale and minimum must be [tokens, 8]");
  TORCH_CHECK(q.size(0) == 16 && q.size(1) == 512 && p.size(0) == 16 && p.size(1) == tokens, "q [16, 512], p [16, T]");
  const int ctas = static_cast<int>((tokens + per_cta - 1) / per_cta);
  auto f32 = words.options().dtype(torch::kFloat32);
  auto scores = torch::empty({tokens, 16}, f32);
  auto partial = torch::empty({ctas, 16, 512}, f32);
  auto rank1 = torch::empty({ctas, 16, 8}, f32);
  const int rc = quantmla_tile_h16(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), scale.data_ptr(),
                                   minimum.data_ptr(), q.data_ptr(), p.data_ptr(), scores.data_ptr<float>(),
                                   partial.data_ptr<float>(), rank1.data_ptr<float>(), static_cast<int>(tokens),
                                   static_cast<int>(per_cta), ctas, static_cast<unsigned>(lbo),
                                   static_cast<unsigned>(sbo), reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "tile_h16 launch failed (", rc, "; -2: tokens and per_cta must be multiples of 64)");
  return {scores, partial, rank1};
}

// the pipelined h = 16 prototype: as tile_h16, but p token-major [T, 16] (the scores' accumulator order), the
// scores written only when write_scores (else an empty tensor); variant 1: stmatrix W, the magic's 1024 taken off
// on the tensor cores (the rank-1 terms then hold sum_t m P only)
std::vector<torch::Tensor> stream_h16(torch::Tensor words, torch::Tensor scale, torch::Tensor minimum, torch::Tensor q,
                                      torch::Tensor p, int64_t per_cta, bool write_scores, int64_t variant,
                                      int64_t lbo, int64_t sbo, int64_t stream) {
  const int64_t tokens = scale.size(0);
  check_inputs(words, tokens, {scale, minimum, q, p});
  TORCH_CHECK(scale.sizes() == minimum.sizes() && scale.size(1) == 8, "scale and minimum must be [tokens, 8]");
  TORCH_CHECK(q.size(0) == 16 && q.size(1) == 512 && p.size(0) == tokens && p.size(1) == 16, "q [16, 512], p [T, 16]");
  const int ctas = static_cast<int>((tokens + per_cta - 1) / per_cta);
  auto f32 = words.options().dtype(torch::kFloat32);
  auto scores = torch::empty({write_scores ? tokens : 0, 16}, f32);
  auto partial = torch::empty({ctas, 16, 512}, f32);
  auto rank1 = torch::empty({ctas, 16, 8}, f32);
  const int rc = quantmla_stream_h16(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()), scale.data_ptr(),
                                     minimum.data_ptr(), q.data_ptr(), p.data_ptr(), scores.data_ptr<float>(),
                                     partial.data_ptr<float>(), rank1.data_ptr<float>(), static_cast<int>(tokens),
                                     static_cast<int>(per_cta), ctas, write_scores ? 1 : 0, static_cast<int>(variant),
                                     static_cast<unsigned>(lbo),
                                     static_cast<unsigned>(sbo), reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "stream_h16 launch failed (", rc,
              "; -2: tokens and per_cta must be multiples of 64; -3: variant must be 0 or 1)");
  return {scores, partial, rank1};
}

// the register-dequantising prototypes' inputs checked (scale and minimum group-major per 16-token tile
// [T/16, 8, 16] fp16, q [16, 512], p [T, 16]) and their outputs allocated: (scores [T or 0, 16], partial outputs
// [ctas, 16, 512]), fp32
static std::vector<torch::Tensor> dq_outputs(const torch::Tensor& words, const torch::Tensor& scale_gm,
                                             const torch::Tensor& minimum_gm, const torch::Tensor& q,
                                             const torch::Tensor& p, int64_t per_cta, bool write_scores) {
  const int64_t tokens = p.size(0);
  check_inputs(words, tokens, {scale_gm, minimum_gm, q, p});
  TORCH_CHECK(scale_gm.numel() == tokens * 8 && minimum_gm.numel() == tokens * 8 && scale_gm.size(-1) == 16,
              "scale and minimum must be group-major [tokens / 16, 8, 16]");
  TORCH_CHECK(q.size(0) == 16 && q.size(1) == 512 && p.size(1) == 16, "q [16, 512], p [T, 16]");
  const int64_t ctas = (tokens + per_cta - 1) / per_cta;
  auto f32 = words.options().dtype(torch::kFloat32);
  return {torch::empty({write_scores ? tokens : 0, 16}, f32), torch::empty({ctas, 16, 512}, f32)};
}

// variant 2 of the pipelined prototype, dequantised in registers; inputs and outputs as dq_outputs
std::vector<torch::Tensor> stream_h16_dq(torch::Tensor words, torch::Tensor scale_gm, torch::Tensor minimum_gm,
                                         torch::Tensor q, torch::Tensor p, int64_t per_cta, bool write_scores,
                                         int64_t lbo, int64_t sbo, int64_t stream) {
  auto out = dq_outputs(words, scale_gm, minimum_gm, q, p, per_cta, write_scores);
  const int rc = quantmla_stream_h16_dq(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
                                        scale_gm.data_ptr(), minimum_gm.data_ptr(), q.data_ptr(), p.data_ptr(),
                                        out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                                        static_cast<int>(p.size(0)), static_cast<int>(per_cta),
                                        static_cast<int>(out[1].size(0)), write_scores ? 1 : 0,
                                        static_cast<unsigned>(lbo), static_cast<unsigned>(sbo),
                                        reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "stream_h16_dq launch failed (", rc, "; -2: tokens and per_cta must be multiples of 64)");
  return out;
}

// variant 3 (the channels split across 4 or 8 warps, mma.sync; schedule 0), variant 4 (1: the output product on
// wgmma) and variant 5 (2, 3 with the scores' chain split: skewed by one step), 4 warps: as stream_h16_dq, tokens
// and per_cta multiples of 32
std::vector<torch::Tensor> stream_h16_cs(torch::Tensor words, torch::Tensor scale_gm, torch::Tensor minimum_gm,
                                         torch::Tensor q, torch::Tensor p, int64_t per_cta, bool write_scores,
                                         int64_t warps, int64_t schedule, int64_t stream) {
  auto out = dq_outputs(words, scale_gm, minimum_gm, q, p, per_cta, write_scores);
  const int rc = quantmla_stream_h16_cs(reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
                                        scale_gm.data_ptr(), minimum_gm.data_ptr(), q.data_ptr(), p.data_ptr(),
                                        out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                                        static_cast<int>(p.size(0)), static_cast<int>(per_cta),
                                        static_cast<int>(out[1].size(0)), write_scores ? 1 : 0,
                                        static_cast<int>(warps), static_cast<int>(schedule), reinterpret_cast<void*>(stream));
  TORCH_CHECK(rc == 0, "stream_h16_cs launch failed (", rc,
              "; -2: tokens and per_cta must be multiples of 32; -3: warps must be 4 or 8, and 4 with schedules 1-3)");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fragment_probe", &fragment_probe);
  m.def("tile_h16", &tile_h16);
  m.def("stream_h16", &stream_h16);
  m.def("stream_h16_dq", &stream_h16_dq);
  m.def("stream_h16_cs", &stream_h16_cs);
}
