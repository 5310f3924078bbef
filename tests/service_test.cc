// The Attention service end to end through an in-process channel: OK paths, every rejected input with its exact
// status code and the field it names, and that the server keeps serving afterwards.
#include "server/rpc/service.h"

#include <chrono>
#include <functional>
#include <future>
#include <limits>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/mha/v1/attention.grpc.pb.h"
#include "proto/mha/v1/tensor_codec.h"
#include "server/app/server.h"
#include "server/backends/registry.h"
#include "tests/service_fixture.h"
#include "tests/test_util.h"

namespace mha {
namespace {

using ::mha::testing::AllClose;
using ::mha::testing::kBatch;
using ::mha::testing::kDModel;
using ::mha::testing::kHeads;
using ::mha::testing::kLen;
using ::mha::testing::RandomVector;
using ::mha::testing::ServiceTest;
using ::mha::testing::SetTensor;
using ::mha::testing::SlowDemoRequest;
using ::mha::testing::ValidRequest;
using ::testing::HasSubstr;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Sets element `index` (flat) of `t` to `value`, keeping its dtype.
void SetElement(v1::Tensor* t, int64_t index, float value) {
  std::vector<float> values = TensorToFloats(*t);
  values[index] = value;
  const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
  FloatsToTensor(values, shape, t->dtype(), t);
}

TEST_F(ServiceTest, InlineWeightsCpuMatchesReference) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  request.set_return_attention_weights(true);
  v1::MultiHeadAttentionResponse cpu, reference;
  ASSERT_TRUE(Call(request, &cpu).ok());
  request.set_backend(v1::BACKEND_REFERENCE);
  ASSERT_TRUE(Call(request, &reference).ok());
  EXPECT_EQ(cpu.backend(), "cpu");
  EXPECT_EQ(reference.backend(), "reference");
  EXPECT_THAT(cpu.output().shape(), ::testing::ElementsAre(kBatch, kLen, kDModel));
  EXPECT_THAT(cpu.attention_weights().shape(), ::testing::ElementsAre(kBatch, kHeads, kLen, kLen));
  EXPECT_EQ(cpu.output().dtype(), v1::FP32);
  EXPECT_TRUE(AllClose(TensorToFloats(cpu.output()), TensorToFloats(reference.output()), 1e-5, 1e-4));
  EXPECT_TRUE(AllClose(TensorToFloats(cpu.attention_weights()), TensorToFloats(reference.attention_weights()),
                       1e-6, 1e-4));
}

TEST_F(ServiceTest, StatisticsComeShapedAndOnlyWhenAskedFor) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  v1::MultiHeadAttentionResponse plain;
  ASSERT_TRUE(Call(request, &plain).ok());
  EXPECT_FALSE(plain.has_lse());
  EXPECT_FALSE(plain.has_head_stats());
  request.set_return_lse(true);
  request.set_return_head_stats(true);
  request.set_return_row_stats(true);
  v1::MultiHeadAttentionResponse cpu, reference;
  ASSERT_TRUE(Call(request, &cpu).ok());
  request.set_backend(v1::BACKEND_REFERENCE);
  ASSERT_TRUE(Call(request, &reference).ok());
  EXPECT_THAT(cpu.lse().shape(), ::testing::ElementsAre(kBatch, kHeads, kLen));
  EXPECT_EQ(cpu.lse().dtype(), v1::FP32);
  EXPECT_TRUE(AllClose(TensorToFloats(cpu.lse()), TensorToFloats(reference.lse()), 1e-5, 1e-4));
  EXPECT_EQ(cpu.head_stats().entropy_size(), kBatch * kHeads);
  EXPECT_EQ(cpu.head_stats().contribution_size(), kBatch * kHeads);
  EXPECT_EQ(cpu.row_stats().distance_size(), kBatch * kHeads * kLen);
  EXPECT_TRUE(AllClose({cpu.head_stats().normalized_entropy().begin(), cpu.head_stats().normalized_entropy().end()},
                       {reference.head_stats().normalized_entropy().begin(),
                        reference.head_stats().normalized_entropy().end()},
                       1e-5, 1e-4));
  // The output is unchanged by asking.
  EXPECT_EQ(cpu.output().data(), plain.output().data());
}

TEST_F(ServiceTest, StatisticsOptionsAreValidated) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  request.set_sink_tokens(-1);
  v1::MultiHeadAttentionResponse response;
  grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("sink_tokens"));
  request.set_sink_tokens(0);
  request.set_return_row_stats(true);
  status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), ::testing::HasSubstr("return_row_stats needs return_head_stats"));
}

TEST_F(ServiceTest, AutoBackendIsTheCpuWithoutAGpu) {
  v1::MultiHeadAttentionRequest request;
  SetTensor(request.mutable_query(), {1, 4, 512}, 7);
  request.set_layer("demo");
  v1::MultiHeadAttentionResponse response;
  ASSERT_TRUE(Call(request, &response).ok());
  EXPECT_EQ(response.backend(), "cpu");
  EXPECT_THAT(response.output().shape(), ::testing::ElementsAre(1, 4, 512));
}

// Compute requests of 64 KiB and more are read in pieces, scanned for inf and NaN on the way
// (server/calls/request_reader.h); smaller ones by protobuf, scanned by validation. Both answer alike.
TEST_F(ServiceTest, LargeRequestsNameTheirFirstNonFiniteElementInEveryDtype) {
  for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16}) {
    v1::MultiHeadAttentionRequest request;
    SetTensor(request.mutable_query(), {2, 64, 512}, 11, dtype);  // 128 KiB and more
    request.set_layer("demo");
    SetElement(request.mutable_query(), (64 + 5) * 512 + 17, kNaN);
    SetElement(request.mutable_query(), (64 + 9) * 512, kInf);
    v1::MultiHeadAttentionResponse response;
    const grpc::Status status = Call(request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << DTypeName(dtype);
    EXPECT_THAT(status.error_message(), HasSubstr("query[1, 5, 17] is NaN")) << DTypeName(dtype);
  }
  v1::MultiHeadAttentionRequest cross;
  SetTensor(cross.mutable_query(), {2, 64, 512}, 12);
  SetTensor(cross.mutable_key(), {2, 64, 512}, 13);
  cross.set_layer("demo");
  SetElement(cross.mutable_key(), 2 * 64 * 512 - 1, -kInf);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(cross, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("key[1, 63, 511] is -inf"));
}

