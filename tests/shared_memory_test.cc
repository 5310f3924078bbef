// Tensors in shared memory (RegisterSharedMemory, SharedMemoryRef): the registry's rules, the guard against an
// object that shrinks under the server, and the service computing from and into registered regions exactly as it
// does from and into messages.
#include "server/transport/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "client/shared_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service_fixture.h"

namespace mha::testing {
namespace {

using ::testing::HasSubstr;

// A fresh shm_open name per call, so that tests (and parallel ctest processes) never share an object.
std::string UniqueKey() {
  static std::atomic<int> next{0};
  return "/mha_test_" + std::to_string(getpid()) + "_" + std::to_string(next++);
}

std::unique_ptr<SharedMemoryObject> NewObject(size_t bytes) {
  absl::StatusOr<std::unique_ptr<SharedMemoryObject>> object = SharedMemoryObject::Create(UniqueKey(), bytes);
  EXPECT_TRUE(object.ok()) << object.status();
  return object.ok() ? *std::move(object) : nullptr;
}

// Shrinks `object` to `bytes` as its client could, behind the server's mapping.
void Truncate(const SharedMemoryObject& object, off_t bytes) {
  const int fd = shm_open(object.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  close(fd);
}

// ---- The registry ----

TEST(SharedMemoryRegistryTest, IsOffWithoutRegions) {
  SharedMemoryRegistry registry(0, 1 << 20);
  auto object = NewObject(4096);
  EXPECT_EQ(registry.Register("r", object->key(), 4096).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.Find("r", "query.shared_memory.region").status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(SharedMemoryRegistryTest, MapsTheObjectsBytes) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4096);
  std::memcpy(object->data(), "hello", 5);
  ASSERT_TRUE(registry.Register("r", object->key(), 4096).ok());
  absl::StatusOr<std::shared_ptr<const SharedMemoryRegion>> region = registry.Find("r", "field");
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(std::string((*region)->data(), 5), "hello");
  (*region)->data()[0] = 'j';  // the server writes outputs there: the client sees them
  EXPECT_EQ(object->data()[0], 'j');
  EXPECT_TRUE((*region)->Intact().ok());
}

struct BadRegistration {
  std::string label;
  std::string name;
  std::string key;  // "@" stands for a fresh object's key
  uint64_t bytes;
  absl::StatusCode code;
};

class BadRegistrationTest : public ::testing::TestWithParam<BadRegistration> {};

TEST_P(BadRegistrationTest, IsRefusedWithItsCode) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4096);
  const BadRegistration& c = GetParam();
  const std::string key = c.key == "@" ? object->key() : c.key;
  EXPECT_EQ(registry.Register(c.name, key, c.bytes).code(), c.code);
  EXPECT_EQ(registry.size(), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadRegistrationTest,
    ::testing::Values(
        BadRegistration{"EmptyName", "", "@", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"NameWithASlash", "a/b", "@", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"KeyWithoutSlash", "r", "mha_x", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"KeyOfAnotherProgram", "r", "/other_app", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"KeyIntoAFolder", "r", "/mha_/../etc/passwd", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"KeyDotDot", "r", "/..", 4096, absl::StatusCode::kInvalidArgument},
        BadRegistration{"NoSuchObject", "r", "/mha_test_no_such_object", 4096, absl::StatusCode::kNotFound},
        BadRegistration{"ZeroBytes", "r", "@", 0, absl::StatusCode::kInvalidArgument},
        BadRegistration{"MoreThanTheObject", "r", "@", 8192, absl::StatusCode::kInvalidArgument},
        BadRegistration{"OverTheByteLimit", "r", "@", (2u << 20), absl::StatusCode::kInvalidArgument}),
    [](const ::testing::TestParamInfo<BadRegistration>& info) { return info.param.label; });

TEST(SharedMemoryRegistryTest, ATakenNameIsAlreadyExists) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4096);
  ASSERT_TRUE(registry.Register("r", object->key(), 4096).ok());
  EXPECT_EQ(registry.Register("r", object->key(), 4096).code(), absl::StatusCode::kAlreadyExists);
}

