// The KServe v2 front door: how a ModelInferRequest translates (every refusal with its code and the name it gives),
// and the service through an in-process channel, whose results must equal the native RPCs' byte for byte.
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "proto/inference/grpc_service.grpc.pb.h"
#include "server/rpc/kserve/infer_request.h"
#include "tests/service_fixture.h"

namespace mha::testing {
namespace {

using inference::ModelInferRequest;

template <typename T>
void Set(google::protobuf::RepeatedField<T>* field, std::initializer_list<T> values) {
  field->Assign(values.begin(), values.end());
}

std::string Floats(int64_t n, uint32_t seed) {
  const std::vector<float> values = RandomVector(n, seed, 0.5f);
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

// Adds input `name` with its raw bytes.
void AddRaw(ModelInferRequest* request, const std::string& name, const std::string& datatype,
            std::vector<int64_t> shape, std::string bytes) {
  auto* input = request->add_inputs();
  input->set_name(name);
  input->set_datatype(datatype);
  input->mutable_shape()->Assign(shape.begin(), shape.end());
  request->add_raw_input_contents(std::move(bytes));
}

// The demo layer's model on query [2, 3, 512] in raw FP32.
ModelInferRequest DemoInfer() {
  ModelInferRequest request;
  request.set_model_name("demo");
  AddRaw(&request, "query", "FP32", {2, 3, 512}, Floats(2 * 3 * 512, 7));
  return request;
}

ModelInferRequest SdpaInfer() {
  ModelInferRequest request;
  request.set_model_name(kSdpaModel);
  uint32_t seed = 1;
  for (const char* name : {"q", "k", "v"}) AddRaw(&request, name, "FP32", {1, 4, 2, 8}, Floats(64, seed++));
  return request;
}

TEST(KServeTranslate, RawBytesMoveIntoTheNativeRequest) {
  ModelInferRequest request = DemoInfer();
  const std::string bytes = request.raw_input_contents(0);
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  ASSERT_NE(call->mha, nullptr);
  EXPECT_EQ(call->mha->layer(), "demo");
  EXPECT_EQ(call->mha->query().data(), bytes);
  EXPECT_EQ(call->mha->query().dtype(), v1::FP32);
  EXPECT_TRUE(request.raw_input_contents(0).empty());  // moved, not copied
  EXPECT_FALSE(call->mha->has_output_shared_memory());
  EXPECT_FALSE(call->mha->return_attention_weights());
  EXPECT_EQ(call->outputs, std::vector<KServeOutput>{KServeOutput::kOutput});
}

TEST(KServeTranslate, TypedContentsReadAsRawWould) {
  ModelInferRequest request;
  request.set_model_name("demo");
  auto* input = request.add_inputs();
  input->set_name("query");
  input->set_datatype("FP32");
  Set<int64_t>(input->mutable_shape(), {1, 1, 2});
  Set<float>(input->mutable_contents()->mutable_fp32_contents(), {1.5f, -2.0f});
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  const float want[] = {1.5f, -2.0f};
  EXPECT_EQ(call->mha->query().data(), std::string(reinterpret_cast<const char*>(want), sizeof(want)));
}

TEST(KServeTranslate, BoolMaskBecomesAKeepMaskOfOnesAndZeros) {
  ModelInferRequest request = DemoInfer();
  AddRaw(&request, "attn_mask", "BOOL", {3, 3}, std::string("\1\0\0\1\1\0\1\1\1", 9));
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->mha->attn_mask_type(), v1::MASK_KEEP);
  EXPECT_EQ(TensorToFloats(call->mha->attn_mask()), (std::vector<float>{1, 0, 0, 1, 1, 0, 1, 1, 1}));
}

TEST(KServeTranslate, Int64KeyLengthsAndParametersReachTheRequest) {
  ModelInferRequest request = DemoInfer();
  const int64_t lengths[] = {3, 1};
  AddRaw(&request, "key_lengths", "INT64", {2}, std::string(reinterpret_cast<const char*>(lengths), 16));
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  (*request.mutable_parameters())["scale"].set_double_param(0.25);
  (*request.mutable_parameters())["backend"].set_string_param("reference");
  request.add_outputs()->set_name("attention_weights");
  request.add_outputs()->set_name("output");
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(std::vector<int32_t>(call->mha->key_lengths().begin(), call->mha->key_lengths().end()),
            (std::vector<int32_t>{3, 1}));
  EXPECT_TRUE(call->mha->heads().causal());
  EXPECT_FLOAT_EQ(call->mha->heads().scale(), 0.25f);
  EXPECT_EQ(call->mha->backend(), v1::BACKEND_REFERENCE);
  EXPECT_TRUE(call->mha->return_attention_weights());
  EXPECT_EQ(call->outputs, (std::vector<KServeOutput>{KServeOutput::kAttentionWeights, KServeOutput::kOutput}));
}

TEST(KServeTranslate, SharedMemoryInputsAndOutputKeepTheirRegions) {
  ModelInferRequest request;
  request.set_model_name("demo");
  auto* input = request.add_inputs();
  input->set_name("query");
  input->set_datatype("FP32");
  Set<int64_t>(input->mutable_shape(), {1, 2, 4});
  (*input->mutable_parameters())["shared_memory_region"].set_string_param("in");
  (*input->mutable_parameters())["shared_memory_byte_size"].set_int64_param(32);
  (*input->mutable_parameters())["shared_memory_offset"].set_int64_param(64);
  auto* output = request.add_outputs();
  output->set_name("output");
  (*output->mutable_parameters())["shared_memory_region"].set_string_param("out");
  (*output->mutable_parameters())["shared_memory_byte_size"].set_int64_param(32);
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  EXPECT_EQ(call->mha->query().shared_memory().region(), "in");
  EXPECT_EQ(call->mha->query().shared_memory().offset(), 64u);
  EXPECT_TRUE(call->mha->query().data().empty());
  EXPECT_EQ(call->mha->output_shared_memory().region(), "out");
}

TEST(KServeTranslate, SdpaTakesTheHeadConfigurationFromParameters) {
  ModelInferRequest request = SdpaInfer();
  (*request.mutable_parameters())["num_heads"].set_int64_param(2);
  (*request.mutable_parameters())["rope_theta"].set_double_param(10000);
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_TRUE(call.ok()) << call.status();
  ASSERT_NE(call->sdpa, nullptr);
  EXPECT_EQ(call->sdpa->heads().num_heads(), 2);
  EXPECT_EQ(call->sdpa->heads().rope_theta(), 10000);
  EXPECT_EQ(call->sdpa->k().shape_size(), 4);
}

// A request the translation refuses: how it is broken, and a piece of the message, which names what is wrong.
struct Refusal {
  const char* name;
  std::function<void(ModelInferRequest*)> mutate;
  const char* message;
};

class KServeRefusal : public ::testing::TestWithParam<Refusal> {};

TEST_P(KServeRefusal, IsInvalidArgumentNamingTheCulprit) {
  ModelInferRequest request = DemoInfer();
  GetParam().mutate(&request);
  const absl::StatusOr<KServeCall> call = TranslateInferRequest(&request);
  ASSERT_FALSE(call.ok());
  EXPECT_EQ(call.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(call.status().message().find(GetParam().message), std::string::npos) << call.status();
}

void SetParam(ModelInferRequest* r, const std::string& name, const inference::InferParameter& value) {
  (*r->mutable_parameters())[name] = value;
}
inference::InferParameter StringParam(const std::string& value) {
  inference::InferParameter p;
  p.set_string_param(value);
  return p;
}

INSTANTIATE_TEST_SUITE_P(
    Table, KServeRefusal,
    ::testing::Values(
        Refusal{"missing_query", [](ModelInferRequest* r) { r->mutable_inputs(0)->set_name("key"); },
                "inputs: 'query' is missing"},
        Refusal{"misnamed_input", [](ModelInferRequest* r) { r->mutable_inputs(0)->set_name("qurey"); },
                "takes no input 'qurey'; it takes query, key, value"},
        Refusal{"input_twice",
                [](ModelInferRequest* r) { AddRaw(r, "query", "FP32", {1}, Floats(1, 1)); },
                "'query' is given twice"},
        Refusal{"inputs_beyond_any_model",
                [](ModelInferRequest* r) {
                  for (int i = 0; i < 100000; ++i) r->add_inputs()->set_name(absl::StrCat("x", i));
                },
                "inputs: 100001 given; a model takes at most 6"},
        Refusal{"wrong_datatype", [](ModelInferRequest* r) { r->mutable_inputs(0)->set_datatype("INT32"); },
                "query: datatype 'INT32' is not taken; send FP32, FP16, BF16"},
        Refusal{"bytes_short", [](ModelInferRequest* r) { r->mutable_raw_input_contents(0)->resize(100); },
                "query: 100 bytes in raw_input_contents; its shape [2, 3, 512] of FP32 needs 12288"},
        Refusal{"shape_zero", [](ModelInferRequest* r) { r->mutable_inputs(0)->set_shape(1, 0); },
                "query: shape [2, 0, 512] has a dimension below 1"},
        Refusal{"raw_count",
                [](ModelInferRequest* r) { r->add_raw_input_contents("x"); },
                "raw_input_contents: 2 entries for 1 inputs outside shared memory"},
        Refusal{"raw_and_typed",
                [](ModelInferRequest* r) { r->mutable_inputs(0)->mutable_contents()->add_fp32_contents(1); },
                "query: has contents and a raw_input_contents entry"},
        Refusal{"typed_fp16",
                [](ModelInferRequest* r) {
                  r->clear_raw_input_contents();
                  r->mutable_inputs(0)->set_datatype("FP16");
                },
                "query: FP16 tensors travel in raw_input_contents"},
        Refusal{"typed_count",
                [](ModelInferRequest* r) {
                  r->clear_raw_input_contents();
                  r->mutable_inputs(0)->mutable_contents()->add_fp32_contents(1);
                },
                "query: 1 values in its contents; its shape [2, 3, 512] needs 3072"},
        Refusal{"bool_mask_value",
                [](ModelInferRequest* r) { AddRaw(r, "attn_mask", "BOOL", {1, 2}, std::string("\1\2", 2)); },
                "attn_mask[1] is 2, not a BOOL"},
        Refusal{"key_lengths_rank",
                [](ModelInferRequest* r) { AddRaw(r, "key_lengths", "INT32", {1, 2}, std::string(8, '\0')); },
                "key_lengths: shape [1, 2] must have one dimension"},
        Refusal{"key_lengths_negative",
                [](ModelInferRequest* r) { AddRaw(r, "key_lengths", "INT64", {1}, std::string(8, '\xff')); },
                "key_lengths[0] is -1"},
        Refusal{"mask_in_shared_memory",
                [](ModelInferRequest* r) {
                  auto* mask = r->add_inputs();
                  mask->set_name("attn_mask");
                  mask->set_datatype("FP32");
                  mask->add_shape(3);
                  (*mask->mutable_parameters())["shared_memory_region"] = StringParam("r");
                },
                "attn_mask: cannot lie in shared memory"},
        Refusal{"shared_memory_size",
                [](ModelInferRequest* r) {
                  r->clear_raw_input_contents();
                  (*r->mutable_inputs(0)->mutable_parameters())["shared_memory_region"] = StringParam("r");
                },
                "query: shared_memory_byte_size must be 12288 (the shape's bytes), not absent"},
        Refusal{"unknown_parameter", [](ModelInferRequest* r) { SetParam(r, "causl", StringParam("x")); },
                "parameters: 'causl' is not taken"},
        Refusal{"scale_below_float",
                [](ModelInferRequest* r) {
                  inference::InferParameter p;
                  p.set_double_param(1e-300);
                  SetParam(r, "scale", p);
                },
                "parameters: 'scale' is 1e-300, outside float's range"},
        Refusal{"parameter_type", [](ModelInferRequest* r) { SetParam(r, "causal", StringParam("yes")); },
                "parameters: 'causal' must be a bool"},
        Refusal{"heads_on_a_layer", [](ModelInferRequest* r) { SetParam(r, "num_heads", StringParam("8")); },
                "parameters: 'num_heads' is not taken"},
        Refusal{"backend_name", [](ModelInferRequest* r) { SetParam(r, "backend", StringParam("tpu")); },
                "parameters: backend 'tpu' is none of auto, cpu, cuda, reference"},
        Refusal{"unknown_output", [](ModelInferRequest* r) { r->add_outputs()->set_name("logits"); },
                "outputs: the model has no output 'logits'"},
        Refusal{"output_twice",
                [](ModelInferRequest* r) {
                  r->add_outputs()->set_name("output");
                  r->add_outputs()->set_name("output");
                },
                "outputs: 'output' is requested twice"},
        Refusal{"weights_to_shared_memory",
                [](ModelInferRequest* r) {
                  auto* out = r->add_outputs();
                  out->set_name("attention_weights");
                  (*out->mutable_parameters())["shared_memory_region"] = StringParam("r");
                },
                "only output can be written to shared memory"}),
    [](const ::testing::TestParamInfo<Refusal>& info) { return std::string(info.param.name); });

TEST(KServeModelVersion, OnlyVersionOneOrNoneIsServed) {
  EXPECT_TRUE(CheckModelVersion("demo", "").ok());
  EXPECT_TRUE(CheckModelVersion("demo", "1").ok());
  EXPECT_EQ(CheckModelVersion("demo", "2").code(), absl::StatusCode::kNotFound);
}

// The service, beside the native one on the same in-process server.
class KServeServiceTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    kserve_ = inference::GRPCInferenceService::NewStub(server_->InProcessChannel());
  }