TEST_F(ServiceTest, LargeRequestsComputeAsSmallOnesDo) {
  // Eight items of 16 tokens (256 KiB: read in pieces) against the first item alone (32 KiB: protobuf).
  v1::MultiHeadAttentionRequest large;
  SetTensor(large.mutable_query(), {8, 16, 512}, 14);
  large.set_layer("demo");
  large.set_return_attention_weights(true);
  v1::MultiHeadAttentionRequest small = large;
  const std::vector<float> values = TensorToFloats(large.query());
  FloatsToTensor(absl::MakeConstSpan(values).subspan(0, 16 * 512), {1, 16, 512}, v1::FP32, small.mutable_query());
  v1::MultiHeadAttentionResponse large_response, small_response;
  ASSERT_TRUE(Call(large, &large_response).ok());
  ASSERT_TRUE(Call(small, &small_response).ok());
  const std::vector<float> large_out = TensorToFloats(large_response.output());
  const std::vector<float> first(large_out.begin(), large_out.begin() + 16 * 512);
  EXPECT_TRUE(AllClose(first, TensorToFloats(small_response.output()), 1e-5, 1e-4));
  const std::vector<float> large_weights = TensorToFloats(large_response.attention_weights());
  const std::vector<float> first_weights(large_weights.begin(), large_weights.begin() + 8 * 16 * 16);
  EXPECT_TRUE(AllClose(first_weights, TensorToFloats(small_response.attention_weights()), 1e-6, 1e-4));
}

// Half-precision wire types: the server widens, computes in fp32 and answers in the query's dtype.
class WireDtypeTest : public ServiceTest, public ::testing::WithParamInterface<v1::DataType> {};

TEST_P(WireDtypeTest, AnswersInTheQueryDtypeAndMatchesFp32) {
  const v1::DataType dtype = GetParam();
  v1::MultiHeadAttentionRequest request = ValidRequest();
  v1::MultiHeadAttentionRequest fp32 = request;
  // Round the fp32 inputs through the wire dtype so both requests carry the same values.
  for (v1::Tensor* t : {request.mutable_query(), request.mutable_inline_weights()->mutable_w_q(),
                        request.mutable_inline_weights()->mutable_w_k(),
                        request.mutable_inline_weights()->mutable_w_v(),
                        request.mutable_inline_weights()->mutable_w_o()}) {
    const std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
    FloatsToTensor(TensorToFloats(*t), shape, dtype, t);
  }
  *fp32.mutable_query() = request.query();
  FloatsToTensor(TensorToFloats(request.query()), {kBatch, kLen, kDModel}, v1::FP32, fp32.mutable_query());
  for (auto [from, to] : {std::pair{&request.inline_weights().w_q(), fp32.mutable_inline_weights()->mutable_w_q()},
                          std::pair{&request.inline_weights().w_k(), fp32.mutable_inline_weights()->mutable_w_k()},
                          std::pair{&request.inline_weights().w_v(), fp32.mutable_inline_weights()->mutable_w_v()},
                          std::pair{&request.inline_weights().w_o(), fp32.mutable_inline_weights()->mutable_w_o()}}) {
    FloatsToTensor(TensorToFloats(*from), {kDModel, kDModel}, v1::FP32, to);
  }
  fp32.set_backend(v1::BACKEND_REFERENCE);
  v1::MultiHeadAttentionResponse got, want;
  ASSERT_TRUE(Call(request, &got).ok());
  ASSERT_TRUE(Call(fp32, &want).ok());
  EXPECT_EQ(got.output().dtype(), dtype);
  EXPECT_EQ(got.output().data().size(), static_cast<size_t>(kBatch * kLen * kDModel * 2));
  // Only the output's rounding to the wire dtype differs: bf16 keeps 8 bits of mantissa, fp16 11.
  const double rtol = dtype == v1::BF16 ? 1.0 / 128 : 1.0 / 1024;
  EXPECT_TRUE(AllClose(TensorToFloats(got.output()), TensorToFloats(want.output()), 1e-3, rtol));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, WireDtypeTest, ::testing::Values(v1::FP16, v1::BF16),
                         [](const auto& info) { return DTypeName(info.param); });

TEST_F(ServiceTest, WeightsAreAbsentUnlessRequested) {
  v1::MultiHeadAttentionResponse response;
  ASSERT_TRUE(Call(ValidRequest(), &response).ok());
  EXPECT_FALSE(response.has_attention_weights());
  v1::ScaledDotProductAttentionRequest sdpa;
  SetTensor(sdpa.mutable_q(), {1, 2, 2, 4}, 1);
  SetTensor(sdpa.mutable_k(), {1, 3, 2, 4}, 2);
  SetTensor(sdpa.mutable_v(), {1, 3, 2, 4}, 3);
  v1::ScaledDotProductAttentionResponse sdpa_response;
  ASSERT_TRUE(Call(sdpa, &sdpa_response).ok());
  EXPECT_FALSE(sdpa_response.has_attention_weights());
}

TEST_F(ServiceTest, OutputDtypeOverridesTheQueryDtype) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  request.set_output_dtype(v1::FP16);
  request.set_return_attention_weights(true);
  v1::MultiHeadAttentionResponse response;
  ASSERT_TRUE(Call(request, &response).ok());
  EXPECT_EQ(response.output().dtype(), v1::FP16);
  EXPECT_EQ(response.attention_weights().dtype(), v1::FP16);
}

TEST_F(ServiceTest, ScaledDotProductAttentionCpuMatchesReference) {
  v1::ScaledDotProductAttentionRequest request;
  SetTensor(request.mutable_q(), {2, 3, 4, 8}, 1);
  SetTensor(request.mutable_k(), {2, 5, 2, 8}, 2);
  SetTensor(request.mutable_v(), {2, 5, 2, 8}, 3);
  request.mutable_heads()->set_causal(true);
  request.add_key_lengths(5);
  request.add_key_lengths(2);
  request.set_return_attention_weights(true);
  request.set_backend(v1::BACKEND_CPU);
  v1::ScaledDotProductAttentionResponse cpu, reference;
  ASSERT_TRUE(Call(request, &cpu).ok());
  request.set_backend(v1::BACKEND_REFERENCE);
  ASSERT_TRUE(Call(request, &reference).ok());
  EXPECT_THAT(cpu.output().shape(), ::testing::ElementsAre(2, 3, 4, 8));
  EXPECT_TRUE(AllClose(TensorToFloats(cpu.output()), TensorToFloats(reference.output()), 1e-5, 1e-4));
  EXPECT_TRUE(AllClose(TensorToFloats(cpu.attention_weights()), TensorToFloats(reference.attention_weights()),
                       1e-6, 1e-4));
}

