#include "server/server.h"

#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/status_macros.h"
#include "spdlog/spdlog.h"

namespace mha {

absl::StatusOr<std::unique_ptr<MhaServer>> MhaServer::Start(ServerOptions options) {
  if (options.max_message_mb < 1 || options.max_message_mb > 2047) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_mb must be in [1, 2047] (gRPC's limit is below 2 GiB), got ",
                     options.max_message_mb));
  }
  if (options.threads < 0) return absl::InvalidArgumentError("--threads must be >= 0");
  if (options.threads == 0) options.threads = std::max(1u, std::thread::hardware_concurrency());
  if (options.max_queue_size < 1) return absl::InvalidArgumentError("--max_queue_size must be >= 1");
  if (options.max_queued_mb < 1) return absl::InvalidArgumentError("--max_queued_mb must be >= 1");
  // Above 8 MFLOP the CPU backend parallelises, which must not happen on gRPC's threads.
  if (!(options.inline_max_mflop >= 0 && options.inline_max_mflop <= 8)) {
    return absl::InvalidArgumentError("--inline_max_mflop must be in [0, 8]");
  }

  std::unique_ptr<MhaServer> server(new MhaServer());
  server->layers_ = std::make_unique<LayerStore>(static_cast<int64_t>(options.max_layer_mb) << 20,
                                                  options.max_layers);
  RETURN_IF_ERROR(server->layers_->Add(MakeDemoLayer()));
  if (!options.layers_dir.empty()) RETURN_IF_ERROR(server->layers_->LoadDirectory(options.layers_dir));

  server->backends_ = BackendRegistry::Create();
  if (options.backend != "auto") {
    absl::StatusOr<Backend*> backend = server->backends_->Find(options.backend, "--backend");
    if (!backend.ok()) return backend.status();
  }
  for (const BackendEntry& entry : server->backends_->entries()) {
    spdlog::info("backend {}: {}", entry.name,
                 entry.available() ? entry.device : absl::StrCat("unavailable (", entry.detail, ")"));
  }
  for (const auto& layer : server->layers_->List()) {
    spdlog::info("layer {}: d_model={} H={} Hkv={} d_k={} ({})", layer->name, layer->d_model,
                 layer->heads.num_heads, layer->heads.num_kv_heads, layer->heads.head_dim, layer->source);
  }

  server->scheduler_ = std::make_unique<Scheduler>(options.threads, options.max_queue_size,
                                                   static_cast<int64_t>(options.max_queued_mb) << 20);
  server->WarmUp();
  server->metrics_ = std::make_unique<ServerMetrics>();
  if (!options.metrics_listen.empty()) RETURN_IF_ERROR(server->metrics_->Serve(options.metrics_listen));
  server->service_ = std::make_unique<AttentionService>(options, server->layers_.get(), server->backends_.get(),
                                                        server->scheduler_.get(), server->metrics_.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const int max_bytes = options.max_message_mb << 20;
  builder.SetMaxReceiveMessageSize(max_bytes);
  builder.SetMaxSendMessageSize(max_bytes);
  if (!options.listen.empty()) {
    builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &server->port_);
  }
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || (!options.listen.empty() && server->port_ == 0)) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  if (!options.port_file.empty()) {
    const std::string tmp = options.port_file + ".tmp";
    std::ofstream(tmp) << server->port_ << "\n";
    std::rename(tmp.c_str(), options.port_file.c_str());  // readers never see a half-written file
  }
  server->options_ = std::move(options);
  return server;
}

MhaServer::~MhaServer() { Shutdown(); }

void MhaServer::WarmUp() {
  // The first oneDNN call pays for library start-up, JIT code generation and the OpenMP thread pool (tens of ms);
  // pay it here, on the compute thread, rather than in the first client's latency.
  absl::StatusOr<Backend*> cpu = backends_->Find("cpu", "warm-up");
  absl::StatusOr<std::shared_ptr<const Layer>> demo = layers_->Get("demo");
  if (!cpu.ok() || !demo.ok()) return;
  absl::Notification done;
  const absl::Time start = absl::Now();
  const absl::Status submitted = scheduler_->Submit([&] {
    const Layer& layer = **demo;
    AttentionDims d;
    d.batch = 1;
    d.q_len = d.kv_len = 16;
    d.num_heads = layer.heads.num_heads;
    d.num_kv_heads = layer.heads.num_kv_heads;
    d.head_dim = layer.heads.head_dim;
    d.scale = layer.heads.scale;
    std::vector<float> x(d.q_len * layer.d_model, 0.5f), out(x.size());
    MhaArgs args;
    args.dims = d;
    args.weights = layer.Weights();
    args.query = args.key = args.value = x.data();
    args.self_attention = true;
    args.out = out.data();
    const absl::Status status = (*cpu)->MultiHeadAttention(args);
    if (!status.ok()) spdlog::warn("warm-up failed: {}", status.ToString());
    done.Notify();
  });
  if (submitted.ok()) done.WaitForNotification();
  spdlog::info("cpu backend warmed up in {} ms", absl::ToInt64Milliseconds(absl::Now() - start));
}

std::shared_ptr<grpc::Channel> MhaServer::InProcessChannel() {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_mb << 20);
  args.SetMaxSendMessageSize(options_.max_message_mb << 20);
  return server_->InProcessChannel(args);
}

void MhaServer::Shutdown(absl::Duration grace) {
  if (shut_down_) return;
  shut_down_ = true;
  // In-flight calls finish on the scheduler thread, which keeps running until the gRPC server has drained.
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  scheduler_->Shutdown();
  scheduler_.reset();
}

}  // namespace mha