  grpc::Status Infer(const ModelInferRequest& request, inference::ModelInferResponse* response) {
    grpc::ClientContext context;
    return kserve_->ModelInfer(&context, request, response);
  }

  std::unique_ptr<inference::GRPCInferenceService::Stub> kserve_;
};

// The native MultiHeadAttention request DemoInfer() `request` translates to (the demo layer, its query).
v1::MultiHeadAttentionRequest NativeDemo(const ModelInferRequest& request) {
  v1::MultiHeadAttentionRequest native;
  native.set_layer("demo");
  native.mutable_query()->set_dtype(v1::FP32);
  Set<int64_t>(native.mutable_query()->mutable_shape(), {2, 3, 512});
  native.mutable_query()->set_data(request.raw_input_contents(0));
  return native;
}

TEST_F(KServeServiceTest, InferEqualsTheNativeCallByteForByte) {
  ModelInferRequest request = DemoInfer();
  (*request.mutable_parameters())["backend"] = StringParam("cpu");
  request.add_outputs()->set_name("output");
  request.add_outputs()->set_name("attention_weights");
  request.set_id("call-7");
  v1::MultiHeadAttentionRequest native = NativeDemo(request);
  native.set_backend(v1::BACKEND_CPU);
  native.set_return_attention_weights(true);
  v1::MultiHeadAttentionResponse want;
  ASSERT_TRUE(Call(native, &want).ok());

  inference::ModelInferResponse got;
  const grpc::Status status = Infer(request, &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(got.model_name(), "demo");
  EXPECT_EQ(got.model_version(), "1");
  EXPECT_EQ(got.id(), "call-7");
  EXPECT_EQ(got.parameters().at("backend").string_param(), "cpu");
  ASSERT_EQ(got.outputs_size(), 2);
  ASSERT_EQ(got.raw_output_contents_size(), 2);
  EXPECT_EQ(got.outputs(0).name(), "output");
  EXPECT_EQ(got.outputs(0).datatype(), "FP32");
  EXPECT_EQ(std::vector<int64_t>(got.outputs(0).shape().begin(), got.outputs(0).shape().end()),
            (std::vector<int64_t>{2, 3, 512}));
  EXPECT_EQ(got.raw_output_contents(0), want.output().data());
  EXPECT_EQ(got.outputs(1).name(), "attention_weights");
  EXPECT_EQ(std::vector<int64_t>(got.outputs(1).shape().begin(), got.outputs(1).shape().end()),
            (std::vector<int64_t>{2, 8, 3, 3}));
  EXPECT_EQ(got.raw_output_contents(1), want.attention_weights().data());
}

TEST_F(KServeServiceTest, SdpaEqualsTheNativeCallByteForByte) {
  ModelInferRequest request = SdpaInfer();
  (*request.mutable_parameters())["causal"].set_bool_param(true);
  v1::ScaledDotProductAttentionRequest native;
  for (int i = 0; i < 3; ++i) {
    v1::Tensor* t = i == 0 ? native.mutable_q() : i == 1 ? native.mutable_k() : native.mutable_v();
    t->set_dtype(v1::FP32);
    Set<int64_t>(t->mutable_shape(), {1, 4, 2, 8});
    t->set_data(request.raw_input_contents(i));
  }
  native.mutable_heads()->set_causal(true);
  v1::ScaledDotProductAttentionResponse want;
  ASSERT_TRUE(Call(native, &want).ok());
  inference::ModelInferResponse got;
  ASSERT_TRUE(Infer(request, &got).ok());
  ASSERT_EQ(got.raw_output_contents_size(), 1);
  EXPECT_EQ(got.raw_output_contents(0), want.output().data());
}

TEST_F(KServeServiceTest, LseAndHeadStatisticsAreOutputsOfTheNativeCallsValues) {
  ModelInferRequest request = DemoInfer();
  (*request.mutable_parameters())["sink_tokens"].set_int64_param(2);
  request.add_outputs()->set_name("head_contribution");
  request.add_outputs()->set_name("lse");
  request.add_outputs()->set_name("head_sink_mass");
  v1::MultiHeadAttentionRequest native = NativeDemo(request);
  native.set_return_lse(true);
  native.set_return_head_stats(true);
  native.set_sink_tokens(2);
  v1::MultiHeadAttentionResponse want;
  ASSERT_TRUE(Call(native, &want).ok());

  inference::ModelInferResponse got;
  const grpc::Status status = Infer(request, &got);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(got.outputs_size(), 3);
  const auto shape = [&got](int i) {
    return std::vector<int64_t>(got.outputs(i).shape().begin(), got.outputs(i).shape().end());
  };
  const auto bytes = [](const google::protobuf::RepeatedField<float>& values) {
    return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  };
  EXPECT_EQ(got.outputs(0).name(), "head_contribution");
  EXPECT_EQ(shape(0), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(got.raw_output_contents(0), bytes(want.head_stats().contribution()));
  EXPECT_EQ(got.outputs(1).name(), "lse");
  EXPECT_EQ(shape(1), (std::vector<int64_t>{2, 8, 3}));
  EXPECT_EQ(got.raw_output_contents(1), want.lse().data());
  EXPECT_EQ(got.outputs(2).name(), "head_sink_mass");
  EXPECT_EQ(got.raw_output_contents(2), bytes(want.head_stats().sink_mass()));
}

TEST_F(KServeServiceTest, SdpaHasNoHeadContribution) {
  ModelInferRequest request = SdpaInfer();
  request.add_outputs()->set_name("head_contribution");
  inference::ModelInferResponse got;
  const grpc::Status status = Infer(request, &got);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("no output 'head_contribution'"), std::string::npos) << status.error_message();
}

TEST_F(KServeServiceTest, AnUnknownModelOrVersionIsNotFound) {
  ModelInferRequest request = DemoInfer();
  request.set_model_name("nope");
  inference::ModelInferResponse response;
  grpc::Status status = Infer(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_NE(status.error_message().find("model 'nope' is not served"), std::string::npos);
  request = DemoInfer();
  request.set_model_version("2");
  EXPECT_EQ(Infer(request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KServeServiceTest, ValidationErrorsKeepTheirCodes) {
  ModelInferRequest request = DemoInfer();
  AddRaw(&request, "head_mask", "FP32", {3}, Floats(3, 1));  // the demo layer has 8 heads
  inference::ModelInferResponse response;
  const grpc::Status status = Infer(request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("head_mask"), std::string::npos) << status.error_message();
}

TEST_F(KServeServiceTest, HealthMetadataConfigAndIndexDescribeTheLayers) {
  grpc::ClientContext c1, c2, c3, c4, c5;
  inference::ServerLiveResponse live;
  ASSERT_TRUE(kserve_->ServerLive(&c1, {}, &live).ok());
  EXPECT_TRUE(live.live());
  inference::ServerReadyResponse ready;
  ASSERT_TRUE(kserve_->ServerReady(&c2, {}, &ready).ok());
  EXPECT_TRUE(ready.ready());
  inference::ModelMetadataRequest name;
  name.set_name("demo");
  inference::ModelMetadataResponse metadata;
  ASSERT_TRUE(kserve_->ModelMetadata(&c3, name, &metadata).ok());
  ASSERT_GE(metadata.inputs_size(), 1);
  EXPECT_EQ(metadata.inputs(0).name(), "query");
  EXPECT_EQ(std::vector<int64_t>(metadata.inputs(0).shape().begin(), metadata.inputs(0).shape().end()),
            (std::vector<int64_t>{-1, -1, 512}));
  inference::ModelConfigRequest config_request;
  config_request.set_name(kSdpaModel);
  inference::ModelConfigResponse config;
  ASSERT_TRUE(kserve_->ModelConfig(&c4, config_request, &config).ok());
  EXPECT_EQ(config.config().backend(), "mhaserve");
  EXPECT_EQ(config.config().max_batch_size(), 0);
  EXPECT_EQ(config.config().input(0).name(), "q");
  inference::RepositoryIndexResponse index;
  ASSERT_TRUE(kserve_->RepositoryIndex(&c5, {}, &index).ok());
  std::vector<std::string> models;
  for (const auto& model : index.models()) models.push_back(model.name());
  EXPECT_EQ(models, (std::vector<std::string>{"demo", "sdpa"}));
}

TEST_F(KServeServiceTest, StatisticsCountSuccessesAndFailures) {
  inference::ModelInferResponse response;
  ASSERT_TRUE(Infer(DemoInfer(), &response).ok());
  ASSERT_TRUE(Infer(DemoInfer(), &response).ok());
  ModelInferRequest bad = DemoInfer();
  bad.mutable_inputs(0)->set_datatype("INT32");
  ASSERT_FALSE(Infer(bad, &response).ok());
  grpc::ClientContext context;
  inference::ModelStatisticsRequest request;
  request.set_name("demo");
  inference::ModelStatisticsResponse stats;
  ASSERT_TRUE(kserve_->ModelStatistics(&context, request, &stats).ok());
  ASSERT_EQ(stats.model_stats_size(), 1);
  const inference::ModelStatistics& demo = stats.model_stats(0);
  EXPECT_EQ(demo.inference_stats().success().count(), 2u);
  EXPECT_EQ(demo.inference_stats().fail().count(), 1u);
  EXPECT_EQ(demo.inference_count(), 4u);  // two calls of batch 2
  EXPECT_GT(demo.inference_stats().compute_infer().ns(), 0u);
}

TEST_F(KServeServiceTest, SharedMemoryRegistersOnlyFromTheObjectsStart) {
  grpc::ClientContext c1, c2;
  inference::SystemSharedMemoryRegisterRequest request;
  request.set_name("r");
  request.set_key("/mha_kserve_test");
  request.set_offset(4096);
  request.set_byte_size(4096);
  inference::SystemSharedMemoryRegisterResponse registered;
  const grpc::Status status = kserve_->SystemSharedMemoryRegister(&c1, request, &registered);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("offset"), std::string::npos);
  // This server has shared memory off: its list of every region is empty, as tritonclient's cleanup expects.
  inference::SystemSharedMemoryStatusResponse regions;
  ASSERT_TRUE(kserve_->SystemSharedMemoryStatus(&c2, {}, &regions).ok());
  EXPECT_TRUE(regions.regions().empty());
}

}  // namespace
}  // namespace mha::testing