TEST_F(ServiceTest, LoadedLayerAnswersLikeTheSameInlineWeights) {
  const v1::MultiHeadAttentionRequest inline_request = ValidRequest();
  v1::LoadLayerRequest load;
  load.set_name("small");
  *load.mutable_weights() = inline_request.inline_weights();
  load.mutable_heads()->set_num_heads(kHeads);
  v1::LoadLayerResponse loaded;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->LoadLayer(&context, load, &loaded).ok());
  }
  EXPECT_EQ(loaded.layer().heads().head_dim(), kDModel / kHeads);
  v1::MultiHeadAttentionRequest by_name = inline_request;
  by_name.set_layer("small");
  by_name.clear_heads();
  v1::MultiHeadAttentionResponse a, b;
  ASSERT_TRUE(Call(inline_request, &a).ok());
  ASSERT_TRUE(Call(by_name, &b).ok());
  EXPECT_TRUE(AllClose(TensorToFloats(b.output()), TensorToFloats(a.output()), 1e-6, 1e-5));

  v1::ListLayersResponse list;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->ListLayers(&context, v1::ListLayersRequest(), &list).ok());
  }
  ASSERT_EQ(list.layers_size(), 2);
  EXPECT_EQ(list.layers(0).name(), "demo");
  EXPECT_EQ(list.layers(1).name(), "small");

  v1::UnloadLayerRequest unload;
  unload.set_name("small");
  v1::UnloadLayerResponse unloaded;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->UnloadLayer(&context, unload, &unloaded).ok());
  }
  EXPECT_EQ(Call(by_name, &b).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ABooleanKeepMaskMatchesTheAdditiveMaskItMeans) {
  std::vector<float> keep(kLen * kLen), additive(kLen * kLen);
  for (int i = 0; i < kLen * kLen; ++i) {
    keep[i] = (i % 3 == 1) ? 0.0f : 1.0f;
    additive[i] = keep[i] == 1.0f ? 0.0f : -kInf;
  }
  v1::MultiHeadAttentionRequest with_keep = ValidRequest(), with_additive = ValidRequest();
  FloatsToTensor(keep, {kLen, kLen}, v1::FP32, with_keep.mutable_attn_mask());
  with_keep.set_attn_mask_type(v1::MASK_KEEP);
  FloatsToTensor(additive, {kLen, kLen}, v1::FP32, with_additive.mutable_attn_mask());
  v1::MultiHeadAttentionResponse a, b;
  ASSERT_TRUE(Call(with_keep, &a).ok());
  ASSERT_TRUE(Call(with_additive, &b).ok());
  EXPECT_EQ(a.output().data(), b.output().data());

  keep[4] = 0.5f;
  FloatsToTensor(keep, {kLen, kLen}, v1::FP32, with_keep.mutable_attn_mask());
  const grpc::Status status = Call(with_keep, &a);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("attn_mask element 4 is 0.5; with MASK_KEEP every value must be 1"));
}

TEST_F(ServiceTest, InlineHeadDimIsInferredFromTheWeights) {
  // H x d_k = 2 x 8 = 16 columns for d_model 8: head_dim is not d_model / H, and the weights say what it is.
  v1::MultiHeadAttentionRequest request = ValidRequest();
  v1::AttentionWeights* w = request.mutable_inline_weights();
  SetTensor(w->mutable_w_q(), {kDModel, 16}, 2);
  SetTensor(w->mutable_w_k(), {kDModel, 16}, 3);
  SetTensor(w->mutable_w_v(), {kDModel, 16}, 4);
  SetTensor(w->mutable_w_o(), {16, kDModel}, 5);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.output().shape(2), kDModel);
}

TEST_F(ServiceTest, LoadLayerRejectsATakenName) {
  v1::LoadLayerRequest load;
  load.set_name("demo");
  *load.mutable_weights() = ValidRequest().inline_weights();
  load.mutable_heads()->set_num_heads(kHeads);
  v1::LoadLayerResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->LoadLayer(&context, load, &response).error_code(), grpc::StatusCode::ALREADY_EXISTS);
}

TEST_F(ServiceTest, LoadLayerRejectsABadName) {
  v1::LoadLayerRequest load;
  load.set_name("../etc/passwd");
  *load.mutable_weights() = ValidRequest().inline_weights();
  load.mutable_heads()->set_num_heads(kHeads);
  v1::LoadLayerResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub_->LoadLayer(&context, load, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("name"));
}

TEST_F(ServiceTest, LoadLayerNamesAreNeverEchoedRaw) {
  for (const std::string& name : {std::string("evil\nrid=1 status=OK"), std::string(20 << 20, 'x')}) {
    v1::LoadLayerRequest load;
    load.set_name(name);
    *load.mutable_weights() = ValidRequest().inline_weights();
    load.mutable_heads()->set_num_heads(kHeads);
    v1::LoadLayerResponse response;
    grpc::ClientContext context;
    const grpc::Status status = stub_->LoadLayer(&context, load, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("name "));
    EXPECT_LT(status.error_message().size(), 200u);
    EXPECT_EQ(status.error_message().find('\n'), std::string::npos);
  }
}

TEST_F(ServiceTest, LoadLayerRejectsNonFiniteWeights) {
  v1::LoadLayerRequest load;
  load.set_name("nan_layer");
  *load.mutable_weights() = ValidRequest().inline_weights();
  SetElement(load.mutable_weights()->mutable_w_o(), 10, kNaN);
  load.mutable_heads()->set_num_heads(kHeads);
  v1::LoadLayerResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub_->LoadLayer(&context, load, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("weights.w_o[1, 2] is NaN"));
}

