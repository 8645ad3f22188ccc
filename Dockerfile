# syntax=docker/dockerfile:1
#
# fabricgate node agent image:   docker build -t REGISTRY/fabricgate:VERSION .
#
# Base images are pinned by digest through the two ARGs below. deploy/pin-base-images.sh
# resolves the current digest of each tag and rewrites the defaults in place (run it, review the
# diff and the images' changelogs, commit). Until it has been run for a release the defaults are
# tags alone: this file was written on a machine with no registry access, and a digest copied
# from elsewhere could not be checked, so none is claimed. A release build passes pins anyway:
#   docker build \
#     --build-arg BUILD_IMAGE=rust:1-bookworm@sha256:<digest> \
#     --build-arg RUNTIME_IMAGE=debian:bookworm-slim@sha256:<digest> .
# Both stages must stay on the same Debian release (bookworm): the binary links the build
# stage's glibc and libibverbs.
ARG BUILD_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${BUILD_IMAGE} AS build
# rdma-sys runs bindgen (libclang) over the rdma-core headers and links libibverbs via
# pkg-config. Versions follow the pinned base image's Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libibverbs-dev librdmacm-dev pkg-config libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The Cargo profile: `release` (fat LTO, one codegen unit) unless a build passes another. The
# node tests' image (.ci/image.sh) passes `test-image` (Cargo.toml: release without LTO, many
# codegen units), which builds in a fraction of the time; the stages, packages, user and
# entrypoint are the same. Cargo puts profile `dev` in target/debug, every other in
# target/<profile>.
ARG CARGO_PROFILE=release
# --locked: the committed Cargo.lock is what gets built. The caches only speed up rebuilds;
# the binary is copied out of the cached target directory into the image layer.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile "$CARGO_PROFILE" --locked --bin fabricgate \
    && dir="$CARGO_PROFILE" && if [ "$dir" = dev ]; then dir=debug; fi \
    && install -D -m 0755 "target/$dir/fabricgate" /out/fabricgate

FROM ${RUNTIME_IMAGE}
# libibverbs1 is the verbs library the binary links; ibverbs-providers holds the user-space
# drivers it loads at run time (libmlx5 for ConnectX, librxe for Soft-RoCE). Nothing else.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/fabricgate /usr/local/bin/fabricgate
# Non-root by default (`docker run IMAGE check` needs nothing more when the uverbs device nodes
# are world-accessible, as rdma-core's udev rules make them). The DaemonSet runs it as UID 0
# with every capability dropped except IPC_LOCK, which only root can hold in Kubernetes
# (docs/deploy.md).
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/fabricgate"]
CMD ["run"]
