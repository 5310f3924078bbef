# mhaserve container image. Multi-stage: build on Debian bookworm with the project's own install script, run with
# the runtime libraries only. deploy/container-test.sh builds and runs it in CI with podman; docs/DEPLOY.md has the
# commands and the measured numbers.
#
#   README's "Containers" lines (no registry needed), or where a registry is reachable:
#   podman build --format docker -t localhost/mhaserve:0.1.0 .      (docker build -t mhaserve:0.1.0 .)
#   podman run --rm --init --network host localhost/mhaserve:0.1.0 --listen 127.0.0.1:50051 [--threads N ...]
#
# Build arguments:
#   BASE_IMAGE  Debian bookworm image for both stages (default debian:bookworm; CI passes a debootstrapped local
#               localhost/debian:bookworm since no registry is reachable there).
#   VARIANT     cpu (default; what CI builds and tests) or cuda: adds Debian's CUDA 11.8 toolkit (contrib/non-free)
#               to the build stage and its runtime libraries to the image, and configures with -DMHA_WITH_CUDA=ON.
#               The CUDA backend is not in the tree yet (the server reports cuda "not compiled into this build"),
#               so today the cuda variant serves on the CPU; run it with the GPU passed in (docker --gpus all,
#               podman --device nvidia.com/gpu=all).
ARG BASE_IMAGE=debian:bookworm

FROM ${BASE_IMAGE} AS build
ARG VARIANT=cpu
WORKDIR /src
# The install script alone first, so this layer (the slow part) is cached across source changes.
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN deploy/install-deps.sh --build-only \
 && if [ "$VARIANT" = cuda ]; then \
      sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
        /etc/apt/sources.list.d/debian.sources \
      && apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nvidia-cuda-toolkit; \
    elif [ "$VARIANT" != cpu ]; then echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 2; fi \
 && rm -rf /var/lib/apt/lists/*
COPY . .
# Only the two stripped binaries leave this step (in /out): the build tree would make every cached layer large.
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
      $([ "$VARIANT" = cuda ] && echo -DMHA_WITH_CUDA=ON) \
 && cmake --build build --target mha_server mha_client \
 && mkdir /out && strip -o /out/mha_server build/bin/mha_server && strip -o /out/mha_client build/bin/mha_client \
 && rm -rf build
# Marks this stage's final image, which podman/buildah keep untagged after the build: README's `podman rmi
# --no-prune` line removes it and leaves the cached install layer above (which has no label).
LABEL mhaserve.stage=build

FROM ${BASE_IMAGE}
ARG VARIANT=cpu
# Exactly the packages owning the shared libraries the two binaries link (ldd + dpkg -S), nothing to build with.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 libc-ares2 libssl3 zlib1g \
      libdnnl2 ocl-icd-libopencl1 libgomp1 libspdlog1.10 libfmt9 libstdc++6 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
 && if [ "$VARIANT" = cuda ]; then \
      sed -i 's/^Components: main$/Components: main contrib non-free non-free-firmware/' \
        /etc/apt/sources.list.d/debian.sources \
      && apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libcudart11.0 libcublas11; \
    fi \
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin mha \
 && mkdir /layers
COPY --from=build /out/mha_server /out/mha_client /usr/local/bin/
# Layers (*.safetensors) mounted at /layers are registered at start; the built-in "demo" layer is always there.
USER 10001:10001
# gRPC: mha.v1.Attention, grpc.health.v1.Health and reflection; Prometheus metrics at :9464/metrics.
EXPOSE 50051 9464 8081
# The server drains in-flight calls for up to 30 s on SIGTERM and exits 0; as PID 1 it handles the signal itself.
STOPSIGNAL SIGTERM
# The health check asks the server it belongs to: the port it bound, from the port file the ENTRYPOINT names (in
# /tmp, a tmpfs under --read-only), whatever --listen says. Plaintext: with --tls_cert, give --health_listen and
# --health-cmd.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/bin/sh", "-c", "exec /usr/local/bin/mha_client health --target 127.0.0.1:$(cat /tmp/mha_server.port) --timeout_s 2"]
# Arguments after the image name are appended, and a repeated flag takes its last value, so
# `--listen 127.0.0.1:6000` or `--threads 4` override these defaults.
ENTRYPOINT ["/usr/local/bin/mha_server", "--listen", "0.0.0.0:50051", "--metrics_listen", "0.0.0.0:9464", \
            "--layers_dir", "/layers", "--port_file", "/tmp/mha_server.port"]