TEST_F(ServiceTest, TheClientsRequestIdComesBackAndOthersGetOne) {
  auto request_id = [&](const char* given) {
    grpc::ClientContext context;
    if (given != nullptr) context.AddMetadata("x-request-id", given);
    v1::MultiHeadAttentionResponse response;
    EXPECT_TRUE(stub_->MultiHeadAttention(&context, ValidRequest(), &response).ok());
    const auto& metadata = context.GetServerInitialMetadata();
    const auto it = metadata.find("x-request-id");
    return it == metadata.end() ? std::string("<none>") : std::string(it->second.data(), it->second.size());
  };
  EXPECT_EQ(request_id("checkout-7f3a/42"), "checkout-7f3a/42");
  const std::string generated = request_id(nullptr);
  EXPECT_THAT(generated, ::testing::MatchesRegex("[0-9a-f]{8}-[0-9a-f]+"));
  EXPECT_NE(request_id(nullptr), generated);
  // An id that could garble a log line, or is too long, is replaced, not echoed.
  EXPECT_THAT(request_id("a b=c status=OK"), ::testing::MatchesRegex("[0-9a-f]{8}-[0-9a-f]+"));
  EXPECT_THAT(request_id(std::string(200, 'a').c_str()), ::testing::MatchesRegex("[0-9a-f]{8}-[0-9a-f]+"));
}

TEST_F(ServiceTest, EveryResponseNamesTheInstanceThatServedIt) {
  grpc::ClientContext info_context;
  v1::GetServerInfoResponse info;
  ASSERT_TRUE(stub_->GetServerInfo(&info_context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_THAT(info.instance_id(), ::testing::MatchesRegex("[A-Za-z0-9._-]+/[0-9a-f]{8}"));
  const auto instance = [](const grpc::ClientContext& context) {
    const auto& metadata = context.GetServerInitialMetadata();
    const auto it = metadata.find("mha-instance-id");
    return it == metadata.end() ? std::string("<none>") : std::string(it->second.data(), it->second.size());
  };
  EXPECT_EQ(instance(info_context), info.instance_id());
  grpc::ClientContext ok_context, error_context;
  v1::MultiHeadAttentionResponse response;
  EXPECT_TRUE(stub_->MultiHeadAttention(&ok_context, ValidRequest(), &response).ok());
  EXPECT_EQ(instance(ok_context), info.instance_id());
  v1::MultiHeadAttentionRequest bad = ValidRequest();
  bad.set_sink_tokens(-1);
  EXPECT_FALSE(stub_->MultiHeadAttention(&error_context, bad, &response).ok());
  EXPECT_EQ(instance(error_context), info.instance_id());  // errors too
}

TEST_F(ServiceTest, UnparsableRequestBytesAreInvalidArgument) {
  grpc::GenericStub generic(server_->InProcessChannel());
  for (const char* method : {"/mha.v1.Attention/MultiHeadAttention", "/mha.v1.Attention/LoadLayer",
                             "/inference.GRPCInferenceService/ModelInfer"}) {
    const std::string junk = "\xff\xff\xff\xff not a protobuf message";
    grpc::Slice slice(junk);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::ClientContext context;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&](grpc::Status status) { done.set_value(status); });
    const grpc::Status status = done.get_future().get();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << method;
    EXPECT_THAT(status.error_message(), HasSubstr("does not parse as "));
  }
}

// A call that ends before its request message arrives (a client cancelling while it sends; here, deterministically,
// one that half-closes without a message) reaches the handler with no payload: counted as cancelled, not as a
// request that does not parse.
TEST_F(ServiceTest, CallEndedBeforeItsRequestArrivedIsCancelled) {
  grpc::GenericStub generic(server_->InProcessChannel());
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      generic.PrepareCall(&context, "/mha.v1.Attention/MultiHeadAttention", &cq);
  auto step = [&cq](int tag) {
    void* got = nullptr;
    bool ok = false;
    ASSERT_TRUE(cq.Next(&got, &ok));
    EXPECT_EQ(got, reinterpret_cast<void*>(static_cast<intptr_t>(tag)));
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  call->WritesDone(reinterpret_cast<void*>(2));
  step(2);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(3));
  step(3);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_THAT(status.error_message(), HasSubstr("no request message arrived"));
  EXPECT_THAT(server_->metrics().Text(),
              HasSubstr("mha_requests_total{backend=\"\",code=\"CANCELLED\",rpc=\"MultiHeadAttention\"} 1"));
  cq.Shutdown();
  void* ignored;
  bool ok;
  while (cq.Next(&ignored, &ok)) {
  }
}

// Over TCP a call that ends before its request message arrives reaches the handler without a payload whether its
// client cancelled it or its deadline passed (the in-process transport never starts the handler for the latter): the
// server counts it with the code its client saw.
struct EndedWithoutMessageCase {
  const char* name;
  bool cancel;  // the client cancels at once; otherwise a 300 ms deadline passes
  grpc::StatusCode code;  // what the client sees, and the code label the server counts it under
};

class EndedWithoutMessageOverTcpTest : public ::testing::TestWithParam<EndedWithoutMessageCase> {};

TEST_P(EndedWithoutMessageOverTcpTest, IsCountedWithTheCodeItsClientSaw) {
  spdlog::set_level(spdlog::level::warn);
  std::unique_ptr<MhaServer> server = mha::testing::StartLoopbackServer();
  ASSERT_NE(server, nullptr);
  grpc::GenericStub generic(
      grpc::CreateChannel(absl::StrCat("127.0.0.1:", server->port()), grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  const std::chrono::milliseconds deadline =
      GetParam().cancel ? std::chrono::milliseconds(std::chrono::hours(1)) : std::chrono::milliseconds(300);
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call =
      generic.PrepareCall(&context, "/mha.v1.Attention/MultiHeadAttention", &cq);
  void* tag = nullptr;
  bool ok = false;
  call->StartCall(reinterpret_cast<void*>(1));  // headers only; the message never follows
  ASSERT_TRUE(cq.Next(&tag, &ok));
  if (GetParam().cancel) context.TryCancel();
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(2));
  ASSERT_TRUE(cq.Next(&tag, &ok));
  EXPECT_EQ(tag, reinterpret_cast<void*>(2));
  EXPECT_EQ(status.error_code(), GetParam().code);
  // The server counts the call when its handler ends, which may be after the client saw its status.
  const std::string counted =
      absl::StrCat("mha_requests_total{backend=\"\",code=\"",
                   absl::StatusCodeToString(static_cast<absl::StatusCode>(GetParam().code)),
                   "\",rpc=\"MultiHeadAttention\"} 1");
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up && !absl::StrContains(server->metrics().Text(), counted)) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  const std::string text = server->metrics().Text();
  EXPECT_THAT(text, HasSubstr(counted));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("code=\"INVALID_ARGUMENT\"")));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transport, EndedWithoutMessageOverTcpTest,
    ::testing::Values(EndedWithoutMessageCase{"DeadlinePassed", false, grpc::StatusCode::DEADLINE_EXCEEDED},
                      EndedWithoutMessageCase{"ClientCancelled", true, grpc::StatusCode::CANCELLED}),
    [](const ::testing::TestParamInfo<EndedWithoutMessageCase>& info) { return std::string(info.param.name); });

