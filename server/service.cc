#include "server/service.h"

#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "server/execute.h"
#include "spdlog/spdlog.h"

#ifndef MHA_VERSION
#define MHA_VERSION "dev"
#endif

namespace mha {
namespace {

grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

void AttentionService::CallDone(uint64_t id, const char* rpc, absl::string_view shapes, absl::string_view backend,
                                const absl::Status& status, absl::Time start, double compute_seconds,
                                double flops) {
  const absl::Duration latency = absl::Now() - start;
  metrics_->RecordCall(rpc, status.code(), backend, absl::ToDoubleSeconds(latency), compute_seconds, flops);
  const int64_t latency_us = absl::ToInt64Microseconds(latency);
  // abseil 20220623's string_view is not std's, so fmt needs std views.
  const std::string_view shapes_sv(shapes.data(), shapes.size());
  const std::string_view backend_sv = backend.empty() ? "-" : std::string_view(backend.data(), backend.size());
  if (status.ok()) {
    spdlog::info("rid={} rpc={} {} backend={} status=OK latency_us={}", id, rpc, shapes_sv, backend_sv,
                 latency_us);
  } else {
    spdlog::warn("rid={} rpc={} {} backend={} status={} latency_us={} error=\"{}\"", id, rpc, shapes_sv,
                 backend_sv, absl::StatusCodeToString(status.code()), latency_us,
                 std::string_view(status.message().data(), status.message().size()));
  }
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  // absl::StatusCode and grpc::StatusCode share their numbering (both follow google.rpc.Code).
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

AttentionService::AttentionService(const ServerOptions& options, LayerStore* layers, BackendRegistry* backends,
                                   Scheduler* scheduler, ServerMetrics* metrics)
    : options_(options), layers_(layers), backends_(backends), scheduler_(scheduler), metrics_(metrics) {
  validation_.layers = layers_;
  validation_.backends = backends_;
  validation_.default_backend = options.backend == "auto" ? backends_->DefaultName() : options.backend;
  validation_.max_message_bytes = static_cast<int64_t>(options.max_message_mb) << 20;
  validation_.max_scratch_bytes = static_cast<int64_t>(options.max_scratch_mb) << 20;
  validation_.max_request_flops = options.max_request_gflop * 1e9;
}

template <typename Request, typename Response, typename Plan>
grpc::ServerUnaryReactor* AttentionService::Compute(
    const char* rpc, grpc::CallbackServerContext* context, const Request* request, Response* response,
    absl::StatusOr<Plan> (*validate)(const Request&, const ValidationContext&),
    absl::Status (*execute)(const Plan&, Response*)) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const uint64_t id = next_request_id_++;
  const absl::Time start = absl::Now();
  absl::StatusOr<Plan> validated = validate(*request, validation_);
  if (!validated.ok()) {
    CallDone(id, rpc, "-", "", validated.status(), start);
    reactor->Finish(ToGrpcStatus(validated.status()));
    return reactor;
  }
  auto plan = std::make_shared<const Plan>(*std::move(validated));
  // Computes and finishes the call. The request, response and context stay valid until Finish.
  auto run = [=](absl::Time queued_at) {
    const absl::Time picked_up = absl::Now();
    absl::Status status;
    if (context->IsCancelled()) {
      status = absl::CancelledError("the call was cancelled or passed its deadline before compute started");
    } else {
      status = execute(*plan, response);
      response->mutable_timing()->set_queue_us(absl::ToInt64Microseconds(picked_up - queued_at));
      response->mutable_timing()->set_compute_us(absl::ToInt64Microseconds(absl::Now() - picked_up));
      response->mutable_timing()->set_handler_us(absl::ToInt64Microseconds(absl::Now() - start));
    }
    if (!status.ok()) response->Clear();
    CallDone(id, rpc, plan->shapes, plan->backend->name(), status, start, absl::ToDoubleSeconds(absl::Now() - picked_up),
             plan->flops);
    reactor->Finish(ToGrpcStatus(status));
  };
  if (plan->flops <= options_.inline_max_mflop * 1e6 && plan->backend->serves_inline()) {
    // Tiny (single-threaded, tens of microseconds): computing it here is cheaper than the hand-off.
    run(absl::Now());
    return reactor;
  }
  const int64_t request_bytes = static_cast<int64_t>(request->ByteSizeLong());
  const absl::Time queued_at = absl::Now();
  absl::Status submitted = scheduler_->Submit(
      [this, run, queued_at] {
        metrics_->SetQueueDepth(scheduler_->queued());
        run(queued_at);
      },
      request_bytes);
  metrics_->SetQueueDepth(scheduler_->queued());
  if (!submitted.ok()) {
    CallDone(id, rpc, plan->shapes, plan->backend->name(), submitted, start);
    reactor->Finish(ToGrpcStatus(submitted));
  }
  return reactor;
}

grpc::ServerUnaryReactor* AttentionService::MultiHeadAttention(grpc::CallbackServerContext* context,
                                                               const v1::MultiHeadAttentionRequest* request,
                                                               v1::MultiHeadAttentionResponse* response) {
  return Compute("MultiHeadAttention", context, request, response, &ValidateMultiHeadAttention,
                 &ExecuteMultiHeadAttention);
}

grpc::ServerUnaryReactor* AttentionService::ScaledDotProductAttention(
    grpc::CallbackServerContext* context, const v1::ScaledDotProductAttentionRequest* request,
    v1::ScaledDotProductAttentionResponse* response) {
  return Compute("ScaledDotProductAttention", context, request, response, &ValidateScaledDotProductAttention,
                 &ExecuteScaledDotProductAttention);
}

grpc::ServerUnaryReactor* AttentionService::LoadLayer(grpc::CallbackServerContext* context,
                                                      const v1::LoadLayerRequest* request,
                                                      v1::LoadLayerResponse* response) {
  const uint64_t id = next_request_id_++;
  const absl::Time start = absl::Now();
  absl::Status status = LayerStore::CheckName(request->name());
  if (!status.ok()) {
    status = absl::InvalidArgumentError(absl::StrCat("name: ", status.message()));
  } else {
    absl::StatusOr<std::shared_ptr<const Layer>> layer =
        BuildLayer(request->name(), "rpc", request->weights(), request->heads(), "weights");
    status = layer.status();
    if (status.ok()) {
      *response->mutable_layer() = (*layer)->Info();
      status = layers_->Add(*std::move(layer));
    }
  }
  if (!status.ok()) response->Clear();
  CallDone(id, "LoadLayer", absl::StrCat("name=", request->name()), "", status, start);
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* AttentionService::UnloadLayer(grpc::CallbackServerContext* context,
                                                        const v1::UnloadLayerRequest* request,
                                                        v1::UnloadLayerResponse* response) {
  const uint64_t id = next_request_id_++;
  const absl::Time start = absl::Now();
  absl::Status status = layers_->Remove(request->name());
  CallDone(id, "UnloadLayer", absl::StrCat("name=", request->name()), "", status, start);
  return FinishNow(context, status);
}

grpc::ServerUnaryReactor* AttentionService::ListLayers(grpc::CallbackServerContext* context,
                                                       const v1::ListLayersRequest* request,
                                                       v1::ListLayersResponse* response) {
  for (const auto& layer : layers_->List()) *response->add_layers() = layer->Info();
  return FinishNow(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const v1::GetServerInfoRequest* request,
                                                          v1::GetServerInfoResponse* response) {
  response->set_version(MHA_VERSION);
  for (const BackendEntry& entry : backends_->entries()) {
    v1::BackendInfo* info = response->add_backends();
    info->set_name(entry.name);
    info->set_device(entry.device);
    info->set_available(entry.available());
    info->set_detail(entry.detail);
  }
  response->set_default_backend(validation_.default_backend);
  v1::ServerLimits* limits = response->mutable_limits();
  limits->set_max_message_bytes(validation_.max_message_bytes);
  limits->set_max_queue_size(options_.max_queue_size);
  limits->set_compute_threads(options_.threads);
  limits->set_max_layer_bytes(layers_->max_total_bytes());
  limits->set_max_layers(layers_->max_layers());
  limits->set_max_queued_bytes(static_cast<int64_t>(options_.max_queued_mb) << 20);
  limits->set_max_scratch_bytes(validation_.max_scratch_bytes);
  limits->set_max_request_gflop(options_.max_request_gflop);
  return FinishNow(context, absl::OkStatus());
}

}  // namespace mha
