#!/usr/bin/env bash
# Local images for the real-node tests (no registry is reachable from CI): an OCI archive
# holding
#   localhost/pause:3.10          pause.c from the Kubernetes module (v1.37.2), static, user 65535
#   localhost/debian:bookworm     Debian bookworm minbase (mmdebstrap) + libibverbs1,
#                                 ibverbs-providers, ca-certificates
#   localhost/fabricgate:standin  that root file system + a fabricgate binary (FABRICGATE_BIN),
#                                 ENTRYPOINT/CMD/USER as in the Dockerfile; used only when the
#                                 image built from the Dockerfile is not there
# Usage: images.sh OUT_DIR [FABRICGATE_BIN]. Cached in OUT_DIR by BASE_VERSION + pause.c (and
# the binary): a second run with the same inputs does nothing.
set -euo pipefail
out="$1"; bin="${2:-}"
mkdir -p "$out"
here="$(cd "$(dirname "$0")" && pwd)"
pause_c="$(ls -d "$(go env GOMODCACHE 2>/dev/null || echo "$HOME/go/pkg/mod")"/k8s.io/kubernetes@v1.37.2/build/pause/linux/pause.c)"
# Bump BASE_VERSION when the base images' recipe below changes.
BASE_VERSION=1
stamp="$( (echo "$BASE_VERSION"; cat "$pause_c") | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$out/base.stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$out/layout" "$out/rootfs.tar" "$out/work"
  mkdir -p "$out/work"
  mmdebstrap --variant=minbase --include=ca-certificates,libibverbs1,ibverbs-providers \
    bookworm "$out/rootfs.tar" http://deb.debian.org/debian
  umoci init --layout "$out/layout"
  # pause
  umoci new --image "$out/layout:pause"
  umoci unpack --rootless --image "$out/layout:pause" "$out/work/pause"
  gcc -Os -static -o "$out/work/pause/rootfs/pause" "$pause_c"
  umoci repack --image "$out/layout:pause" "$out/work/pause"
  umoci config --image "$out/layout:pause" --config.entrypoint /pause --config.user 65535:65535
  # debian
  umoci new --image "$out/layout:bookworm"
  umoci unpack --rootless --image "$out/layout:bookworm" "$out/work/bookworm"
  tar -C "$out/work/bookworm/rootfs" -xf "$out/rootfs.tar" --exclude='./dev/*' 2>/dev/null || true
  umoci repack --image "$out/layout:bookworm" "$out/work/bookworm"
  umoci config --image "$out/layout:bookworm" --config.cmd /bin/bash
  rm -rf "$out/work"
  echo "$stamp" > "$out/base.stamp"
fi
if [ -n "$bin" ]; then
  bstamp="$(cat "$out/base.stamp" "$bin" | sha256sum | cut -d' ' -f1)"
  if [ "$(cat "$out/standin.stamp" 2>/dev/null)" != "$bstamp" ]; then
    umoci rm --image "$out/layout:standin" 2>/dev/null || true
    umoci tag --image "$out/layout:bookworm" standin
    rm -rf "$out/work"; mkdir -p "$out/work"
    umoci unpack --rootless --image "$out/layout:standin" "$out/work/s"
    install -D -m 0755 "$bin" "$out/work/s/rootfs/usr/local/bin/fabricgate"
    strip "$out/work/s/rootfs/usr/local/bin/fabricgate" 2>/dev/null || true
    umoci repack --image "$out/layout:standin" "$out/work/s"
    umoci config --image "$out/layout:standin" --config.entrypoint /usr/local/bin/fabricgate \
      --config.cmd run --config.user 65532:65532
    rm -rf "$out/work"
    echo "$bstamp" > "$out/standin.stamp"
  fi
fi
# One archive per image: `ctr images import` of an OCI archive.
for tag in pause bookworm standin; do
  [ -n "$bin" ] || [ "$tag" != standin ] || continue
  if [ ! -e "$out/$tag.tar" ] || [ "$out/layout/index.json" -nt "$out/$tag.tar" ]; then
    skopeo copy --quiet "oci:$out/layout:$tag" "oci-archive:$out/$tag.tar.new:$tag"
    mv "$out/$tag.tar.new" "$out/$tag.tar"
  fi
done
echo "images ready in $out"
