#include "server/rpc/service.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/build_info.h"
#include "server/base/log_safe.h"
#include "server/base/status_macros.h"
#include "server/rpc/compute_call.h"

namespace mha {
namespace {

// Admits a compute call and submits it on `route`, answered in the native encoding.
template <typename Request, typename Response, typename Plan>
grpc::ServerUnaryReactor* Compute(Call call, const ComputeRoute<Request, Response, Plan>& route,
                                  const ServiceParts& parts) {
  auto request = std::make_unique<Request>();
  std::vector<FiniteScan> scans;
  const absl::Status admitted = call.Admit(Role::kCompute, request.get(), &scans);
  return SubmitCompute(std::move(call), admitted, std::move(request), std::move(scans), route,
                       std::make_unique<NativeReplyEncoder<Response>>(), *parts.validation, parts.scheduler);
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::MultiHeadAttention(Context* context, const grpc::ByteBuffer* request,
                                                               grpc::ByteBuffer* response) {
  return Compute(Start("MultiHeadAttention", context, request, response), kMhaRoute, parts_);
}

grpc::ServerUnaryReactor* AttentionService::ScaledDotProductAttention(Context* context,
                                                                      const grpc::ByteBuffer* request,
                                                                      grpc::ByteBuffer* response) {
  return Compute(Start("ScaledDotProductAttention", context, request, response), kSdpaRoute, parts_);
}

grpc::ServerUnaryReactor* AttentionService::LoadLayer(grpc::CallbackServerContext* context,
                                                      const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<v1::LoadLayerRequest, v1::LoadLayerResponse>(
      Start("LoadLayer", context, request, response), Role::kAdmin,
      [this](const v1::LoadLayerRequest& request, v1::LoadLayerResponse* response, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        absl::StatusOr<std::shared_ptr<const Layer>> layer =
            parts_.layers->Load(request.name(), "rpc", request.weights(), request.heads(), "weights");
        if (!layer.ok()) return layer.status();
        *response->mutable_layer() = (*layer)->Info();
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::UnloadLayer(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<v1::UnloadLayerRequest, v1::UnloadLayerResponse>(
      Start("UnloadLayer", context, request, response), Role::kAdmin,
      [this](const v1::UnloadLayerRequest& request, v1::UnloadLayerResponse*, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return parts_.layers->Remove(request.name());
      });
}

grpc::ServerUnaryReactor* AttentionService::ListLayers(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
  return AnswerNow<v1::ListLayersRequest, v1::ListLayersResponse>(
      Start("ListLayers", context, request, response), Role::kCompute,
      [this](const v1::ListLayersRequest&, v1::ListLayersResponse* response, std::string*) {
        for (const auto& layer : parts_.layers->List()) *response->add_layers() = layer->Info();
        return absl::OkStatus();
      });
}

namespace {

// A small session call with a cache of `dtype`: what GetServerInfo asks each backend about.
PagedProblem CacheProbe(v1::DataType dtype, int64_t block_tokens) {
  PagedProblem p;
  p.heads.num_heads = p.heads.num_kv_heads = 1;
  p.heads.head_dim = 64;
  p.heads.causal = true;
  p.cache = {1, 64, block_tokens, dtype};
  p.sequences = p.new_tokens = p.max_new_tokens = p.max_length = 1;
  return p;
}

}  // namespace

grpc::ServerUnaryReactor* AttentionService::GetServerInfo(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return AnswerNow<v1::GetServerInfoRequest, v1::GetServerInfoResponse>(
      Start("GetServerInfo", context, request, response), Role::kCompute,
      [this](const v1::GetServerInfoRequest&, v1::GetServerInfoResponse* response, std::string*) {
        response->set_version(ProjectVersion());
        response->set_instance_id(parts_.edge->instance_id());
        for (const BackendEntry& entry : parts_.backends->entries()) {
          v1::BackendInfo* info = response->add_backends();
          info->set_name(entry.name);
          info->set_device(entry.device);
          info->set_available(entry.available());
          info->set_detail(entry.detail);
          if (!entry.available()) continue;
          info->set_gflops(parts_.scheduler->Rate(entry.backend.get()) / 1e9);
          for (v1::DataType dtype : {v1::FP32, v1::FP16, v1::BF16, v1::INT8, v1::FP8_E4M3, v1::FP8_E5M2}) {
            if (entry.backend->SupportsPaged(CacheProbe(dtype, parts_.sessions->options().block_tokens)).ok()) {
              info->add_cache_dtypes(dtype);
            }
          }
        }
        response->set_default_backend(parts_.backends->NameFor(v1::BACKEND_AUTO));
        v1::ServerLimits* limits = response->mutable_limits();
        limits->set_max_message_bytes(parts_.validation->max_message_bytes);
        limits->set_max_queue_size(parts_.options->max_queue_size);
        limits->set_compute_threads(parts_.options->threads);
        limits->set_max_layer_bytes(parts_.layers->max_total_bytes());
        limits->set_max_layers(parts_.layers->max_layers());
        limits->set_max_queued_bytes(static_cast<int64_t>(parts_.options->max_queued_mb) << 20);
        limits->set_max_scratch_bytes(parts_.validation->max_scratch_bytes);
        limits->set_max_request_gflop(parts_.options->max_request_gflop);
        limits->set_max_shared_memory_regions(parts_.shared_memory->max_regions());
        const SharedMemoryRegistry& shared_memory = *parts_.shared_memory;
        limits->set_max_shared_memory_bytes(shared_memory.max_regions() > 0 ? shared_memory.max_bytes() : 0);
        const SessionStoreOptions& sessions = parts_.sessions->options();
        limits->set_kv_cache_bytes(parts_.sessions->capacity_bytes());
        limits->set_kv_block_tokens(static_cast<int32_t>(sessions.block_tokens));
        limits->set_max_sessions(sessions.max_sessions);
        limits->set_max_session_tokens(sessions.max_tokens);
        limits->set_session_idle_s(static_cast<int32_t>(absl::ToInt64Seconds(sessions.idle_timeout)));
        limits->set_max_session_idle_s(static_cast<int32_t>(absl::ToInt64Seconds(sessions.max_idle_timeout)));
        // Totals only: they say nothing of which keys any scope holds.
        const SessionStore::Activity now = parts_.sessions->activity();
        v1::KvCacheUsage* usage = response->mutable_kv_cache();
        usage->set_sessions(now.open);
        usage->set_used_bytes(now.cache_bytes);
        usage->set_prefix_blocks(now.prefix_blocks);
        usage->set_prefix_bytes(now.prefix_bytes);
        usage->set_prefix_idle_bytes(now.prefix_idle_bytes);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::RegisterSharedMemory(grpc::CallbackServerContext* context,
                                                                 const grpc::ByteBuffer* request,
                                                                 grpc::ByteBuffer* response) {
  return AnswerNow<v1::RegisterSharedMemoryRequest, v1::RegisterSharedMemoryResponse>(
      Start("RegisterSharedMemory", context, request, response), Role::kCompute,
      [this](const v1::RegisterSharedMemoryRequest& request, v1::RegisterSharedMemoryResponse*, std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()), " key=", LogSafe(request.key()),
                               " bytes=", request.byte_size());
        return parts_.shared_memory->Register(request.name(), request.key(), request.byte_size());
      });
}

grpc::ServerUnaryReactor* AttentionService::UnregisterSharedMemory(grpc::CallbackServerContext* context,
                                                                   const grpc::ByteBuffer* request,
                                                                   grpc::ByteBuffer* response) {
  return AnswerNow<v1::UnregisterSharedMemoryRequest, v1::UnregisterSharedMemoryResponse>(
      Start("UnregisterSharedMemory", context, request, response), Role::kCompute,
      [this](const v1::UnregisterSharedMemoryRequest& request, v1::UnregisterSharedMemoryResponse*,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        return parts_.shared_memory->Unregister(request.name());
      });
}

grpc::ServerUnaryReactor* AttentionService::GetSharedMemoryStatus(grpc::CallbackServerContext* context,
                                                                  const grpc::ByteBuffer* request,
                                                                  grpc::ByteBuffer* response) {
  return AnswerNow<v1::GetSharedMemoryStatusRequest, v1::GetSharedMemoryStatusResponse>(
      Start("GetSharedMemoryStatus", context, request, response), Role::kCompute,
      [this](const v1::GetSharedMemoryStatusRequest& request, v1::GetSharedMemoryStatusResponse* response,
             std::string* detail) {
        *detail = absl::StrCat("name=", LogSafe(request.name()));
        ASSIGN_OR_RETURN(std::vector<std::shared_ptr<const SharedMemoryRegion>> regions,
                         parts_.shared_memory->List(request.name()));
        for (const auto& region : regions) {
          v1::SharedMemoryRegionStatus* status = response->add_regions();
          status->set_name(region->name());
          status->set_key(region->key());
          status->set_byte_size(region->size());
          status->set_intact(region->Intact().ok());
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionService::CreateSession(Context* context, const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return sessions_.CreateSession(Start("CreateSession", context, request, response));
}

grpc::ServerUnaryReactor* AttentionService::Extend(Context* context, const grpc::ByteBuffer* request,
                                                   grpc::ByteBuffer* response) {
  return sessions_.Extend(Start("Extend", context, request, response));
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionService::ExtendStream(Context* context) {
  return StartExtendStream(context, parts_.edge, &extend_step_);
}

grpc::ServerUnaryReactor* AttentionService::ForkSession(Context* context, const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return sessions_.ForkSession(Start("ForkSession", context, request, response));
}

grpc::ServerUnaryReactor* AttentionService::TruncateSession(Context* context, const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return sessions_.TruncateSession(Start("TruncateSession", context, request, response));
}

grpc::ServerUnaryReactor* AttentionService::CloseSession(Context* context, const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return sessions_.CloseSession(Start("CloseSession", context, request, response));
}

grpc::ServerUnaryReactor* AttentionService::ListSessions(Context* context, const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return sessions_.ListSessions(Start("ListSessions", context, request, response));
}

}  // namespace mha
