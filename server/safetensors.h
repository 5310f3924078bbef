// The .safetensors layer reader lives in proto/mha/v1/safetensors.h, shared by the server and the clients; this
// header keeps the server's include path working.
#ifndef MHA_SERVER_SAFETENSORS_H_
#define MHA_SERVER_SAFETENSORS_H_

#include "proto/mha/v1/safetensors.h"

#endif  // MHA_SERVER_SAFETENSORS_H_