TEST(SharedMemoryRegistryTest, RegionsAndBytesAreBounded) {
  SharedMemoryRegistry registry(2, 3 * 4096);
  auto object = NewObject(8192);
  ASSERT_TRUE(registry.Register("a", object->key(), 8192).ok());
  EXPECT_EQ(registry.Register("b", object->key(), 8192).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(registry.Register("b", object->key(), 4096).ok());
  EXPECT_EQ(registry.Register("c", object->key(), 1).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(registry.Unregister("a").ok());
  EXPECT_TRUE(registry.Register("c", object->key(), 1).ok());
}

TEST(SharedMemoryRegistryTest, UnregisterNamesOneOrAll) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4096);
  ASSERT_TRUE(registry.Register("a", object->key(), 4096).ok());
  ASSERT_TRUE(registry.Register("b", object->key(), 4096).ok());
  EXPECT_EQ(registry.Unregister("c").code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Unregister("a").ok());
  EXPECT_EQ(registry.Find("a", "field").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(registry.Unregister("").ok());
  EXPECT_EQ(registry.size(), 0u);
}

TEST(SharedMemoryRegistryTest, ListNamesOneOrAllInOrder) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(8192);
  ASSERT_TRUE(registry.Register("b", object->key(), 8192).ok());
  ASSERT_TRUE(registry.Register("a", object->key(), 4096).ok());
  absl::StatusOr<std::vector<std::shared_ptr<const SharedMemoryRegion>>> all = registry.List("");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0]->name(), "a");
  EXPECT_EQ((*all)[0]->size(), 4096u);
  EXPECT_EQ((*all)[1]->name(), "b");
  EXPECT_EQ((*all)[1]->key(), object->key());
  absl::StatusOr<std::vector<std::shared_ptr<const SharedMemoryRegion>>> one = registry.List("b");
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0]->size(), 8192u);
  EXPECT_EQ(registry.List("c").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(registry.List("no/slash").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SharedMemoryRegistryTest, ListIsRefusedWhenOff) {
  SharedMemoryRegistry registry(0, 1 << 20);
  EXPECT_EQ(registry.List("").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.List("r").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SharedMemoryRegistryTest, AHolderKeepsAnUnregisteredRegionMapped) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4096);
  object->data()[100] = 42;
  ASSERT_TRUE(registry.Register("r", object->key(), 4096).ok());
  std::shared_ptr<const SharedMemoryRegion> held = *registry.Find("r", "field");
  ASSERT_TRUE(registry.Unregister("r").ok());
  object.reset();  // the client unmaps and removes the object too
  EXPECT_EQ(held->data()[100], 42);
}

// The object shrinks under a registered region: reads past its new end give zeros instead of SIGBUS, writes land
// nowhere, and the region says it is no longer intact.
TEST(SharedMemoryRegistryTest, AnObjectThatShrinksIsCaughtNotFatal) {
  SharedMemoryRegistry registry(4, 1 << 20);
  auto object = NewObject(4 * 4096);
  std::memset(object->data(), 7, 4 * 4096);
  ASSERT_TRUE(registry.Register("r", object->key(), 4 * 4096).ok());
  std::shared_ptr<const SharedMemoryRegion> region = *registry.Find("r", "field");
  Truncate(*object, 4096);

  volatile char* bytes = region->data();
  EXPECT_EQ(bytes[100], 7);       // still backed
  EXPECT_EQ(bytes[3 * 4096], 0);  // lost: reads zero
  bytes[2 * 4096] = 1;            // lost: lands nowhere
  const absl::Status intact = region->Intact();
  EXPECT_EQ(intact.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(intact.message()), HasSubstr("lost pages"));
}

// ---- The service ----

class SharedMemoryServiceTest : public ServiceTest {
 protected:
  void SetUp() override {
    spdlog::set_level(spdlog::level::warn);
    ServerOptions options;
    options.max_shared_memory_regions = 4;
    StartServer(options);
    object_ = NewObject(1 << 20);
    ASSERT_TRUE(Register("r", object_->key(), object_->size()).ok());
  }

  grpc::Status Register(const std::string& name, const std::string& key, uint64_t bytes) {
    v1::RegisterSharedMemoryRequest request;
    request.set_name(name);
    request.set_key(key);
    request.set_byte_size(bytes);
    v1::RegisterSharedMemoryResponse response;
    grpc::ClientContext context;
    return stub_->RegisterSharedMemory(&context, request, &response);
  }

  grpc::Status Status(const std::string& name, v1::GetSharedMemoryStatusResponse* response) {
    v1::GetSharedMemoryStatusRequest request;
    request.set_name(name);
    grpc::ClientContext context;
    return stub_->GetSharedMemoryStatus(&context, request, response);
  }