TEST_F(ServiceTest, LoadLayerPastTheMemoryLimitIsResourceExhausted) {
  ServerOptions options;
  options.max_layer_mb = 4;  // exactly the demo layer: 4 weights of 1 MiB, held once
  StartServer(options);
  v1::LoadLayerRequest load;
  load.set_name("one_more");
  *load.mutable_weights() = ValidRequest().inline_weights();
  load.mutable_heads()->set_num_heads(kHeads);
  v1::LoadLayerResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->LoadLayer(&context, load, &response).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
}

TEST_F(ServiceTest, UnloadingTheDemoLayerIsRefused) {
  v1::UnloadLayerRequest unload;
  unload.set_name("demo");
  v1::UnloadLayerResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->UnloadLayer(&context, unload, &response).error_code(), grpc::StatusCode::FAILED_PRECONDITION);
}

TEST_F(ServiceTest, UnloadingAnUnknownLayerIsNotFound) {
  v1::UnloadLayerRequest unload;
  unload.set_name("nope");
  v1::UnloadLayerResponse response;
  grpc::ClientContext context;
  EXPECT_EQ(stub_->UnloadLayer(&context, unload, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(ServerOptionsTest, InlineLimitAboveTheSerialThresholdIsRejected) {
  ServerOptions options;
  options.listen = "";
  options.inline_max_mflop = 50;
  EXPECT_EQ(MhaServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ServerOptionsTest, CudaFlagsOutOfRangeAreRejectedNamingTheFlag) {
  struct Bad {
    void (*set)(ServerOptions&);
    const char* flag;
  };
  const Bad cases[] = {
      {[](ServerOptions& o) { o.cuda_device = -1; }, "--cuda_device"},
      {[](ServerOptions& o) { o.cuda_streams = 0; }, "--cuda_streams"},
      {[](ServerOptions& o) { o.cuda_streams = 17; }, "--cuda_streams"},
      {[](ServerOptions& o) { o.cuda_layer_cache_mb = -1; }, "--cuda_layer_cache_mb"},
  };
  for (const Bad& bad : cases) {
    ServerOptions options;
    options.listen = "";
    bad.set(options);
    const absl::Status status = MhaServer::Start(options).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad.flag;
    EXPECT_THAT(status.message(), ::testing::HasSubstr(bad.flag));
  }
}

TEST_F(ServiceTest, ServerInfoListsBackendsAndLimits) {
  v1::GetServerInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.version().empty());
  std::map<std::string, bool> available;
  std::map<std::string, std::string> detail;
  for (const auto& b : info.backends()) {
    available[b.name()] = b.available();
    detail[b.name()] = b.detail();
  }
  EXPECT_TRUE(available["cpu"]);
  EXPECT_TRUE(available["reference"]);
  // CUDA is always listed: not compiled in, compiled in without a usable GPU (with the driver's reason), or
  // available, and then what BACKEND_AUTO means.
  ASSERT_TRUE(available.count("cuda"));
  if (available["cuda"]) {
    EXPECT_EQ(info.default_backend(), "cuda");
  } else {
    EXPECT_EQ(info.default_backend(), "cpu");
    EXPECT_FALSE(detail["cuda"].empty());
  }
  EXPECT_EQ(info.limits().max_message_bytes(), 256 << 20);
  EXPECT_EQ(info.limits().compute_threads(), 2);
  EXPECT_EQ(info.limits().max_queued_bytes(), int64_t{1024} << 20);
  EXPECT_EQ(info.limits().max_layers(), 256);
}

TEST_F(ServiceTest, ResponseOverTheMessageLimitIsResourceExhausted) {
  ServerOptions options;
  options.max_message_mb = 1;
  StartServer(options);
  v1::MultiHeadAttentionRequest request = ValidRequest();
  SetTensor(request.mutable_query(), {2, 300, kDModel}, 1);
  request.set_return_attention_weights(true);  // [2, 2, 300, 300] fp32 = 1.44 MB of weights
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("output_dtype FP16"));
}

TEST_F(ServiceTest, AttentionWorkOverTheLimitIsResourceExhausted) {
  ServerOptions options;
  options.max_request_gflop = 0.001;
  StartServer(options);
  v1::MultiHeadAttentionRequest request = ValidRequest();
  SetTensor(request.mutable_query(), {2, 300, kDModel}, 1);  // attention alone: 4 * 2 * 2 * 300 * 300 * 4 = 5.8 MFLOP
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_request_gflop"));
}

TEST_F(ServiceTest, WorkingMemoryOverTheLimitIsResourceExhausted) {
  ServerOptions options;
  options.max_scratch_mb = 1;
  StartServer(options);
  v1::MultiHeadAttentionRequest request = ValidRequest();
  // Q, K, V and the concatenated heads alone: 2 * 5000 * (4 * 8) floats, 1.3 MB over 1 MiB.
  SetTensor(request.mutable_query(), {2, 5000, kDModel}, 1);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr("--max_scratch_mb"));
}

TEST_F(ServiceTest, FullyMaskedRowsGiveTheOutputBiasNotNaN) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  SetTensor(request.mutable_inline_weights()->mutable_b_o(), {kDModel}, 9);
  request.add_key_lengths(0);  // batch item 0 sees no key
  request.add_key_lengths(kLen);
  request.set_return_attention_weights(true);
  v1::MultiHeadAttentionResponse response;
  ASSERT_TRUE(Call(request, &response).ok());
  const std::vector<float> out = TensorToFloats(response.output());
  const std::vector<float> bias = TensorToFloats(request.inline_weights().b_o());
  for (int64_t i = 0; i < kLen; ++i) {
    for (int64_t c = 0; c < kDModel; ++c) EXPECT_EQ(out[i * kDModel + c], bias[c]);
  }
  const std::vector<float> weights = TensorToFloats(response.attention_weights());
  for (int64_t i = 0; i < kHeads * kLen * kLen; ++i) EXPECT_EQ(weights[i], 0.0f);
}

