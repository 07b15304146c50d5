// quantmla's fused CPU decode over paged token records (the vLLM plugin's CPU path): one pass a page that
// dequantises the page's group-planar 2- and 4-bit codes into a float32 tile, scores it against every head and
// folds it into an online softmax, with no intermediate tensor. The arithmetic is the torch path's
// (quantmla.serving.paged_decode, float32 throughout); only the order of the sums differs.
//
// Record layout (quantmla.formats.records.RecordLayout, field-major pages): field f of page p, token i, sits at
// byte p * page_bytes + block_size * offset_f + i * nbytes_f. Codes: plane k of a path holds channels
// [k * pw, (k + 1) * pw) at bits [bits * k, bits * (k + 1)) of each of the pw words; per group of `group`
// channels one fp16 pair (scale, minimum): value = code * scale + minimum.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

struct Path {
  int64_t codes_off, sm_off;  // field offsets (bytes per token units, as RecordLayout.fields)
  int64_t code_bytes;         // bytes of codes a token
  int bits, planes, dim, group;
};

template <typename Word>
void dequant_path(const uint8_t* page, int64_t bs, int64_t i, const Path& p, float* x) {
  const int pw = p.dim / p.planes;
  const Word* words = reinterpret_cast<const Word*>(page + bs * p.codes_off + i * p.code_bytes);
  const c10::Half* sm = reinterpret_cast<const c10::Half*>(page + bs * p.sm_off + i * 4 * (p.dim / p.group));
  const Word mask = static_cast<Word>((1u << p.bits) - 1);
  const int seg = std::min(p.group, pw);
  for (int k = 0; k < p.planes; ++k) {
    const int shift = p.bits * k;
    for (int j0 = 0; j0 < pw; j0 += seg) {
      const int g = (k * pw + j0) / p.group;
      const float s = static_cast<float>(sm[2 * g]), m = static_cast<float>(sm[2 * g + 1]);
      float* out = x + k * pw + j0;
      const Word* w = words + j0;
#pragma omp simd
      for (int j = 0; j < seg; ++j) out[j] = static_cast<float>((w[j] >> shift) & mask) * s + m;
    }
  }
}

void dequant(const uint8_t* page, int64_t bs, int64_t i, const Path& p, float* x) {
  const int word_bits = p.planes * p.bits;
  if (word_bits == 32)
    dequant_path<uint32_t>(page, bs, i, p, x);
  else if (word_bits == 16)
    dequant_path<uint16_t>(page, bs, i, p, x);
  else
    dequant_path<uint8_t>(page, bs, i, p, x);
}

// one tile of `t` rows x [t][width] (channels innermost) into the request's online softmax
struct Softmax {
  int heads, dc, width;
  std::vector<float> m, l, alpha, acc, s;  // m, l, alpha [heads]; acc [heads][dc]; s [heads][tile]
  Softmax(int heads_, int dc_, int width_, int tile)
      : heads(heads_), dc(dc_), width(width_), m(heads_, -std::numeric_limits<float>::infinity()), l(heads_, 0.f),
        alpha(heads_, 1.f), acc(static_cast<size_t>(heads_) * dc_, 0.f), s(static_cast<size_t>(heads_) * tile) {}

