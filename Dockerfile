# mhaserve container image. Multi-stage: build on Debian bookworm with the project's own install script, run with
# the runtime libraries only. deploy/container-test.sh builds and runs both variants in CI with podman;
# docs/DEPLOY.md has the commands and the measured numbers.
#
#   README's container lines (under Deploy) (no registry needed), or where a registry is reachable:
#   podman build --format docker -t localhost/mhaserve:0.1.0 .      (docker build -t mhaserve:0.1.0 .)
#   podman run --rm --init --network host localhost/mhaserve:0.1.0 --listen 127.0.0.1:50051 [--threads N ...]
#
# Build arguments:
#   BASE_IMAGE  Debian bookworm image for every stage (default debian:bookworm; CI passes a debootstrapped local
#               localhost/debian:bookworm since no registry is reachable there).
#   VARIANT     cpu (default): configured with -DMHA_WITH_CUDA=OFF, the oneDNN CPU backend only.
#               cuda: configured with -DMHA_WITH_CUDA=ON against the build machine's CUDA 13 toolkit, mounted at
#               /mnt for the build (no NVIDIA base image is needed, nor is the 2.7 GB toolkit copied anywhere):
#                 podman build --volume /usr/local/cuda-13.0:/mnt:ro --build-arg VARIANT=cuda ...
#               /mnt because it exists in the base image: a mount point podman has to create stays behind as an
#               empty directory in every layer a RUN makes, the runtime stage's included.
#               The image also carries libcublas.so.13 and libcublasLt.so.13 (about 570 MiB), which the server
#               loads at start only when a GPU is present; libcuda.so.1 comes from the host's driver through the
#               NVIDIA container runtime. Without a GPU the server reports cuda unavailable, with the driver's
#               reason, and serves on the CPU. docs/DEPLOY.md, "Running on a GPU node".
#   CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES for VARIANT=cuda (default: the project's, sm_90 + compute_90 PTX).
# Both variants share the cached install layer of the build stage and the runtime packages' layer, so building
# the second costs its compile and, for cuda, the library layers.
ARG BASE_IMAGE=debian:bookworm

FROM ${BASE_IMAGE} AS build
WORKDIR /src
# The install script alone first, so this layer (the slow part) is cached across source changes.
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN deploy/install-deps.sh --build-only && rm -rf /var/lib/apt/lists/*
# Declared after the install step: a build argument takes part in the cache key of every RUN after it, and that
# layer is the same for both variants.
ARG VARIANT=cpu
# /out/root is laid over the runtime image's root: for cuda, cuBLAS from the mounted toolkit in the loader's
# default directory, where the server's dlopen("libcublas.so.13") finds it without an ld.so.cache entry (so the
# runtime stage runs nothing), and NVIDIA's licence for it (the EULA the cuBLAS and runtime wheels both carry); for
# cpu, nothing. Before the sources are copied, so the 570 MiB copy stays cached across source changes. cudart is
# linked statically; the toolkit's libraries have RUNPATH $ORIGIN, so libcublas finds libcublasLt beside it.
# /usr/local/cuda is where CMake looks for nvcc.
RUN mkdir -p /out/root /out/bin \
 && case "$VARIANT" in \
      cpu) ;; \
      cuda) [ -x /mnt/bin/nvcc ] && [ -e /mnt/lib/libcublas.so.13 ] \
          || { echo "VARIANT=cuda needs the CUDA 13 toolkit mounted at /mnt:" \
                    "podman build --volume /usr/local/cuda-13.0:/mnt:ro ..." >&2; exit 2; } \
        && ln -sfn /mnt /usr/local/cuda \
        && lib=/out/root/usr/lib/x86_64-linux-gnu doc=/out/root/usr/share/doc/mhaserve-cuda \
        && mkdir -p $lib $doc \
        && cp /usr/local/cuda/lib/libcublas.so.13 /usr/local/cuda/lib/libcublasLt.so.13 $lib/ \
        && cp /usr/local/cuda/dist-info/nvidia_cublas-*/licenses/License.txt $doc/NVIDIA-CUDA-EULA.txt ;; \
      *) echo "VARIANT must be cpu or cuda, got $VARIANT" >&2; exit 2 ;; \
    esac