TEST_F(ServiceTest, HealthyWhileALongRequestComputes) {
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(4));
  const auto start = std::chrono::steady_clock::now();
  v1::GetServerInfoResponse info;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->GetServerInfo(&context, v1::GetServerInfoRequest(), &info).ok());
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(slow->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the slow request finished too early to prove anything; make it bigger";
  EXPECT_LT(waited, std::chrono::milliseconds(500));
  CancelAndWait(slow.get());
}

// A tiny request next to a long one: computed on the gRPC thread by default, so it does not queue behind it.
class InlineTest : public ServiceTest, public ::testing::WithParamInterface<bool> {};

TEST_P(InlineTest, TinyRequestsSkipTheQueueOnlyWhenInlineIsOn) {
  const bool inline_on = GetParam();
  ServerOptions options;
  options.inline_max_mflop = inline_on ? 4 : 0;
  StartServer(options);
  std::unique_ptr<BackgroundCall> slow = Start(SlowDemoRequest(4));
  // 2 x 3 tokens, d_model 8: a few kFLOP on the cpu backend.
  std::unique_ptr<BackgroundCall> tiny = Start(ValidRequest(), /*computing=*/false);
  if (inline_on) {
    ASSERT_TRUE(tiny->status.get().ok());
    EXPECT_EQ(tiny->response.timing().queue_us(), 0);
    EXPECT_EQ(slow->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
        << "the long request finished first, so this proves nothing; make it longer";
    CancelAndWait(slow.get());
  } else {
    // It waits in the queue behind the long request, and is answered only once that one ends.
    ASSERT_TRUE(server_->scheduler().AwaitQueued(1, absl::Seconds(30)));
    const absl::Time queued = absl::Now();
    EXPECT_EQ(tiny->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout);
    ASSERT_EQ(slow->status.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
        << "the long request finished first, so this proves nothing; make it longer";
    const absl::Duration behind = absl::Now() - queued;  // at least this long in the queue
    CancelAndWait(slow.get());
    ASSERT_TRUE(tiny->status.get().ok());
    EXPECT_GE(tiny->response.timing().queue_us(), absl::ToInt64Microseconds(behind))
        << "it should have waited for the long request";
  }
}

INSTANTIATE_TEST_SUITE_P(Inline, InlineTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "On" : "Off"; });

// A queue limit: how to set it, and the flag its refusal names.
struct QueueLimit {
  std::string name;
  void (*set)(ServerOptions*);
  std::string flag;
};

std::ostream& operator<<(std::ostream& os, const QueueLimit& c) { return os << c.name; }

class QueueLimitTest : public ServiceTest, public ::testing::WithParamInterface<QueueLimit> {};

// One call computes, one waits, and the next is refused by the limit, naming its flag.
TEST_P(QueueLimitTest, TheCallPastTheLimitIsResourceExhausted) {
  ServerOptions options;
  GetParam().set(&options);
  StartServer(options);
  std::unique_ptr<BackgroundCall> computing = Start(SlowDemoRequest(4));
  std::unique_ptr<BackgroundCall> waiting = Start(SlowDemoRequest(4), /*computing=*/false);
  ASSERT_TRUE(server_->scheduler().AwaitQueued(1, absl::Seconds(30)));
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(SlowDemoRequest(4), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(status.error_message(), HasSubstr(GetParam().flag));
  CancelAndWait(waiting.get());
  CancelAndWait(computing.get());
}

INSTANTIATE_TEST_SUITE_P(
    Limits, QueueLimitTest,
    ::testing::Values(QueueLimit{"FullQueue", [](ServerOptions* o) { o->max_queue_size = 1; }, "--max_queue_size"},
                      // each request carries 2 MiB: one may wait alone, the next is refused
                      QueueLimit{"QueuedBytes", [](ServerOptions* o) { o->max_queued_mb = 1; }, "--max_queued_mb"}),
    [](const auto& info) { return info.param.name; });

// One rejected MultiHeadAttention input: how to break a valid request, and the status it must get.
struct BadInput {
  std::string name;
  std::function<void(v1::MultiHeadAttentionRequest*)> mutate;
  grpc::StatusCode code;
  std::string message;  // a substring the message must contain (the field name, expected vs given)
};

std::ostream& operator<<(std::ostream& os, const BadInput& c) { return os << c.name; }

v1::Tensor* Query(v1::MultiHeadAttentionRequest* r) { return r->mutable_query(); }
v1::AttentionWeights* Weights(v1::MultiHeadAttentionRequest* r) { return r->mutable_inline_weights(); }

std::vector<BadInput> BadInputs() {
  using R = v1::MultiHeadAttentionRequest;
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  return {
      {"missing_query", [](R* r) { r->clear_query(); }, kInvalid, "query is required"},
      {"unspecified_dtype", [](R* r) { Query(r)->set_dtype(v1::DATA_TYPE_UNSPECIFIED); }, kInvalid,
       "query.dtype must be FP32, FP16 or BF16, got unspecified"},
      {"unknown_dtype", [](R* r) { Query(r)->set_dtype(static_cast<v1::DataType>(9)); }, kInvalid,
       "query.dtype must be FP32, FP16 or BF16, got dtype(9)"},
      {"short_data", [](R* r) { Query(r)->mutable_data()->resize(10); }, kInvalid,
       "query.data has 10 bytes, expected 192"},
      {"wrong_rank", [](R* r) { Query(r)->mutable_shape()->RemoveLast(); }, kInvalid,
       "query must have rank 3 [B, Tq, d_model], got shape [2, 3]"},
      {"zero_dim", [](R* r) { Query(r)->set_shape(1, 0); }, kInvalid, "query.shape[1] must be >= 1, got 0"},
      {"negative_dim", [](R* r) { Query(r)->set_shape(0, -2); }, kInvalid, "query.shape[0] must be >= 1, got -2"},
      {"overflowing_shape",
       [](R* r) {
         Query(r)->set_shape(0, int64_t{1} << 40);
         Query(r)->set_shape(1, int64_t{1} << 40);
       },
       kInvalid, "overflow"},
      {"query_nan", [](R* r) { SetElement(Query(r), 13, kNaN); }, kInvalid,
       "query[0, 1, 5] is NaN; every value of an input tensor must be finite"},
      {"query_fp16_inf",
       [](R* r) {
         SetTensor(Query(r), {kBatch, kLen, kDModel}, 1, v1::FP16);
         SetElement(Query(r), 47, -kInf);
       },
       kInvalid, "query[1, 2, 7] is -inf"},
      {"query_bf16_nan",
       [](R* r) {
         SetTensor(Query(r), {kBatch, kLen, kDModel}, 1, v1::BF16);
         SetElement(Query(r), 0, kNaN);
       },
       kInvalid, "query[0, 0, 0] is NaN"},
      {"key_inf",
       [](R* r) {
         SetTensor(r->mutable_key(), {kBatch, 4, kDModel}, 7);
         SetTensor(r->mutable_value(), {kBatch, 4, kDModel}, 8);
         SetElement(r->mutable_key(), 9, kInf);
       },
       kInvalid, "key[0, 1, 1] is inf"},
      {"inline_weight_nan", [](R* r) { SetElement(Weights(r)->mutable_w_k(), 63, kNaN); }, kInvalid,
       "inline_weights.w_k[7, 7] is NaN"},
      {"inline_bias_inf",
       [](R* r) {
         SetTensor(Weights(r)->mutable_b_o(), {kDModel}, 9);
         SetElement(Weights(r)->mutable_b_o(), 2, kInf);
       },
       kInvalid, "inline_weights.b_o[2] is inf"},
      {"layer_name_with_a_newline", [](R* r) { r->set_layer("demo\nforged log line"); }, kInvalid,
       "layer may only hold [A-Za-z0-9._-]; character 4 is '\\n'"},
      {"layer_name_too_long", [](R* r) { r->set_layer(std::string(10000, 'a')); }, kInvalid,
       "layer must be 1..128 characters of [A-Za-z0-9._-], got 10000"},
      {"no_weights", [](R* r) { r->clear_weights(); }, kInvalid, "set either layer"},
      {"unknown_layer", [](R* r) { r->set_layer("nope"); }, grpc::StatusCode::NOT_FOUND, "no layer named 'nope'"},
      {"inline_without_heads", [](R* r) { r->clear_heads(); }, kInvalid, "heads is required"},
      {"zero_heads", [](R* r) { r->mutable_heads()->set_num_heads(0); }, kInvalid,
       "heads.num_heads must be >= 1, got 0"},
      {"negative_heads", [](R* r) { r->mutable_heads()->set_num_heads(-4); }, kInvalid,
       "heads.num_heads must be >= 1, got -4"},
      {"kv_heads_not_dividing", [](R* r) { r->mutable_heads()->set_num_kv_heads(3); }, kInvalid,
       "heads.num_kv_heads (3) must divide num_heads (2)"},
      {"head_dim_not_matching_weights", [](R* r) { r->mutable_heads()->set_head_dim(3); }, kInvalid,
       "inline_weights.w_q.shape must be [8, 6] (rows: the query's d_model, 8; columns: num_heads x head_dim = 2 x 3, "
       "head_dim from heads.head_dim), got [8, 8]"},
      {"heads_not_dividing_d_model", [](R* r) { r->mutable_heads()->set_num_heads(3); }, kInvalid,
       "d_model (8) must be divisible by num_heads (3)"},
      {"non_finite_scale", [](R* r) { r->mutable_heads()->set_scale(kNaN); }, kInvalid, "heads.scale must be finite"},
      {"w_o_wrong_shape", [](R* r) { SetTensor(Weights(r)->mutable_w_o(), {8, 4}, 1); }, kInvalid,
       "inline_weights.w_o.shape must be [8, 8] (rows: num_heads x head_dim = 2 x 4"},
      {"w_k_rank_1", [](R* r) { SetTensor(Weights(r)->mutable_w_k(), {64}, 1); }, kInvalid,
       "inline_weights.w_k must be a 2-d tensor"},
      {"b_q_wrong_size", [](R* r) { SetTensor(Weights(r)->mutable_b_q(), {7}, 1); }, kInvalid,
       "inline_weights.b_q.shape must be [8] (num_heads x head_dim = 2 x 4"},
      {"query_d_model_mismatch", [](R* r) { SetTensor(Query(r), {2, 3, 16}, 1); }, kInvalid,
       "inline_weights.w_q.shape must be [16, 8] (rows: the query's d_model, 16;"},
      {"query_d_model_mismatch_demo",
       [](R* r) {
         r->set_layer("demo");
         r->clear_heads();
       },
       kInvalid, "query.shape[2] (d_model) must be 512 for layer 'demo', got 8"},
      {"heads_disagree_with_layer",
       [](R* r) {
         r->set_layer("demo");
         SetTensor(Query(r), {1, 2, 512}, 1);
         r->mutable_heads()->set_num_heads(4);
       },
       kInvalid, "heads.num_heads is 4, which disagrees with layer 'demo' (8)"},
      {"key_batch_mismatch", [](R* r) { SetTensor(r->mutable_key(), {3, 5, 8}, 1); }, kInvalid,
       "key.shape[0] (B) must be 2"},
      {"key_features_mismatch", [](R* r) { SetTensor(r->mutable_key(), {2, 5, 6}, 1); }, kInvalid,
       "inline_weights.w_k.shape must be [6, 8] (rows: the key's features, 6;"},
      {"value_length_mismatch",
       [](R* r) {
         SetTensor(r->mutable_key(), {2, 5, 8}, 1);
         SetTensor(r->mutable_value(), {2, 4, 8}, 1);
       },
       kInvalid, "value.shape[1] (Tk) must be 5"},
      {"value_rank", [](R* r) { SetTensor(r->mutable_value(), {2, 3, 8, 1}, 1); }, kInvalid,
       "value must have rank 3"},
      {"key_lengths_count",
       [](R* r) {
         r->add_key_lengths(1);
       },
       kInvalid, "key_lengths must have one entry per batch item (2), got 1"},
      {"key_lengths_too_long",
       [](R* r) {
         r->add_key_lengths(1);
         r->add_key_lengths(4);
       },
       kInvalid, "key_lengths[1] must be in [0, 3] (Tk), got 4"},
      {"key_lengths_negative",
       [](R* r) {
         r->add_key_lengths(-1);
         r->add_key_lengths(1);
       },
       kInvalid, "key_lengths[0] must be in [0, 3] (Tk), got -1"},
      {"attn_mask_shape", [](R* r) { SetTensor(r->mutable_attn_mask(), {3, 4}, 1); }, kInvalid,
       "attn_mask.shape must be [3, 3] [Tq, Tk] or [2, 3, 3] [B, Tq, Tk], got [3, 4]"},
      {"attn_mask_nan",
       [](R* r) {
         std::vector<float> mask(9, 0.0f);
         mask[4] = kNaN;
         FloatsToTensor(mask, {3, 3}, v1::FP32, r->mutable_attn_mask());
       },
       kInvalid, "attn_mask element 4 is nan"},
      {"attn_mask_plus_inf",
       [](R* r) {
         std::vector<float> mask(9, 0.0f);
         mask[0] = std::numeric_limits<float>::infinity();
         FloatsToTensor(mask, {3, 3}, v1::FP32, r->mutable_attn_mask());
       },
       kInvalid, "attn_mask element 0 is inf"},
      {"attn_mask_no_dtype",
       [](R* r) {
         SetTensor(r->mutable_attn_mask(), {3, 3}, 1);
         r->mutable_attn_mask()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
       },
       kInvalid, "attn_mask.dtype"},
      {"head_mask_size", [](R* r) { r->add_head_mask(1.0f); }, kInvalid,
       "head_mask must have num_heads (2) values, got 1"},
      {"head_mask_nan",
       [](R* r) {
         r->add_head_mask(1.0f);
         r->add_head_mask(kNaN);
       },
       kInvalid, "head_mask[1] must be finite"},
      {"unknown_output_dtype", [](R* r) { r->set_output_dtype(static_cast<v1::DataType>(7)); }, kInvalid,
       "output_dtype must be"},
      {"unknown_mask_type", [](R* r) { r->set_attn_mask_type(static_cast<v1::MaskType>(5)); }, kInvalid,
       "attn_mask_type must be MASK_ADDITIVE or MASK_KEEP, got 5"},
      {"unknown_backend", [](R* r) { r->set_backend(static_cast<v1::Backend>(17)); }, kInvalid,
       "backend must be BACKEND_AUTO"},
  };
}

TEST_F(ServiceTest, CudaWithoutAUsableGpuIsRefusedNamingTheReason) {
  // Not compiled in: INVALID_ARGUMENT. Compiled in on a machine without a usable GPU: UNAVAILABLE with the reason
  // the driver gave. With a GPU the call is served (the conformance suite covers that).
  std::string reason;
  if (BackendRegistry::CompiledIn(kCudaBackend)) {
    const std::unique_ptr<BackendRegistry> registry = BackendRegistry::Create();
    for (const BackendEntry& entry : registry->entries()) {
      if (entry.name != kCudaBackend) continue;
      if (entry.available()) GTEST_SKIP() << "a GPU is present: " << entry.device;
      reason = entry.detail;
    }
  }
  v1::MultiHeadAttentionRequest request = ValidRequest();
  request.set_backend(v1::BACKEND_CUDA);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  if (BackendRegistry::CompiledIn(kCudaBackend)) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("backend: backend 'cuda' is unavailable on this machine: " + reason));
  } else {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    EXPECT_THAT(status.error_message(), HasSubstr("backend 'cuda' is not compiled into this server"));
  }
}