  // Register blocks of 4 heads x 4 rows: each vector of the 4 query rows and the 4 tile rows is loaded once
  // for 16 multiply-adds (a load a multiply-add with one head or row at a time); heads or rows left over go
  // one at a time.
  void scores(const float* q, const float* x, int t, float scale) {
    const int h4 = heads / 4 * 4, r4 = t / 4 * 4;
    for (int h = 0; h < h4; h += 4) {
      const float* q0 = q + static_cast<int64_t>(h) * width;
      for (int r = 0; r < r4; r += 4) {
        const float* x0 = x + static_cast<int64_t>(r) * width;
        float d00 = 0, d01 = 0, d02 = 0, d03 = 0, d10 = 0, d11 = 0, d12 = 0, d13 = 0;
        float d20 = 0, d21 = 0, d22 = 0, d23 = 0, d30 = 0, d31 = 0, d32 = 0, d33 = 0;
#pragma omp simd reduction(+ : d00, d01, d02, d03, d10, d11, d12, d13, d20, d21, d22, d23, d30, d31, d32, d33)
        for (int c = 0; c < width; ++c) {
          const float a0 = q0[c], a1 = q0[width + c], a2 = q0[2 * width + c], a3 = q0[3 * width + c];
          const float b0 = x0[c], b1 = x0[width + c], b2 = x0[2 * width + c], b3 = x0[3 * width + c];
          d00 += a0 * b0, d01 += a0 * b1, d02 += a0 * b2, d03 += a0 * b3;
          d10 += a1 * b0, d11 += a1 * b1, d12 += a1 * b2, d13 += a1 * b3;
          d20 += a2 * b0, d21 += a2 * b1, d22 += a2 * b2, d23 += a2 * b3;
          d30 += a3 * b0, d31 += a3 * b1, d32 += a3 * b2, d33 += a3 * b3;
        }
        const float d[16] = {d00, d01, d02, d03, d10, d11, d12, d13, d20, d21, d22, d23, d30, d31, d32, d33};
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) s[(h + i) * t + r + j] = d[4 * i + j] * scale;
      }
    }
    for (int h = 0; h < heads; ++h)  // what the blocks left: rows past r4 for every head, heads past h4
      for (int r = (h < h4 ? r4 : 0); r < t; ++r) {
        const float *qh = q + static_cast<int64_t>(h) * width, *xr = x + static_cast<int64_t>(r) * width;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < width; ++c) dot += qh[c] * xr[c];
        s[h * t + r] = dot * scale;
      }
  }

  void tile(const float* q, const float* x, int t, float scale) {
    scores(q, x, t, scale);
    for (int h = 0; h < heads; ++h) {  // the online softmax: probabilities in place of the scores
      float* sh = s.data() + static_cast<int64_t>(h) * t;
      float mt = -std::numeric_limits<float>::infinity();
      for (int r = 0; r < t; ++r) mt = std::max(mt, sh[r]);
      const float m_new = std::max(m[h], mt);
      alpha[h] = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first tile
      float sum = 0.f;
      for (int r = 0; r < t; ++r) {
        sh[r] = std::exp(sh[r] - m_new);
        sum += sh[r];
      }
      l[h] = l[h] * alpha[h] + sum;
      m[h] = m_new;
    }
    for (int h = 0; h < heads; ++h) {
      float* ah = acc.data() + static_cast<int64_t>(h) * dc;
      const float a = alpha[h];
#pragma omp simd
      for (int c = 0; c < dc; ++c) ah[c] *= a;
    }
    // output: blocks of 4 accumulator rows x 4 tile rows (8 loads and 4 stores a vector for 16 multiply-adds)
    const int h4 = heads / 4 * 4, r4 = t / 4 * 4;
    for (int h = 0; h < h4; h += 4) {
      float *a0 = acc.data() + static_cast<int64_t>(h) * dc, *a1 = a0 + dc, *a2 = a1 + dc, *a3 = a2 + dc;
      for (int r = 0; r < r4; r += 4) {
        const float *x0 = x + static_cast<int64_t>(r) * width, *x1 = x0 + width, *x2 = x1 + width, *x3 = x2 + width;
        float p[4][4];
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) p[i][j] = s[(h + i) * t + r + j];
#pragma omp simd
        for (int c = 0; c < dc; ++c) {
          const float b0 = x0[c], b1 = x1[c], b2 = x2[c], b3 = x3[c];
          a0[c] += p[0][0] * b0 + p[0][1] * b1 + p[0][2] * b2 + p[0][3] * b3;
          a1[c] += p[1][0] * b0 + p[1][1] * b1 + p[1][2] * b2 + p[1][3] * b3;
          a2[c] += p[2][0] * b0 + p[2][1] * b1 + p[2][2] * b2 + p[2][3] * b3;
          a3[c] += p[3][0] * b0 + p[3][1] * b1 + p[3][2] * b2 + p[3][3] * b3;
        }
      }
    }
    for (int h = 0; h < heads; ++h) {  // what the blocks left
      float* ah = acc.data() + static_cast<int64_t>(h) * dc;
      for (int r = (h < h4 ? r4 : 0); r < t; ++r) {
        const float p = s[static_cast<int64_t>(h) * t + r];
        const float* xr = x + static_cast<int64_t>(r) * width;
#pragma omp simd
        for (int c = 0; c < dc; ++c) ah[c] += p * xr[c];
      }
    }
  }
};

}  // namespace

