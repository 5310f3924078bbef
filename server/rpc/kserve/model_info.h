// What KServe v2's ModelMetadata and Triton's ModelConfig say of a model: a layer's (MultiHeadAttention's inputs
// and outputs with the layer's widths) or the model "sdpa"'s. Dims are -1 where the model leaves them free.
#ifndef MHA_SERVER_RPC_KSERVE_MODEL_INFO_H_
#define MHA_SERVER_RPC_KSERVE_MODEL_INFO_H_

#include "proto/inference/grpc_service.pb.h"
#include "server/layers/layer.h"

namespace mha {

// The platform and backend name every model reports.
inline constexpr char kPlatform[] = "mhaserve";

// `layer` null: the model "sdpa".
inference::ModelMetadataResponse ModelMetadataOf(const Layer* layer);
inference::ModelConfig ModelConfigOf(const Layer* layer);

}  // namespace mha

#endif  // MHA_SERVER_RPC_KSERVE_MODEL_INFO_H_
