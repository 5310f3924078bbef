// The CUDA backend's host side, on a machine without a GPU: the planner (kernel choice, grid, tiles, shared
// memory, the keys each query tile visits), Supports per dtype and head_dim, the row-major to column-major
// mapping of the cuBLAS products, the error mapping, and the backend's refusal to start without a usable GPU.
// Correctness on a GPU is the conformance suite's (tests/gpu/device-check.sh runs it there).
#include <dlfcn.h>

#include <climits>
#include <map>
#include <tuple>
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/backends/cuda/cublas_api.h"
#include "server/backends/cuda/cuda_backend.h"
#include "server/backends/cuda/cuda_status.h"
#include "server/backends/cuda/flash_plan.h"
#include "server/backends/cuda/paged_plan.h"
#include "server/backends/registry.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::testing::HasSubstr;

AttentionShape Shape(int64_t b, int64_t tq, int64_t tk, int64_t h, int64_t hkv, int64_t dk, bool causal = false) {
  AttentionShape s;
  s.batch = b;
  s.q_len = tq;
  s.kv_len = tk;
  s.heads.num_heads = h;
  s.heads.num_kv_heads = hkv;
  s.heads.head_dim = dk;
  s.heads.causal = causal;
  s.heads.scale = 0.125f;
  return s;
}

TEST(FlashPlan, SixteenBitHeadDims64And128RunOnTensorCores) {
  for (v1::DataType dtype : {v1::FP16, v1::BF16}) {
    for (int64_t dk : {64, 128}) {
      absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(Shape(2, 1000, 1000, 32, 8, dk), dtype);
      ASSERT_TRUE(plan.ok()) << plan.status();
      EXPECT_EQ(plan->kernel, cuda::FlashKernel::kTensorCore) << dk;
      EXPECT_EQ(plan->block_m, 128);
      EXPECT_EQ(plan->block_n, 64);
      EXPECT_EQ(plan->threads, 256);  // 8 warps of 16 query rows
      EXPECT_EQ(plan->grid_x, 2 * 32);
      EXPECT_EQ(plan->grid_y, 8);  // ceil(1000 / 128)
      // K and V tiles of 64 padded rows (what ptxas reports), within the 48 KiB of static shared memory; Q's 128
      // padded rows pass through the same room.
      EXPECT_EQ(plan->smem_bytes, 2 * 64 * (dk + 8) * 2);
      EXPECT_LE(plan->smem_bytes, 48 * 1024);
      EXPECT_LE(plan->block_m * (dk + 8) * 2, plan->smem_bytes);
      EXPECT_TRUE(plan->async_copies);  // cp.async overlaps the tile copies with the products
    }
  }
}

TEST(FlashPlan, TensorCoreVariantsChangeRowsWarpsAndCopiesOnly) {
  const cuda::FlashPlan plan = *cuda::PlanFlash(Shape(2, 1000, 1000, 32, 8, 128), v1::BF16);
  const cuda::FlashPlan variant = cuda::TensorCoreVariant(plan, 1000, 64, false);
  EXPECT_EQ(variant.kernel, cuda::FlashKernel::kTensorCore);
  EXPECT_EQ(variant.block_m, 64);
  EXPECT_EQ(variant.threads, 128);  // 4 warps
  EXPECT_EQ(variant.grid_y, 16);    // ceil(1000 / 64)
  EXPECT_FALSE(variant.async_copies);
  EXPECT_EQ(variant.grid_x, plan.grid_x);
  EXPECT_EQ(variant.block_n, plan.block_n);
  EXPECT_EQ(variant.smem_bytes, plan.smem_bytes);
}

TEST(FlashPlan, Fp32AndOtherHeadDimsRunOnTheSimtKernel) {
  struct Case {
    v1::DataType dtype;
    int64_t dk;
  };
  for (const Case& c : {Case{v1::FP32, 64}, Case{v1::FP32, 128}, Case{v1::BF16, 80}, Case{v1::FP16, 32},
                        Case{v1::BF16, 1}, Case{v1::FP32, 256}}) {
    absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(Shape(3, 10, 7, 4, 2, c.dk), c.dtype);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kernel, cuda::FlashKernel::kSimt) << c.dk;
    EXPECT_EQ(plan->threads, 128);
    EXPECT_EQ(plan->grid_x, 3 * 4);
    EXPECT_EQ(plan->grid_y, 3);  // one warp per query row, four per block
    EXPECT_FALSE(plan->async_copies);
  }
}