class BadInputTest : public ServiceTest, public ::testing::WithParamInterface<BadInput> {};

TEST_P(BadInputTest, IsRejectedWithAClearStatus) {
  v1::MultiHeadAttentionRequest request = ValidRequest();
  GetParam().mutate(&request);
  v1::MultiHeadAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), GetParam().code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(MultiHeadAttention, BadInputTest, ::testing::ValuesIn(BadInputs()),
                         [](const auto& info) { return info.param.name; });

// Rejected ScaledDotProductAttention inputs.
struct BadSdpa {
  std::string name;
  std::function<void(v1::ScaledDotProductAttentionRequest*)> mutate;
  std::string message;
};
std::ostream& operator<<(std::ostream& os, const BadSdpa& c) { return os << c.name; }

class BadSdpaTest : public ServiceTest, public ::testing::WithParamInterface<BadSdpa> {};

TEST_P(BadSdpaTest, IsInvalidArgument) {
  v1::ScaledDotProductAttentionRequest request;
  SetTensor(request.mutable_q(), {2, 3, 4, 8}, 1);
  SetTensor(request.mutable_k(), {2, 5, 2, 8}, 2);
  SetTensor(request.mutable_v(), {2, 5, 2, 8}, 3);
  GetParam().mutate(&request);
  v1::ScaledDotProductAttentionResponse response;
  const grpc::Status status = Call(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(GetParam().message));
}