  // Moves `tensor`'s bytes to `offset` in the region and references them there.
  void Share(v1::Tensor* tensor, uint64_t offset) {
    std::memcpy(object_->data() + offset, tensor->data().data(), tensor->data().size());
    tensor->clear_data();
    tensor->mutable_shared_memory()->set_region("r");
    tensor->mutable_shared_memory()->set_offset(offset);
  }

  std::unique_ptr<SharedMemoryObject> object_;
};

TEST_F(SharedMemoryServiceTest, MultiHeadAttentionFromAndIntoSharedMemoryEqualsTheMessages) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  request.set_return_attention_weights(true);
  v1::MultiHeadAttentionResponse inline_response, shared_response;
  ASSERT_TRUE(Call(request, &inline_response).ok());

  Share(request.mutable_query(), 0);
  request.mutable_output_shared_memory()->set_region("r");
  request.mutable_output_shared_memory()->set_offset(65536);
  const grpc::Status status = Call(request, &shared_response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  const v1::Tensor& output = shared_response.output();
  EXPECT_TRUE(output.data().empty());
  EXPECT_EQ(output.shared_memory().region(), "r");
  EXPECT_EQ(output.shared_memory().offset(), 65536u);
  EXPECT_THAT(output.shape(), ::testing::ElementsAre(kBatch, kLen, kDModel));
  EXPECT_EQ(output.dtype(), v1::FP32);
  const std::string& want = inline_response.output().data();
  EXPECT_EQ(std::string(object_->data() + 65536, want.size()), want);  // bit for bit
  EXPECT_EQ(shared_response.attention_weights().data(), inline_response.attention_weights().data());
}

TEST_F(SharedMemoryServiceTest, KeyAndValueMayLieThereWhileTheOutputTravels) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  SetTensor(request.mutable_key(), {kBatch, 5, kDModel}, 7);
  SetTensor(request.mutable_value(), {kBatch, 5, kDModel}, 8, v1::BF16);
  v1::MultiHeadAttentionResponse inline_response, shared_response;
  ASSERT_TRUE(Call(request, &inline_response).ok());
  Share(request.mutable_key(), 4096);
  Share(request.mutable_value(), 8192);
  ASSERT_TRUE(Call(request, &shared_response).ok());
  EXPECT_EQ(shared_response.output().data(), inline_response.output().data());
}

TEST_F(SharedMemoryServiceTest, ScaledDotProductAttentionFromAndIntoSharedMemoryEqualsTheMessages) {
  v1::ScaledDotProductAttentionRequest request;
  SetTensor(request.mutable_q(), {2, 3, 4, 8}, 1);
  SetTensor(request.mutable_k(), {2, 5, 2, 8}, 2);
  SetTensor(request.mutable_v(), {2, 5, 2, 8}, 3);
  request.set_backend(v1::BACKEND_CPU);
  v1::ScaledDotProductAttentionResponse inline_response, shared_response;
  ASSERT_TRUE(Call(request, &inline_response).ok());
  Share(request.mutable_q(), 0);
  Share(request.mutable_k(), 4096);
  Share(request.mutable_v(), 8192);
  request.mutable_output_shared_memory()->set_region("r");
  request.mutable_output_shared_memory()->set_offset(12288);
  ASSERT_TRUE(Call(request, &shared_response).ok());
  const std::string& want = inline_response.output().data();
  EXPECT_EQ(std::string(object_->data() + 12288, want.size()), want);
}

struct BadReference {
  std::string label;
  std::function<void(v1::MultiHeadAttentionRequest*)> edit;
  grpc::StatusCode code;
  std::string says;
};

class SharedMemoryBadReferenceTest : public SharedMemoryServiceTest,
                                     public ::testing::WithParamInterface<BadReference> {};

TEST_P(SharedMemoryBadReferenceTest, IsRefusedNamingTheField) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  Share(request.mutable_query(), 0);
  GetParam().edit(&request);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), GetParam().code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(GetParam().says));
}

