// What is particular to the CPU backend: choosing tile kernels. Its results are checked against the reference, for
// every kernel set, by backend_conformance_test.cc.
#include "server/backends/cpu/cpu_backend.h"

#include <string>

#include "gtest/gtest.h"
#include "server/backends/cpu/tile_kernels.h"

namespace mha {
namespace {

TEST(CpuBackend, UnknownKernelsAreInvalidArgument) {
  EXPECT_EQ(CpuBackend::Create("avx1024").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CpuBackend::Create("sgemm").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackend, KernelsTheCpuLacksAreUnavailable) {
  int lacking = 0;
  for (const char* isa : {"avx512", "avx2"}) {
    if (kernels::TileKernelsFor(isa) != nullptr) continue;
    ++lacking;
    EXPECT_EQ(CpuBackend::Create(isa).status().code(), absl::StatusCode::kUnavailable) << isa;
  }
  if (lacking == 0) GTEST_SKIP() << "this CPU runs every tile-kernel set";
}

TEST(CpuBackend, PortableKernelsRunEverywhere) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create("portable");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_NE((*cpu)->device().find("portable attention tiles"), std::string::npos) << (*cpu)->device();
}

TEST(CpuBackend, AutoNamesTheWidestKernelsTheCpuRuns) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const char* widest = kernels::TileKernelsFor("avx512") != nullptr ? "avx512"
                       : kernels::TileKernelsFor("avx2") != nullptr ? "avx2"
                                                                    : "portable";
  EXPECT_NE((*cpu)->device().find(std::string(widest) + " attention tiles"), std::string::npos) << (*cpu)->device();
}

TEST(CpuBackend, RunsSmallCallsInline) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->inline_max_flops(), CpuBackend::kInlineMaxFlops);
  EXPECT_LE(CpuBackend::kInlineMaxFlops, CpuBackend::kSerialFlops);  // what runs inline runs on one thread
}

TEST(CpuBackend, WarmUpSucceeds) {
  absl::StatusOr<std::unique_ptr<CpuBackend>> cpu = CpuBackend::Create();
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_TRUE((*cpu)->WarmUp().ok());
}

}  // namespace
}  // namespace mha