INSTANTIATE_TEST_SUITE_P(
    ScaledDotProductAttention, BadSdpaTest,
    ::testing::ValuesIn(std::vector<BadSdpa>{
        {"missing_v", [](auto* r) { r->clear_v(); }, "v is required"},
        {"q_nan", [](auto* r) { SetElement(r->mutable_q(), 8, kNaN); }, "q[0, 0, 1, 0] is NaN"},
        {"v_inf", [](auto* r) { SetElement(r->mutable_v(), 79, -kInf); }, "v[0, 4, 1, 7] is -inf"},
        {"q_rank", [](auto* r) { SetTensor(r->mutable_q(), {2, 3, 32}, 1); }, "q must have rank 4"},
        {"kv_heads_not_dividing", [](auto* r) {
           SetTensor(r->mutable_k(), {2, 5, 3, 8}, 1);
           SetTensor(r->mutable_v(), {2, 5, 3, 8}, 1);
         }, "k.shape[2] (Hkv = 3) must divide q.shape[2] (H = 4)"},
        {"head_dim_mismatch", [](auto* r) { SetTensor(r->mutable_k(), {2, 5, 2, 4}, 1); },
         "k.shape[3] (d_k) must be 8"},
        {"v_shape_mismatch", [](auto* r) { SetTensor(r->mutable_v(), {2, 6, 2, 8}, 1); },
         "v.shape must equal k.shape [2, 5, 2, 8], got [2, 6, 2, 8]"},
        {"heads_disagree", [](auto* r) { r->mutable_heads()->set_num_heads(2); },
         "heads.num_heads is 2, which disagrees with the q and k shapes (4)"},
        {"key_lengths_out_of_range", [](auto* r) {
           r->add_key_lengths(6);
           r->add_key_lengths(0);
         }, "key_lengths[0] must be in [0, 5]"},
    }),
    [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace mha
