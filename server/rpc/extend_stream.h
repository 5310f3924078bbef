// ExtendStream: a stream of Extend steps on one HTTP/2 stream. Each request message becomes one step, a Call of
// its own (call.h) that ends through the stream instead of a unary reactor, run exactly as a unary Extend is
// (SessionService::ExtendStep): the sequencer's order per session, the scheduler's batching with every other
// Extend, its deadline and cancellation. One step at a time: the next message is read once the previous answer is
// written, so that a stream holds one request and one response at most.
#ifndef MHA_SERVER_RPC_EXTEND_STREAM_H_
#define MHA_SERVER_RPC_EXTEND_STREAM_H_

#include <functional>

#include "grpcpp/grpcpp.h"
#include "server/rpc/call.h"

namespace mha {

// Runs one step; the step's Call ends exactly once (its status reaches the stream through its CallEnd).
using StepRunner = std::function<void(Call step)>;

// The reactor of one ExtendStream call: owns itself, deleted when gRPC is done with it. `edge` and `run` are
// borrowed for the server's life.
grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* StartExtendStream(grpc::CallbackServerContext* context,
                                                                               CallEdge* edge, const StepRunner* run);

}  // namespace mha

#endif  // MHA_SERVER_RPC_EXTEND_STREAM_H_
