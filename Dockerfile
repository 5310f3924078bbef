# mhaserve container image (CPU). Multi-stage: build on Debian bookworm with the project's own install script,
# run with the runtime libraries only. The deploy issue builds and tests this image in CI with podman.
ARG BASE_IMAGE=debian:bookworm

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY deploy/install-deps.sh deploy/install-deps.sh
RUN deploy/install-deps.sh --build-only
COPY . .
RUN rm -rf build && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF \
 && cmake --build build --target mha_server mha_client

FROM ${BASE_IMAGE}
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libdnnl2 libspdlog1.10 libgomp1 ca-certificates \
      $(apt-cache search --names-only '^libabsl[0-9]+$' | cut -d' ' -f1) \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 mha
COPY --from=build /src/build/bin/mha_server /src/build/bin/mha_client /usr/local/bin/
USER mha
EXPOSE 50051
HEALTHCHECK --interval=10s --timeout=3s CMD ["/usr/local/bin/mha_client", "health", "--target", "127.0.0.1:50051", "--timeout_s", "2"]
ENTRYPOINT ["/usr/local/bin/mha_server", "--listen", "0.0.0.0:50051"]