void SetQueryNonFinite(const SharedMemoryObject& object) {
  const float nan = std::nanf("");
  std::memcpy(object.data() + 5 * sizeof(float), &nan, sizeof(nan));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, SharedMemoryBadReferenceTest,
    ::testing::Values(
        BadReference{"UnknownRegion",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_query()->mutable_shared_memory()->set_region("x");
                     },
                     grpc::StatusCode::NOT_FOUND, "query.shared_memory.region"},
        BadReference{"MisalignedOffset",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_query()->mutable_shared_memory()->set_offset(2);
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "query.shared_memory.offset must be a multiple of 4"},
        BadReference{"PastTheEnd",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_query()->mutable_shared_memory()->set_offset((1 << 20) - 64);
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "passes the end of region 'r'"},
        BadReference{"OffsetOverflows",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_query()->mutable_shared_memory()->set_offset(~uint64_t{0} - 3);
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "passes the end of region 'r'"},
        BadReference{"DataToo",
                     [](v1::MultiHeadAttentionRequest* r) { r->mutable_query()->set_data("xxxx"); },
                     grpc::StatusCode::INVALID_ARGUMENT, "query.data must be empty"},
        BadReference{"OnTheMask",
                     [](v1::MultiHeadAttentionRequest* r) {
                       SetTensor(r->mutable_attn_mask(), {kLen, kLen}, 9);
                       r->mutable_attn_mask()->mutable_shared_memory()->set_region("r");
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "attn_mask.shared_memory is accepted only"},
        BadReference{"OnAWeight",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_inline_weights()->mutable_w_q()->mutable_shared_memory()->set_region("r");
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "shared_memory is accepted only"},
        BadReference{"OutputOverTheQuery",
                     [](v1::MultiHeadAttentionRequest* r) {
                       r->mutable_output_shared_memory()->set_region("r");
                       r->mutable_output_shared_memory()->set_offset(16);
                     },
                     grpc::StatusCode::INVALID_ARGUMENT, "must not overlap"},
        BadReference{"OutputInAnUnknownRegion",
                     [](v1::MultiHeadAttentionRequest* r) { r->mutable_output_shared_memory()->set_region("x"); },
                     grpc::StatusCode::NOT_FOUND, "output_shared_memory.region"}),
    [](const ::testing::TestParamInfo<BadReference>& info) { return info.param.label; });

// One object registered under two names is one place: an output in the second name over the query in the first
// overlaps it, whatever the two mappings' addresses; elsewhere in the object it does not.
TEST_F(SharedMemoryServiceTest, AnObjectRegisteredTwiceIsStillCheckedForOverlap) {
  ASSERT_TRUE(Register("alias", object_->key(), object_->size()).ok());
  v1::MultiHeadAttentionRequest request = ValidRequest();
  Share(request.mutable_query(), 0);
  request.mutable_output_shared_memory()->set_region("alias");
  request.mutable_output_shared_memory()->set_offset(16);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("must not overlap"));

  request.mutable_output_shared_memory()->set_offset(65536);
  const grpc::Status apart = Call(request, &response);
  EXPECT_TRUE(apart.ok()) << apart.error_message();
}

TEST_F(SharedMemoryServiceTest, ANonFiniteValueThereIsNamedLikeOneInTheMessage) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  Share(request.mutable_query(), 0);
  SetQueryNonFinite(*object_);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("query[0, 0, 5] is NaN"));
}