// out [B, H, dc] (float32) of one decode token a request: q [B, H, dc + dr] float32; pages [blocks, bs, record]
// uint8; table [B, >= pages] int32; lens, start [B] int64 (paged tokens [start, len) of each request); window
// [B, W, dc + dr] float32 and window_len [B] int64 (W may be 0): unquantised rows joining the same softmax
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor pages, torch::Tensor table, torch::Tensor lens,
                           torch::Tensor start, torch::Tensor window, torch::Tensor window_len, double scale,
                           std::vector<int64_t> content, std::vector<int64_t> rope) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3,
              "q must be a contiguous CPU float32 tensor [B, H, dc + dr]");
  TORCH_CHECK(pages.scalar_type() == torch::kUInt8 && pages.dim() == 3 && pages.stride(2) == 1 &&
                  pages.stride(1) == pages.size(2),
              "pages must be uint8 [blocks, block_size, record_bytes], each page contiguous (any page stride)");
  TORCH_CHECK(table.scalar_type() == torch::kInt32 && table.is_contiguous() && table.dim() == 2, "table: int32 [B, P]");
  TORCH_CHECK(lens.scalar_type() == torch::kInt64 && start.scalar_type() == torch::kInt64 &&
                  window_len.scalar_type() == torch::kInt64,
              "lens, start and window_len must be int64");
  TORCH_CHECK(window.scalar_type() == torch::kFloat32 && window.is_contiguous() && window.dim() == 3,
              "window must be contiguous float32 [B, W, dc + dr]");
  TORCH_CHECK(content.size() == 7 && rope.size() == 7, "path descriptors have 7 entries");
  const Path pc{content[0], content[1], content[2], int(content[3]), int(content[4]), int(content[5]), int(content[6])};
  const Path pr{rope[0], rope[1], rope[2], int(rope[3]), int(rope[4]), int(rope[5]), int(rope[6])};
  const int64_t B = q.size(0), H = q.size(1), width = q.size(2), dc = pc.dim;
  TORCH_CHECK(width == pc.dim + pr.dim, "q's last dimension ", width, " != dc + dr = ", pc.dim + pr.dim);
  TORCH_CHECK(window.size(0) == B && window.size(2) == width, "window must be [B, W, dc + dr]");
  // page_bytes: the page stride (pages may be a view of a larger tensor of the engine's)
  const int64_t bs = pages.size(1), page_bytes = pages.stride(0), W = window.size(1);
  auto out = torch::zeros({B, H, dc}, q.options());
  const float* qp = q.data_ptr<float>();
  const uint8_t* pg = pages.data_ptr<uint8_t>();
  const int32_t* tb = table.data_ptr<int32_t>();
  const int64_t P = table.size(1);
  const int64_t *ln = lens.data_ptr<int64_t>(), *st = start.data_ptr<int64_t>(), *wl = window_len.data_ptr<int64_t>();
  const float* wp = window.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int tile = static_cast<int>(std::max<int64_t>(bs, 64));
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> x(static_cast<size_t>(tile) * width);
    for (int64_t b = b0; b < b1; ++b) {
      Softmax sm(static_cast<int>(H), static_cast<int>(dc), static_cast<int>(width), tile);
      const float* qb = qp + b * H * width;
      const int64_t nw = std::min<int64_t>(wl[b], W);
      for (int64_t r0 = 0; r0 < nw; r0 += tile)
        sm.tile(qb, wp + (b * W + r0) * width, static_cast<int>(std::min<int64_t>(tile, nw - r0)), float(scale));
      const int64_t len = ln[b], first = std::max<int64_t>(st[b], 0);
      TORCH_CHECK(len <= P * bs, "request ", b, ": length ", len, " exceeds its block table (", P * bs, " slots)");
      int t = 0;  // rows of the tile filled so far (a tile spans pages)
      for (int64_t p0 = first / bs; p0 * bs < len; ++p0) {
        const uint8_t* page = pg + static_cast<int64_t>(tb[b * P + p0]) * page_bytes;
        const int64_t i0 = std::max<int64_t>(first - p0 * bs, 0), i1 = std::min<int64_t>(len - p0 * bs, bs);
        for (int64_t i = i0; i < i1; ++i) {
          dequant(page, bs, i, pc, x.data() + static_cast<int64_t>(t) * width);
          dequant(page, bs, i, pr, x.data() + static_cast<int64_t>(t) * width + dc);
          if (++t == tile) {
            sm.tile(qb, x.data(), t, float(scale));
            t = 0;
          }
        }
      }
      if (t > 0) sm.tile(qb, x.data(), t, float(scale));
      float* ob = op + b * H * dc;
      for (int64_t h = 0; h < H; ++h) {
        const float inv = sm.l[h] > 0.f ? 1.f / sm.l[h] : 0.f;
        for (int64_t c = 0; c < dc; ++c) ob[h * dc + c] = sm.acc[h * dc + c] * inv;
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "quantmla's fused CPU decode over paged low-bit token records");
}