TEST(FlashPlan, HeadDimAbove256IsUnimplemented) {
  absl::StatusOr<cuda::FlashPlan> plan = cuda::PlanFlash(Shape(1, 4, 4, 1, 1, 257), v1::FP32);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(plan.status().message(), HasSubstr("head_dim up to 256, got 257"));
}

TEST(FlashPlan, QueryTilesBeyondTheGridLimitAreUnimplemented) {
  // SIMT: 4 rows per block, so 4 * 65535 rows fit and one more does not.
  EXPECT_TRUE(cuda::PlanFlash(Shape(1, 4 * 65535, 1, 1, 1, 8), v1::FP32).ok());
  EXPECT_EQ(cuda::PlanFlash(Shape(1, 4 * 65535 + 1, 1, 1, 1, 8), v1::FP32).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST(FlashPlan, VisibleKeyEndIsTheServersRule) {
  // The kernels' rule against VisibleKeyCount (backend.h), which every CPU backend uses.
  for (int64_t tq : {1, 5, 9}) {
    for (int64_t tk : {1, 4, 9, 13}) {
      for (bool causal : {false, true}) {
        for (int32_t length : {-1, 0, 3, 13}) {
          AttentionShape s = Shape(1, tq, tk, 1, 1, 8, causal);
          std::vector<int32_t> lengths;
          if (length >= 0) lengths.push_back(std::min<int32_t>(length, static_cast<int32_t>(tk)));
          AttentionMask mask;
          mask.key_lengths = lengths;
          for (int64_t i = 0; i < tq; ++i) {
            EXPECT_EQ(cuda::VisibleKeyEnd(tq, tk, causal, lengths.empty() ? -1 : lengths[0], i),
                      VisibleKeyCount(s, mask, 0, i))
                << "Tq=" << tq << " Tk=" << tk << " causal=" << causal << " length=" << length << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(FlashPlan, KeyTilesCoverEveryVisibleKeyAndSkipTheRest) {
  for (int64_t tq : {1, 64, 100, 300}) {
    for (int64_t tk : {1, 63, 64, 65, 300}) {
      for (bool causal : {false, true}) {
        for (int64_t length : {-1, 0, 50}) {
          for (int64_t row0 = 0; row0 < tq; row0 += 64) {
            const int64_t tiles = cuda::KeyTileCount(tq, tk, causal, length, row0, 64, 64);
            int64_t needed = 0;  // one past the last key any row of the tile sees
            for (int64_t i = row0; i < std::min(tq, row0 + 64); ++i) {
              needed = std::max(needed, cuda::VisibleKeyEnd(tq, tk, causal, length, i));
            }
            EXPECT_EQ(tiles, (needed + 63) / 64) << "Tq=" << tq << " Tk=" << tk << " causal=" << causal
                                                 << " length=" << length << " row0=" << row0;
          }
        }
      }
    }
  }
}

TEST(FlashPlan, CausalSquareAttentionVisitsAboutHalfTheTiles) {
  const int64_t t = 4096, tiles = t / 64;
  int64_t visited = 0;
  for (int64_t row0 = 0; row0 < t; row0 += 64) visited += cuda::KeyTileCount(t, t, true, -1, row0, 64, 64);
  EXPECT_EQ(visited, tiles * (tiles + 1) / 2);  // the diagonal tiles and those below it
}

TEST(FlashPlan, CausalQueryTilesRunLongestFirst) {
  for (int64_t tq : {1, 64, 1000}) {
    for (int64_t tk : {tq, tq + 200}) {
      const int64_t grid_y = (tq + 63) / 64;
      std::vector<bool> seen(grid_y, false);
      int64_t previous = INT64_MAX;
      for (int64_t y = 0; y < grid_y; ++y) {
        const int64_t tile = cuda::QueryTileOf(true, grid_y, y);
        ASSERT_GE(tile, 0);
        ASSERT_LT(tile, grid_y);
        EXPECT_FALSE(seen[tile]) << "tile " << tile << " twice";
        seen[tile] = true;
        // Blocks start in about blockIdx order: the work of the block rows must not grow along y.
        const int64_t work = cuda::KeyTileCount(tq, tk, true, -1, tile * 64, 64, 64);
        EXPECT_LE(work, previous) << "Tq=" << tq << " Tk=" << tk << " y=" << y;
        previous = work;
      }
    }
  }
}

TEST(FlashPlan, NonCausalQueryTilesRunInOrder) {
  for (int64_t y = 0; y < 5; ++y) EXPECT_EQ(cuda::QueryTileOf(false, 5, y), y);
}

TEST(CudaSupports, EveryDtypeUpToHeadDim256) {
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16}) {
    for (int64_t dk : {1, 8, 20, 64, 80, 128, 256}) {
      AttentionProblem problem;
      problem.shape = Shape(2, 9, 9, 4, 2, dk);
      problem.input_dtype = dtype;
      problem.return_weights = dk % 2 == 0;
      EXPECT_TRUE(cuda::CudaSupports(problem).ok()) << DTypeName(dtype) << " d_k " << dk;
    }
    AttentionProblem too_wide;
    too_wide.shape = Shape(2, 9, 9, 4, 2, 512);
    too_wide.input_dtype = dtype;
    EXPECT_EQ(cuda::CudaSupports(too_wide).code(), absl::StatusCode::kUnimplemented);
  }
}

// The kernels read q, k and v of one dtype: a call mixing them is refused before it is queued, so that BACKEND_AUTO
// takes it to the CPU (validate.cc's ChooseBackend) instead of failing at compute.
TEST(CudaSupports, MixedInputDtypesAreUnimplemented) {
  AttentionProblem problem;
  problem.shape = Shape(2, 9, 9, 4, 2, 64);
  problem.input_dtype = v1::FP16;
  problem.mixed_inputs = true;
  const absl::Status status = cuda::CudaSupports(problem);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(status.message(), HasSubstr("this call mixes them"));
}

TEST(CudaSupports, RopeAndSoftmaxStatistics) {
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16}) {
    AttentionProblem problem;
    problem.shape = Shape(2, 9, 9, 4, 2, 64);
    problem.input_dtype = dtype;
    problem.shape.heads.rope_theta = 10000;
    problem.shape.heads.rope_dim = 32;
    problem.shape.heads.rope_interleaved = true;
    problem.return_stats = true;
    problem.return_weights = true;
    EXPECT_TRUE(cuda::CudaSupports(problem).ok()) << DTypeName(dtype) << ": " << cuda::CudaSupports(problem);
  }
}

TEST(CudaWorkspace, CountsProjectionsHeadsAndStatistics) {
  AttentionProblem p;
  p.shape = Shape(2, 16, 32, 8, 2, 64);
  p.shape.d_model = p.shape.d_kv_in = p.shape.d_v_in = 512;
  p.input_dtype = v1::BF16;
  // Q and heads: 2*16 rows of 512 bf16; K, V: 2*32 rows of 128 bf16; the fp32 output 2*16 x 512.
  const int64_t base = (32 * 512 * 2 + 2 * 64 * 128) * 2 + 32 * 512 * 4;
  EXPECT_EQ(cuda::CudaWorkspaceBytes(p), base);
  p.return_weights = true;
  EXPECT_EQ(cuda::CudaWorkspaceBytes(p), base + 2 * 8 * 16 * 8);  // a max and a sum per (batch, head, query)
  p.return_stats = true;
  // lse, entropy, confidence, distance, sink and contribution: fp32 per (batch, head, query).
  EXPECT_EQ(cuda::CudaWorkspaceBytes(p), base + 2 * 8 * 16 * 8 + 6 * 2 * 8 * 16 * 4);
}

// C[m x n] = A[m x k] B[k x n], column-major with leading dimensions: what cublasGemmEx computes.
void ColumnMajorProduct(const cuda::ColumnMajorGemm& g) {
  const float* a = static_cast<const float*>(g.a);
  const float* b = static_cast<const float*>(g.b);
  float* c = static_cast<float*>(g.c);
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      float sum = 0.0f;
      for (int64_t p = 0; p < g.k; ++p) sum += a[i + p * g.lda] * b[p + j * g.ldb];
      c[i + j * g.ldc] = sum;
    }
  }
}

// Paged calls (sessions): units and key splits.
struct PagedPlanCase {
  std::string name;
  int64_t heads, kv_heads, head_dim;
  std::vector<std::pair<int64_t, int64_t>> sequences;  // (cached length, new tokens)
  int64_t want_units;
};

std::ostream& operator<<(std::ostream& os, const PagedPlanCase& c) { return os << c.name; }

class PagedPlanTest : public ::testing::TestWithParam<PagedPlanCase> {};

TEST_P(PagedPlanTest, UnitsCoverEveryRowOfEveryHeadOnce) {
  const PagedPlanCase& c = GetParam();
  PagedProblem problem;
  problem.heads.num_heads = c.heads;
  problem.heads.num_kv_heads = c.kv_heads;
  problem.heads.head_dim = c.head_dim;
  std::vector<PagedSequence> sequences(c.sequences.size());
  std::vector<char*> no_blocks;
  for (size_t i = 0; i < sequences.size(); ++i) {
    sequences[i].length = c.sequences[i].first;
    sequences[i].new_tokens = c.sequences[i].second;
    sequences[i].blocks = no_blocks;
  }
  const cuda::PagedPlan plan = cuda::PlanPaged(problem, sequences, 132);
  EXPECT_EQ(static_cast<int64_t>(plan.units.size()), c.want_units);
  std::map<std::tuple<int, int, int>, int> covered;  // (sequence, head, token) -> units
  const int64_t rows = cuda::PagedRowsPerUnit(c.head_dim), group = c.heads / c.kv_heads;
  for (const cuda::PagedUnit& u : plan.units) {
    EXPECT_LE(u.heads * u.tokens, rows);
    EXPECT_EQ(u.head0 / group, u.kv_head) << "a unit's heads share its KV head";
    EXPECT_EQ((u.head0 + u.heads - 1) / group, u.kv_head);
    for (int h = u.head0; h < u.head0 + u.heads; ++h) {
      for (int t = u.token0; t < u.token0 + u.tokens; ++t) ++covered[{u.seq, h, t}];
    }
  }
  int64_t want_rows = 0;
  for (const auto& [length, n] : c.sequences) want_rows += n * c.heads;
  EXPECT_EQ(static_cast<int64_t>(covered.size()), want_rows);
  for (const auto& [key, count] : covered) EXPECT_EQ(count, 1);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, PagedPlanTest,
    ::testing::Values(
        // 4 query heads per KV head x 4 tokens fill 16 rows: one read of a KV head's tiles serves its whole group.
        PagedPlanCase{"decode_gqa4", 32, 8, 128, {{1000, 1}, {5, 1}}, 16},
        PagedPlanCase{"prefill_gqa4", 32, 8, 128, {{0, 9}}, 8 * 3},
        // MQA's group of 32 is cut into units of 16 heads.
        PagedPlanCase{"decode_mqa", 32, 1, 64, {{100, 2}}, 4},
        // head_dim above 128: 8 rows a unit, 2 tokens of a group of 4.
        PagedPlanCase{"decode_dk256", 8, 2, 256, {{10, 3}}, 2 * 2}),
    [](const auto& info) { return info.param.name; });

PagedProblem DecodeProblem() {
  PagedProblem problem;
  problem.heads.num_heads = 32;
  problem.heads.num_kv_heads = 8;
  problem.heads.head_dim = 128;
  return problem;
}

TEST(PagedPlan, FewLongSequencesSplitTheirKeys) {
  std::vector<char*> no_blocks;
  PagedSequence seq;
  seq.length = 32767;
  seq.new_tokens = 1;
  seq.blocks = no_blocks;
  const cuda::PagedPlan plan = cuda::PlanPaged(DecodeProblem(), {seq}, 132);
  ASSERT_EQ(plan.units.size(), 8u);
  // 8 units want 132 x 8 / 8 = 132 splits; 32768 keys allow 128 of at least 256 keys.
  EXPECT_EQ(plan.splits, 128);
  EXPECT_EQ(plan.split_keys, 256);
  EXPECT_EQ(plan.split_keys % cuda::kPagedTileKeys, 0);
}

TEST(PagedPlan, ManySequencesDoNotSplit) {
  std::vector<char*> no_blocks;
  std::vector<PagedSequence> sequences(256);
  for (PagedSequence& seq : sequences) {
    seq.length = 4095;
    seq.new_tokens = 1;
    seq.blocks = no_blocks;
  }
  const cuda::PagedPlan plan = cuda::PlanPaged(DecodeProblem(), sequences, 132);
  EXPECT_EQ(plan.units.size(), 256u * 8);
  EXPECT_EQ(plan.splits, 1);
  EXPECT_GE(plan.split_keys, 4096);
}

// Cascade decode: six decoding sequences whose caches start with blocks A, B (five of them with C too), one that
// starts with A but has two new tokens, one on other blocks, one alone.
TEST(PagedPlan, SequencesStartingWithTheSameFullBlocksShareUnits) {
  char a, b, c, other[6], alone;
  std::vector<std::vector<char*>> tables;
  for (int i = 0; i < 5; ++i) tables.push_back({&a, &b, &c, &other[i]});  // 60 tokens: A, B, C full
  tables.push_back({&a, &b, &other[5]});                                   // 40 tokens: A, B full
  tables.push_back({&a, &b, &c, &alone});                                  // two new tokens
  tables.push_back({&alone, &b});
  tables.push_back({&other[0]});
  PagedProblem problem = DecodeProblem();
  problem.cache.block_tokens = 16;
  std::vector<PagedSequence> sequences(tables.size());
  for (size_t i = 0; i < sequences.size(); ++i) {
    sequences[i].blocks = tables[i];
    sequences[i].length = i == 5 ? 40 : i == 7 ? 20 : i == 8 ? 10 : 60;
    sequences[i].new_tokens = i == 6 ? 2 : 1;
  }
  const cuda::PagedPlan plan = cuda::PlanPaged(problem, sequences, 132);
  EXPECT_THAT(plan.cascade, ::testing::UnorderedElementsAre(0, 1, 2, 3, 4, 5));
  EXPECT_THAT(plan.shared_keys, ::testing::ElementsAre(32, 32, 32, 32, 32, 32, 0, 0, 0)) << "A and B: 2 x 16 keys";
  // Own units: 8 KV heads of each sequence (the two-token one fits a unit too); shared: 8 x ceil(6 / 4).
  ASSERT_EQ(plan.units.size(), 9u * 8 + 8 * 2);
  std::map<std::pair<int, int>, int> covered;  // (sequence, head) -> shared units
  for (const cuda::PagedUnit& u : plan.units) {
    if (u.members == 0) continue;
    EXPECT_EQ(u.heads, 4);
    EXPECT_EQ(u.head0, u.kv_head * 4);
    EXPECT_LE(u.members * u.heads, cuda::PagedRowsPerUnit(128));
    for (int m = u.member0; m < u.member0 + u.members; ++m) {
      for (int h = u.head0; h < u.head0 + u.heads; ++h) ++covered[{plan.cascade[m], h}];
    }
  }
  EXPECT_EQ(covered.size(), 6u * 32);
  for (const auto& [key, count] : covered) EXPECT_EQ(count, 1);
  EXPECT_EQ(cuda::PagedSlotsOf(plan), 2 * plan.splits);
}

// The target shape of cascade decode on tensor cores: 64 sessions decoding over 8192 shared tokens and 256 of their
// own (bf16, GQA 4, d_k 128, 32-token blocks).
struct CascadeShape {
  std::vector<char> shared = std::vector<char>(256), own = std::vector<char>(64 * 9);
  std::vector<std::vector<char*>> tables;
  std::vector<PagedSequence> sequences;

  explicit CascadeShape(int64_t sessions = 64) : tables(sessions), sequences(sessions) {
    for (int64_t s = 0; s < sessions; ++s) {
      for (char& b : shared) tables[s].push_back(&b);
      for (int i = 0; i < 9; ++i) tables[s].push_back(&own[s * 9 + i]);
      sequences[s].blocks = tables[s];
      sequences[s].length = 8192 + 256 - 1;
      sequences[s].new_tokens = 1;
    }
  }
  static PagedProblem Problem(v1::DataType cache = v1::BF16) {
    PagedProblem problem = DecodeProblem();
    problem.cache = {8, 128, 32, cache};
    return problem;
  }
};

// A 16-bit or 8-bit cache at head_dim 64 or 128 stacks 64 / group members per shared unit, on the cascade kernel
// (the plan's last units), with shared splits of its own; each member's own units split its own keys only.
TEST(PagedPlan, CascadeOnTensorCoresStacksSixteenMembersPerUnitAtGqa4) {
  for (v1::DataType cache : {v1::BF16, v1::FP16, v1::INT8, v1::FP8_E4M3}) {
    CascadeShape shape;
    const PagedProblem problem = CascadeShape::Problem(cache);
    ASSERT_TRUE(cuda::CascadeOnTensorCores(problem)) << DTypeName(cache);
    const cuda::PagedPlan plan = cuda::PlanPaged(problem, shape.sequences, 132);
    ASSERT_EQ(plan.cascade.size(), 64u);
    EXPECT_THAT(plan.shared_keys, ::testing::Each(8192));
    ASSERT_EQ(plan.units.size(), 64u * 8 + 8 * 4) << "own units, then 8 KV heads x 64 / 16 shared units";
    EXPECT_EQ(plan.mma_units, 8 * 4);
    std::map<std::pair<int, int>, int> covered;  // (sequence, head) -> shared units
    for (size_t i = 0; i < plan.units.size(); ++i) {
      const cuda::PagedUnit& u = plan.units[i];
      EXPECT_EQ(u.members > 0, i >= 64u * 8) << "shared units come last";
      if (u.members == 0) continue;
      EXPECT_EQ(u.members, 16);
      EXPECT_EQ(u.members * u.heads, cuda::kCascadeRows);
      for (int m = u.member0; m < u.member0 + u.members; ++m) {
        for (int h = u.head0; h < u.head0 + u.heads; ++h) ++covered[{plan.cascade[m], h}];
      }
    }
    EXPECT_EQ(covered.size(), 64u * 32);
    for (const auto& [key, count] : covered) EXPECT_EQ(count, 1);
    // 32 shared units want 132 x 8 / 32 = 33 splits; 8192 keys allow 8 of kMinCascadeSplitKeys.
    EXPECT_EQ(plan.shared_splits, 8);
    EXPECT_EQ(plan.shared_split_keys, 1024);
    // The own units split their 256 keys (8448 - 8192), not the whole cache: 256 keys are one split.
    EXPECT_EQ(plan.splits, 1);
    EXPECT_EQ(cuda::PagedSlotsOf(plan), plan.splits + plan.shared_splits);
  }
}

// Shared splits are whole tiles of the cascade kernel and cover the longest shared range.
TEST(PagedPlan, CascadeSplitsAreWholeTilesCoveringTheSharedKeys) {
  CascadeShape shape(2);
  shape.tables[1].resize(40);  // 40 shared blocks and one of its own: the group shares 1280 keys
  shape.tables[1].push_back(&shape.own[9]);
  shape.sequences[1].blocks = shape.tables[1];
  shape.sequences[1].length = 40 * 32;
  const cuda::PagedPlan plan = cuda::PlanPaged(CascadeShape::Problem(), shape.sequences, 132);
  EXPECT_THAT(plan.shared_keys, ::testing::ElementsAre(1280, 1280));
  EXPECT_EQ(plan.mma_units, 8);
  EXPECT_EQ(plan.shared_split_keys % cuda::kCascadeTileKeys, 0);
  EXPECT_GE(plan.shared_splits * plan.shared_split_keys, 1280);
  EXPECT_EQ(plan.shared_splits, 1) << "1280 keys allow one split of kMinCascadeSplitKeys";
}

// Weights, an fp32 cache or head_dim 80 keep the shared units on the split kernel (16 rows each), which split the
// whole key range; statistics do not.
TEST(PagedPlan, CascadeStaysOnTheSplitKernelForWhatTheTensorCoresDoNotCompute) {
  PagedProblem with_stats = CascadeShape::Problem();
  with_stats.return_stats = true;
  EXPECT_TRUE(cuda::CascadeOnTensorCores(with_stats));
  std::vector<PagedProblem> problems(3, CascadeShape::Problem());
  problems[0].return_weights = true;
  problems[1].cache.dtype = v1::FP32;
  problems[2].heads.head_dim = problems[2].cache.head_dim = 80;
  for (const PagedProblem& problem : problems) {
    EXPECT_FALSE(cuda::CascadeOnTensorCores(problem));
    CascadeShape shape;
    const cuda::PagedPlan plan = cuda::PlanPaged(problem, shape.sequences, 132);
    EXPECT_EQ(plan.mma_units, 0);
    ASSERT_EQ(plan.units.size(), 64u * 8 + 8 * 16) << "shared units of 4 members";
    EXPECT_EQ(plan.shared_splits, plan.splits);
    EXPECT_EQ(plan.shared_split_keys, plan.split_keys);
    EXPECT_GE(plan.splits * plan.split_keys, 8448) << "the split kernel's shared units need the whole range";
  }
}

// MQA on tensor cores: a unit of 64 rows stacks two members' groups of 32; a group of 64 fills a unit alone.
TEST(PagedPlan, CascadeOnTensorCoresStacksTwoGroupsOfThirtyTwo) {
  CascadeShape shape(4);
  PagedProblem problem = CascadeShape::Problem();
  problem.heads.num_kv_heads = problem.cache.num_kv_heads = 1;
  const cuda::PagedPlan plan = cuda::PlanPaged(problem, shape.sequences, 132);
  EXPECT_EQ(plan.mma_units, 2);
  for (const cuda::PagedUnit& u : plan.units) {
    if (u.members > 0) {
      EXPECT_EQ(u.members, 2);
    }
  }
  problem.heads.num_heads = 64;
  EXPECT_FALSE(cuda::CascadeOnTensorCores(problem));
}

// Prefill chunks of 64+ tokens over a 16-bit or 8-bit cache at head_dim 64 or 128 take the dense path (the
// tensor-core flash kernel over gathered K and V) and get no units, statistics or not; weights, an fp32 cache, or
// head_dim 80 keep them on the split kernel.
TEST(PagedPlan, LongChunksOfSixteenBitCachesTakeTheDensePath) {
  std::vector<char*> no_blocks;
  PagedProblem problem = DecodeProblem();
  problem.cache = {8, 128, 32, v1::BF16};
  std::vector<PagedSequence> sequences(3);
  for (PagedSequence& seq : sequences) seq.blocks = no_blocks;
  sequences[0].length = 100;
  sequences[0].new_tokens = 64;  // dense: 164 keys
  sequences[1].length = 1000;
  sequences[1].new_tokens = 63;  // one token short
  sequences[2].length = 0;
  sequences[2].new_tokens = 200;  // dense: 200 keys
  cuda::PagedPlan plan = cuda::PlanPaged(problem, sequences, 132);
  EXPECT_THAT(plan.dense, ::testing::ElementsAre(true, false, true));
  for (const cuda::PagedUnit& u : plan.units) EXPECT_EQ(u.seq, 1) << "dense sequences have no units";
  EXPECT_EQ(plan.rows, 64 + 63 + 200);
  // The larger of q [n, H, d_k] and K, V [keys, Hkv, d_k], 2 bytes each: 200 x 4096 + 2 x 200 x 1024.
  EXPECT_EQ(plan.dense_scratch_bytes, (200 * 4096 + 2 * 200 * 1024) * 2);

  const auto dense = [&](PagedProblem changed) { return cuda::TakesDensePath(changed, sequences[0]); };
  EXPECT_TRUE(dense(problem));
  PagedProblem p = problem;
  p.return_weights = true;
  EXPECT_FALSE(dense(p));
  p = problem;
  p.return_stats = true;
  EXPECT_TRUE(dense(p));
  for (v1::DataType cache : {v1::FP32, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
    p = problem;
    p.cache.dtype = cache;
    EXPECT_EQ(dense(p), cache != v1::FP32) << DTypeName(cache);
  }
  p = problem;
  p.cache.dtype = v1::FP16;
  p.heads.head_dim = 64;
  EXPECT_TRUE(dense(p));
  p.heads.head_dim = 80;
  EXPECT_FALSE(dense(p));
  PagedSequence unseen = sequences[1];
  unseen.length = 0;
  unseen.new_tokens = 64;
  unseen.append = false;  // sees no key at all
  EXPECT_FALSE(cuda::TakesDensePath(problem, unseen));
}

// A unit of 16 rows holds one sequence's group of 32 (MQA): stacking gains nothing, so nothing is stacked.
TEST(PagedPlan, NoSharedUnitsWhenAGroupFillsAUnit) {
  char a, b;
  const std::vector<char*> table = {&a, &b};
  PagedProblem problem = DecodeProblem();
  problem.heads.num_kv_heads = 1;
  problem.cache.block_tokens = 16;
  std::vector<PagedSequence> sequences(2);
  for (PagedSequence& seq : sequences) {
    seq.blocks = table;
    seq.length = 20;
    seq.new_tokens = 1;
  }
  const cuda::PagedPlan plan = cuda::PlanPaged(problem, sequences, 132);
  EXPECT_TRUE(plan.cascade.empty());
  EXPECT_THAT(plan.shared_keys, ::testing::ElementsAre(0, 0));
  EXPECT_EQ(cuda::PagedSlotsOf(plan), plan.splits);
}

TEST(PagedPlan, ShortCachesKeepOneSplitPerMinimumRange) {
  std::vector<char*> no_blocks;
  PagedSequence seq;
  seq.length = 299;
  seq.new_tokens = 1;
  seq.blocks = no_blocks;
  const cuda::PagedPlan plan = cuda::PlanPaged(DecodeProblem(), {seq}, 132);
  EXPECT_EQ(plan.splits, 1) << "300 keys hold one split of at least " << cuda::kMinSplitKeys;
}

TEST(CublasMapping, RowMajorProductWithStridesIsTheColumnMajorCall) {
  // y[rows, n] = x[rows, k] w[k, n], every matrix with a row stride wider than its row (as the fused Q|K|V
  // projection reads its column blocks).
  const int64_t rows = 5, k = 7, n = 3, ldx = 9, ldw = 11, ldy = 4;
  const std::vector<float> x = testing::RandomVector(rows * ldx, 1, 1.0f), w = testing::RandomVector(k * ldw, 2, 1.0f);
  std::vector<float> y(rows * ldy, -7.0f), want(rows * ldy, -7.0f);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      float sum = 0.0f;
      for (int64_t p = 0; p < k; ++p) sum += x[r * ldx + p] * w[p * ldw + c];
      want[r * ldy + c] = sum;
    }
  }
  const cuda::ColumnMajorGemm g = cuda::RowMajorGemm(rows, n, k, x.data(), ldx, w.data(), ldw, y.data(), ldy);
  EXPECT_EQ(g.m, n);
  EXPECT_EQ(g.n, rows);
  EXPECT_EQ(g.k, k);
  ColumnMajorProduct(g);
  EXPECT_TRUE(testing::AllClose(y, want, 1e-6, 1e-6));  // including the untouched padding (-7)
}

TEST(CudaStatus, MapsRuntimeErrorsToCodesAndNamesThem) {
  EXPECT_TRUE(cuda::CudaStatus(cudaSuccess, "x").ok());
  const absl::Status oom = cuda::CudaStatus(cudaErrorMemoryAllocation, "allocating");
  EXPECT_EQ(oom.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(oom.message(), HasSubstr("allocating: cudaErrorMemoryAllocation: "));
  EXPECT_EQ(cuda::CudaStatus(cudaErrorInsufficientDriver, "x").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cuda::CudaStatus(cudaErrorNoDevice, "x").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cuda::CudaStatus(cudaErrorNoKernelImageForDevice, "x").code(), absl::StatusCode::kUnavailable);
  const absl::Status fault = cuda::CudaStatus(cudaErrorIllegalAddress, "the layer on the GPU");
  EXPECT_EQ(fault.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(fault.message(), HasSubstr("cudaErrorIllegalAddress"));
}

TEST(CudaStatus, MapsCublasErrorsToCodesAndNamesThem) {
  EXPECT_TRUE(cuda::CublasStatus(CUBLAS_STATUS_SUCCESS, "x").ok());
  EXPECT_EQ(cuda::CublasStatus(CUBLAS_STATUS_ALLOC_FAILED, "x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cuda::CublasStatus(CUBLAS_STATUS_NOT_SUPPORTED, "x").code(), absl::StatusCode::kUnimplemented);
  const absl::Status failed = cuda::CublasStatus(CUBLAS_STATUS_EXECUTION_FAILED, "cublasGemmEx 4x5x6");
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(failed.message(), "cublasGemmEx 4x5x6: CUBLAS_STATUS_EXECUTION_FAILED");
}

// Why this machine has no usable GPU: empty when it has one.
std::string NoGpuReason() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) return cuda::NoDeviceReason(error);
  return count == 0 ? "no device" : "";
}

// Without libcuda.so.1 at all, the reason says there is no driver, not that the driver is too old.
TEST(CudaStatus, WithoutTheDriversLibraryTheReasonSaysNoDriver) {
  if (void* driver = dlopen("libcuda.so.1", RTLD_LAZY); driver != nullptr) {
    dlclose(driver);
    GTEST_SKIP() << "libcuda.so.1 is installed here";
  }
  EXPECT_EQ(cuda::NoDeviceReason(cudaErrorInsufficientDriver), "no NVIDIA driver found (libcuda.so.1 not loaded)");
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create();
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(backend.status().message(), "no usable CUDA device: no NVIDIA driver found (libcuda.so.1 not loaded)");
}

TEST(CudaBackend, WithoutAGpuCreateIsUnavailableWithTheDriversReason) {
  const std::string reason = NoGpuReason();
  if (reason.empty()) GTEST_SKIP() << "a GPU is present";
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create();
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(backend.status().message(), HasSubstr(reason));
}

TEST(CudaBackend, WithoutAGpuTheRegistryListsItUnavailableAndAutoMeansCpu) {
  const std::string reason = NoGpuReason();
  if (reason.empty()) GTEST_SKIP() << "a GPU is present";
  EXPECT_TRUE(BackendRegistry::CompiledIn(kCudaBackend));
  std::unique_ptr<BackendRegistry> registry = BackendRegistry::Create();
  int listed = 0;
  for (const BackendEntry& entry : registry->entries()) {
    if (entry.name != kCudaBackend) continue;
    ++listed;
    EXPECT_TRUE(entry.compiled_in);
    EXPECT_FALSE(entry.available());
    EXPECT_THAT(entry.detail, HasSubstr(reason));
  }
  EXPECT_EQ(listed, 1);
  EXPECT_EQ(registry->DefaultName(), "cpu");
  absl::StatusOr<Backend*> cuda = registry->Find("cuda", "backend");
  EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(cuda.status().message(), HasSubstr("backend: backend 'cuda' is unavailable on this machine: "));
  // --backend cuda at start-up is refused the same way.
  EXPECT_EQ(registry->SetDefault("cuda", "--backend").code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace mha