TEST_F(SharedMemoryServiceTest, RegistrationErrorsReachTheClient) {
  EXPECT_EQ(Register("r", object_->key(), 4096).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Register("s", "/mha_test_no_such_object", 4096).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Register("s", "no-slash", 4096).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::GetServerInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_EQ(info.limits().max_shared_memory_regions(), 4);
}

TEST_F(SharedMemoryServiceTest, StatusListsTheRegionsWithTheirKeysAndSizes) {
  auto other = NewObject(4096);
  ASSERT_TRUE(Register("a", other->key(), 1000).ok());
  v1::GetSharedMemoryStatusResponse all;
  ASSERT_TRUE(Status("", &all).ok());
  ASSERT_EQ(all.regions_size(), 2);
  EXPECT_EQ(all.regions(0).name(), "a");
  EXPECT_EQ(all.regions(0).key(), other->key());
  EXPECT_EQ(all.regions(0).byte_size(), 1000u);
  EXPECT_TRUE(all.regions(0).intact());
  EXPECT_EQ(all.regions(1).name(), "r");
  EXPECT_EQ(all.regions(1).byte_size(), object_->size());

  v1::GetSharedMemoryStatusResponse one;
  ASSERT_TRUE(Status("r", &one).ok());
  ASSERT_EQ(one.regions_size(), 1);
  EXPECT_EQ(one.regions(0).key(), object_->key());
}

TEST_F(SharedMemoryServiceTest, StatusOfAnUnknownRegionIsNotFound) {
  v1::GetSharedMemoryStatusResponse response;
  const grpc::Status status = Status("nope", &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("'nope'"));
  EXPECT_EQ(Status("bad name!", &response).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(SharedMemoryServiceTest, AnUnregisteredRegionTakesNoMoreCalls) {
  v1::UnregisterSharedMemoryRequest unregister;
  unregister.set_name("r");
  v1::UnregisterSharedMemoryResponse unregistered;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->UnregisterSharedMemory(&context, unregister, &unregistered).ok());
  v1::MultiHeadAttentionRequest request = ValidRequest();
  Share(request.mutable_query(), 0);
  v1::MultiHeadAttentionResponse response;
  EXPECT_EQ(Call(request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(SharedMemoryServiceTest, AShrunkRegionFailsItsCallsAndTheServerServesOn) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  Share(request.mutable_query(), 512 * 1024);
  Truncate(*object_, 4096);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("lost pages"));
  v1::GetSharedMemoryStatusResponse regions;
  ASSERT_TRUE(Status("r", &regions).ok());
  ASSERT_EQ(regions.regions_size(), 1);
  EXPECT_FALSE(regions.regions(0).intact());
  // TearDown's inline call checks that the server still serves.
}

// The object shrinks while the CPU backend's JIT code (oneDNN's sgemm, AVX-512 where the host has it) reads an input
// there or writes the output there. The SIGBUS that follows lands on a oneDNN thread (the caller's or an OpenMP
// worker's); its frame must go on an alternate stack, not below the JIT code's stack pointer, or the process dies
// with a corrupted heap. Each case runs a few times with a fresh object: the failure it guards against was seen in
// most runs, not all.
struct ShrinkCase {
  std::string label;
  bool sdpa;    // ScaledDotProductAttention, else MultiHeadAttention on the demo layer
  bool output;  // the output lies in the region (shrunk before the call), else the query (shrunk during compute)
};

void PrintTo(const ShrinkCase& c, std::ostream* os) { *os << c.label; }

class SharedMemoryShrinkTest : public SharedMemoryServiceTest, public ::testing::WithParamInterface<ShrinkCase> {
 protected:
  static constexpr int64_t kItems = 4, kTokens = 1024, kModel = 512, kSdpaHeads = 8, kHeadDim = 64;

  // A call large enough that the backend computes for tens of milliseconds, with its query or output at offset 0 of
  // region `name`.
  template <typename Request>
  void Place(Request* request, v1::Tensor* query, const std::string& name, SharedMemoryObject* object) {
    if (GetParam().output) {
      request->mutable_output_shared_memory()->set_region(name);
      return;
    }
    std::memcpy(object->data(), query->data().data(), query->data().size());
    query->clear_data();
    query->mutable_shared_memory()->set_region(name);
  }

  grpc::Status CallShrinking(const std::string& name, SharedMemoryObject* object) {
    std::function<grpc::Status()> call;
    v1::MultiHeadAttentionRequest mha;
    v1::ScaledDotProductAttentionRequest sdpa;
    if (GetParam().sdpa) {
      SetTensor(sdpa.mutable_q(), {kItems, kTokens, kSdpaHeads, kHeadDim}, 1);
      SetTensor(sdpa.mutable_k(), {kItems, kTokens, kSdpaHeads, kHeadDim}, 2);
      SetTensor(sdpa.mutable_v(), {kItems, kTokens, kSdpaHeads, kHeadDim}, 3);
      sdpa.set_backend(v1::BACKEND_CPU);
      Place(&sdpa, sdpa.mutable_q(), name, object);
      call = [&] {
        v1::ScaledDotProductAttentionResponse response;
        return Call(sdpa, &response);
      };
    } else {
      SetTensor(mha.mutable_query(), {kItems, kTokens, kModel}, 1);
      mha.set_layer("demo");
      mha.set_backend(v1::BACKEND_CPU);
      Place(&mha, mha.mutable_query(), name, object);
      call = [&] {
        v1::MultiHeadAttentionResponse response;
        return Call(mha, &response);
      };
    }
    if (GetParam().output) {
      Truncate(*object, 0);
      return call();
    }
    std::future<grpc::Status> status = std::async(std::launch::async, call);
    EXPECT_TRUE(server_->scheduler().AwaitRunning(absl::Seconds(30)));
    Truncate(*object, 0);
    return status.get();
  }
};

TEST_P(SharedMemoryShrinkTest, FailsTheCallAndTheServerServesOn) {
  for (int round = 0; round < 3; ++round) {
    const std::string name = "shrinking" + std::to_string(round);
    auto object = NewObject(kItems * kTokens * kModel * sizeof(float));
    ASSERT_TRUE(Register(name, object->key(), object->size()).ok());
    const grpc::Status status = CallShrinking(name, object.get());
    EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("lost pages"));
    v1::MultiHeadAttentionResponse response;
    EXPECT_TRUE(Call(ValidRequest(), &response).ok());
  }
}

INSTANTIATE_TEST_SUITE_P(
    Calls, SharedMemoryShrinkTest,
    ::testing::Values(ShrinkCase{"mha_input", false, false}, ShrinkCase{"mha_output", false, true},
                      ShrinkCase{"sdpa_input", true, false}, ShrinkCase{"sdpa_output", true, true}),
    [](const ::testing::TestParamInfo<ShrinkCase>& info) { return info.param.label; });

// Calls through one region while another is registered and unregistered over and over: every call either computes
// what the messages give or finds its region gone (NOT_FOUND); a region a call holds stays mapped until it is done.
TEST_F(SharedMemoryServiceTest, CallsRaceRegistrationSafely) {
  v1::MultiHeadAttentionRequest plain = ValidRequest();
  v1::MultiHeadAttentionResponse want;
  ASSERT_TRUE(Call(plain, &want).ok());
  auto other = NewObject(4096);
  std::memcpy(other->data(), plain.query().data().data(), plain.query().data().size());
  v1::MultiHeadAttentionRequest in_r = plain, in_s = plain;
  Share(in_r.mutable_query(), 0);
  in_s.mutable_query()->clear_data();
  in_s.mutable_query()->mutable_shared_memory()->set_region("s");

  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      Register("s", other->key(), 4096);  // ALREADY_EXISTS now and then is fine
      v1::UnregisterSharedMemoryRequest request;
      request.set_name("s");
      v1::UnregisterSharedMemoryResponse response;
      grpc::ClientContext context;
      stub_->UnregisterSharedMemory(&context, request, &response);
    }
  });
  std::vector<std::thread> callers;
  std::atomic<int> computed{0}, not_found{0}, wrong{0};
  for (int t = 0; t < 3; ++t) {
    callers.emplace_back([&, t] {
      for (int i = 0; i < 40; ++i) {
        v1::MultiHeadAttentionResponse response;
        const grpc::Status status = Call(t == 0 ? in_r : in_s, &response);
        if (status.ok() && response.output().data() == want.output().data()) {
          ++computed;
        } else if (status.error_code() == grpc::StatusCode::NOT_FOUND && t != 0) {
          ++not_found;
        } else {
          ++wrong;
        }
      }
    });
  }
  for (std::thread& caller : callers) caller.join();
  stop.store(true);
  churn.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_GE(computed.load(), 40);  // at least every call through the stable region
  EXPECT_EQ(computed.load() + not_found.load(), 120);
}

// The fixture's server runs with the default options: shared memory off.
using SharedMemoryOffTest = ServiceTest;

TEST_F(SharedMemoryOffTest, AServerWithoutRegionsRefusesRegistrationAndReferences) {
  auto object = NewObject(4096);
  v1::RegisterSharedMemoryRequest request;
  request.set_name("r");
  request.set_key(object->key());
  request.set_byte_size(4096);
  v1::RegisterSharedMemoryResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub_->RegisterSharedMemory(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_shared_memory_regions"));

  v1::MultiHeadAttentionRequest call = ValidRequest();
  call.mutable_query()->clear_data();
  call.mutable_query()->mutable_shared_memory()->set_region("r");
  v1::MultiHeadAttentionResponse answer;
  EXPECT_EQ(Call(call, &answer).error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  v1::GetSharedMemoryStatusResponse regions;
  grpc::ClientContext status_context;
  EXPECT_EQ(stub_->GetSharedMemoryStatus(&status_context, v1::GetSharedMemoryStatusRequest(), &regions).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

}  // namespace
}  // namespace mha::testing