COPY . .
# CMAKE_CUDA_ARCHITECTURES for VARIANT=cuda, e.g. "80-real;90" to add A100 machine code; empty: the project's
# default (sm_90 machine code and compute_90 PTX: H100/H200, and later GPUs through the driver's PTX compiler).
ARG CUDA_ARCHITECTURES=
# The git revision mha_server --version reports (the build context has no .git), e.g.
# --build-arg GIT_REVISION=$(git rev-parse --short=12 HEAD); empty: "unknown".
ARG GIT_REVISION=
# Only the two stripped binaries leave this step (in /out/bin): the build tree would make every cached layer large.
# The compiler cache is a cache mount (BuildKit's and buildah's RUN --mount=type=cache), kept by the builder between
# builds and out of every layer: the second variant, and a rebuild after a small change, take what is unchanged from
# it.
RUN --mount=type=cache,target=/root/.cache/ccache \
    cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
      -DMHA_WITH_CUDA=$([ "$VARIANT" = cuda ] && echo ON || echo OFF) \
      ${CUDA_ARCHITECTURES:+"-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCHITECTURES"} \
      ${GIT_REVISION:+"-DMHA_GIT_REVISION=$GIT_REVISION"} \
 && cmake --build build --target mha_server mha_client \
 && strip -o /out/bin/mha_server build/bin/mha_server && strip -o /out/bin/mha_client build/bin/mha_client \
 && rm -rf build
# Marks this stage's final image, which podman/buildah keep untagged after the build: README's `podman rmi
# --no-prune` line removes it and leaves the cached layers above (which have no label).
LABEL mhaserve.stage=build

FROM ${BASE_IMAGE}
# Exactly the packages owning the shared libraries the two binaries link (ldd + dpkg -S), nothing to build with.
# The same for both variants: the cuda variant's binary links cudart statically and dlopens cuBLAS.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libgrpc29 libprotobuf32 libabsl20220623 libre2-9 libc-ares2 libssl3 zlib1g \
      libdnnl2 ocl-icd-libopencl1 libgomp1 libspdlog1.10 libfmt9 libstdc++6 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
 && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin mha \
 && mkdir /layers
# cuda: cuBLAS (nothing for cpu). Before the binaries, so that a source change leaves this layer cached.
COPY --from=build /out/root/ /
COPY --from=build /out/bin/ /usr/local/bin/
ARG VARIANT=cpu
LABEL mhaserve.variant=$VARIANT
# Layers (*.safetensors) mounted at /layers are registered at start; the built-in "demo" layer is always there.
USER 10001:10001
# gRPC: mha.v1.Attention, grpc.health.v1.Health and reflection; Prometheus metrics at :9464/metrics.
EXPOSE 50051 9464 8081
# On SIGTERM the server drains in-flight calls for up to --shutdown_grace_s (25 s) and exits 0; as PID 1 it handles
# the signal itself.
STOPSIGNAL SIGTERM
# The health check asks the server it belongs to: the port it bound, from the port file the ENTRYPOINT names (in
# /tmp, a tmpfs under --read-only), whatever --listen says. Plaintext: with --tls_cert, give --health_listen and
# --health-cmd.
# Docker runs it on its own; podman schedules it with a systemd timer, so without systemd `podman run` logs systemd
# errors and the status stays "starting": run `podman healthcheck run NAME` yourself, or pass --no-healthcheck.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/bin/sh", "-c", "exec /usr/local/bin/mha_client health --target 127.0.0.1:$(cat /tmp/mha_server.port) --timeout_s 2"]
# Arguments after the image name are appended, and a repeated flag takes its last value, so
# `--listen 127.0.0.1:6000` or `--threads 4` override these defaults. Metrics follow --listen's host (":9464").
ENTRYPOINT ["/usr/local/bin/mha_server", "--listen", "0.0.0.0:50051", "--metrics_listen", ":9464", \
            "--layers_dir", "/layers", "--port_file", "/tmp/mha_server.port"]
